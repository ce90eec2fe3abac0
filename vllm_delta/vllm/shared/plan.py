"""Which versions an update applies, given what the server serves: the successor rule.

A server at S asked for T (T > S):
- T's chain passes through S: the deltas after S, in order, in one pause. The first delta's
  recorded base checksum must equal S's checksum, else 409 (the store was rewritten under the
  server: same version numbers, other weights).
- T's chain starts at an anchor after S (the publisher anchors every N versions): T's chain,
  anchor included, is staged against the live weights; only the elements that differ are written,
  so the pause stays sparse. Allowed when the store's record of S still has S's checksum (same
  run), else 409.
 A server at S asked for an older N (a rollback):
 - N on S's chain with a backward path (store/undo.py: every version from S down to N+1 a delta coded
   as differences, its files in the store): the deltas S, S-1, ..., N+1 are undone, newest first, in one
   pause (old = new - d), verified against N's header like any update. No `allow_reanchor` needed.
 - otherwise (an anchor in between, a `raw` delta, a file gone, N not on S's chain) 409 saying why,
   unless `"allow_reanchor": true`: then N's whole chain is replayed as before.
 Anything else needs `"allow_reanchor": true` (409 without it): S unknown (a server not started with
 --load-format delta).
A server with trusted keys first checks every record the plan would read (trust.py), backward plans
included (the deltas undone and the target whose header the result must match): a version not signed by
a trusted key, for the run it serves, is refused (403) whatever the rule says.

Every record the decision depends on is read afresh from the store (`fresh=True`): a store wiped and
refilled by another run reuses version numbers, and a record remembered from the old run would
let the new run's versions through.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import NotSuccessorError, VersionNotFoundError
from ...store import DeltaStore, VersionRecord
from .trust import TrustPolicy


@dataclass
class UpdatePlan:
    target: int
    versions: list[int]  # to stage, in order ([] if the server already serves the target); undone: newest first
    reanchor: bool  # the plan starts at an anchor: staged against the live weights
    nnz: int = 0  # changed elements the staged versions record (anchors: all elements)
    bytes: int = 0  # size of the staged version files
    records: list[VersionRecord] = field(default_factory=list)  # of `versions`, as read for this decision
    # A backward update: the target's record (its header is what the result must match); `versions` are
    # the deltas undone, newest first, down to the target.
    undo_to: VersionRecord | None = None

    @property
    def undone(self) -> list[int]:
        """The versions whose changes the plan takes back, newest first ([] for a forward plan)."""
        return self.versions if self.undo_to is not None else []

    @property
    def files(self) -> list[VersionRecord]:
        """The records of every version whose files a rank opens: `records`, then the target of a
        backward plan (for its header)."""
        return self.records + ([self.undo_to] if self.undo_to is not None else [])


def plan_update(
    store: DeltaStore,
    served_version: int | None,
    served_checksum: str | None,
    requested: int | str,
    allow_reanchor: bool = False,
    trust: TrustPolicy | None = None,
) -> UpdatePlan:
    """`trust`: a server with trusted keys: every record to apply is checked before anything else
    (trust.py: SignatureError, 403)."""
    target = store.resolve(requested)
    if served_version == target:
        store.record(target, fresh=True)
        return UpdatePlan(target, [], False)
    if served_version is not None and target < served_version:
        try:
            back = plan_back(store, served_version, served_checksum, target)
        except NotSuccessorError as exc:
            if not allow_reanchor:
                raise NotSuccessorError(
                    f'{exc}; send "allow_reanchor": true to replay its whole chain', version=target
                ) from None
        else:
            if trust is not None:
                trust.learn(store, served_version, served_checksum)
                trust.check(back.files)
            return back
    records = store.plan(served_version, target, fresh=True)
    if trust is not None:
        trust.learn(store, served_version, served_checksum)
        trust.check(records)
    first = records[0]
    through_served = served_version is not None and first.kind == "delta" and first.base == served_version
    if through_served:
        if first.base_checksum and served_checksum and first.base_checksum != served_checksum:
            raise NotSuccessorError(
                f"delta {first.version} expects base checksum {first.base_checksum}, the served version "
                f"{served_version} has {served_checksum} (was the store rewritten?)",
                version=first.version,
            )
    elif not allow_reanchor:
        why: str | None
        if served_version is None:
            why = "the served version is unknown (the server was not started with --load-format delta)"
        else:
            why = _same_run(store, served_version, served_checksum)
        if why:
            raise NotSuccessorError(
                f'version {target} is not a successor: {why}; send "allow_reanchor": true to replay its whole chain',
                version=target,
            )
    return UpdatePlan(
        target,
        [r.version for r in records],
        not through_served,
        nnz=sum(r.nnz for r in records),
        bytes=sum(r.bytes for r in records),
        records=records,
    )


def plan_back(store: DeltaStore, served_version: int, served_checksum: str | None, target: int) -> UpdatePlan:
    """The backward plan from `served_version` to the older `target`: the deltas to undo, newest first
    (NotSuccessorError saying why there is no backward path: store/undo.py)."""
    path = store.undo_path(served_version, served_checksum, target, fresh=True)
    return UpdatePlan(
        target,
        [r.version for r in path.undone],
        False,
        nnz=sum(r.nnz for r in path.undone),
        bytes=sum(r.bytes for r in path.undone),
        records=path.undone,
        undo_to=path.target,
    )


def _same_run(store: DeltaStore, served_version: int, served_checksum: str | None) -> str | None:
    """Why a newer anchor line is not this server's run, or None if it is."""
    try:
        rec = store.record(served_version, fresh=True)
    except VersionNotFoundError:
        return None  # retention removed the served version: a newer anchor is the only way forward
    if served_checksum and rec.checksum != served_checksum:
        return (
            f"the store's version {served_version} has checksum {rec.checksum}, the server's {served_checksum} "
            "(was the store rewritten?)"
        )
    return None
