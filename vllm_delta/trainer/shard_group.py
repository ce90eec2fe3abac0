"""The shard group: the ranks of a sharded trainer publish each version together, one part per rank.

Every rank calls `publish` at the same step, detects, encodes and uploads only the elements it owns
(shard.py) as one *part* of the version; rank 0 writes the version's record once every part is
durable. The ranks talk through two channels over the process group's key-value store
(rendezvous.py: no process group is formed, so creating a Publisher never waits for the other ranks,
and every wait has the deadline `ShardingOptions(timeout_s)`). Per publish, on the training thread
(the control channel):

1. `agree`: every rank's `AgreeMessage` (the version number, the tensor-set and layout fingerprints,
   dtype, codec, the store, whether an anchor is needed, any unraised upload failure). Every rank
   leaves with the same version and anchor decision, or raises the same error: the upload failures
   first (PublishError), then any rank's bad input, then the disagreements (ShardingError, naming the
   tensor and the ranks; the row ranges are sent and checked, on rank 0, only when the layout is new);
2. `whole_sums`: after one device synchronization, rank 0 adds every rank's per-tensor checksum
   partials (`PartialSums`) and every rank gets the whole-tensor checksums its part header records.

Per version, on each rank's upload thread (the upload channel), `commit`: write and upload the part,
send a `PartReport` (the part's record, its error, or "my base is missing"); rank 0 commits the record
only if every part is in the store, and every rank gets its `Decision`, so that every rank's
`uploaded` future ends the same way. A failure anywhere leaves nothing visible; every rank raises at
its next `publish`/`flush`, and the next version is an anchor on every rank (decided through the
control channel). A rank that dies or hangs makes the others raise RankTimeoutError within the
deadline, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checksums import combine_arrays, to_hex
from ..errors import PublishError, ShardingError, StalenessTimeoutError
from ..format import PartInfo
from ..store import DeltaStore, PartRecord
from .encode import WriteFile
from .group import Agreement, Proposal, UploadsFailed
from .job import BaseMissing, CommitOutcome, Committed, UploadFailure, UploadJob
from .rendezvous import RankChannel, group_ranks, group_store, next_instance
from .shard import Ownership, check_layouts, describe_mismatch
from .staleness import StalenessGate

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


# -- the messages (pickled by all_gather_object / broadcast_object_list) ----------------------------
@dataclass(frozen=True)
class Terms:
    """A rank's proposal, as the other ranks see it."""

    version: int
    tensors: str  # fingerprint of the tensor set: names, global shapes, how each is held
    layout: str  # fingerprint of the rows this rank holds
    anchor: bool  # this rank needs an anchor
    dtype: str
    codec: str
    store: str = ""  # the store's URI: ranks that publish to different stores are refused


@dataclass(frozen=True)
class AgreeMessage:
    failure: UploadFailure | None  # an upload failure this rank has not raised yet
    terms: Terms | None  # None: this rank could not propose (`error` says why)
    error: str | None = None


@dataclass(frozen=True)
class GateOutcome:
    """Rank 0's staleness wait, as every rank learns it."""

    error: str | None  # StalenessTimeoutError's message
    released_by: frozenset[int]  # marked versions that released the wait (StalenessGate.released_by)


_NO_SUMS = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class PartialSums:
    values: np.ndarray  # uint64 per tensor, in the tensor set's order: the sum over this rank's elements
    nnz: int  # changed elements this rank owns
    error: str | None = None  # this rank's detection failed (`values` empty)


@dataclass(frozen=True)
class PartUploaded:
    part: PartRecord


@dataclass(frozen=True)
class PartFailed:
    error: str


PartReport = PartUploaded | PartFailed | BaseMissing


@dataclass(frozen=True)
class CommitFailed:
    error: str


Decision = Committed | BaseMissing | CommitFailed


# -- the decisions every rank takes alike from the same messages ------------------------------------
def settle(msgs: Sequence[AgreeMessage]) -> list[Terms] | UploadsFailed:
    """Every rank's terms if the ranks may go on; the unraised upload failures if there are any.
    Raises ShardingError when a rank could not propose or the ranks differ in version, dtype or
    codec (the tensor sets and layouts are checked by the caller, which may need another gather)."""
    failed = [(r, m.failure) for r, m in enumerate(msgs) if m.failure is not None]
    if failed:
        return UploadsFailed(failed, world=len(msgs))
    terms: list[Terms] = []
    for r, m in enumerate(msgs):
        if m.terms is None:
            raise ShardingError(f"rank {r} could not publish: {m.error}")
        terms.append(m.terms)
    _same("version", [t.version for t in terms])
    _same("dtype", [t.dtype for t in terms])
    _same("codec", [t.codec for t in terms])
    _same("store", [t.store for t in terms])
    return terms


def _same(what: str, values: list[Any]) -> None:
    if len(set(values)) > 1:
        by = {v: [r for r, x in enumerate(values) if x == v] for v in dict.fromkeys(values)}
        raise ShardingError(
            f"ranks publish different {what}s: " + "; ".join(f"ranks {rs}: {what} {v}" for v, rs in by.items())
        )


def decide_reports(reports: Sequence[PartReport], base: int | None) -> list[PartRecord] | BaseMissing | CommitFailed:
    """Rank 0, from every rank's report: the parts to commit, or why there is nothing to commit."""
    for r, rep in enumerate(reports):
        if isinstance(rep, PartFailed):
            return CommitFailed(f"rank {r} failed to upload its part: {rep.error}")
    parts = [rep.part for rep in reports if isinstance(rep, PartUploaded)]
    return parts if len(parts) == len(reports) else BaseMissing(base)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ShardGroup:
    """One rank of a sharded publisher. Creating it does no I/O and waits for nobody (rendezvous.py);
    every rank of `group` creates its Publishers in the same order."""

    def __init__(self, group: ProcessGroup, store: DeltaStore, *, timeout_s: float):
        import torch.distributed as dist

        self.store = store
        ranks = group_ranks(group)
        self.rank: int = dist.get_rank(group)
        self.world = len(ranks)
        kv, instance = group_store(group), next_instance(ranks)

        def channel(name: str) -> RankChannel:
            return RankChannel(kv, instance=instance, name=name, rank=self.rank, world=self.world, timeout_s=timeout_s)

        self._control = channel("control")  # the training thread's exchanges
        self._upload = channel("upload")  # the upload thread's
        self._layouts: list[str] | None = None  # every rank's layout fingerprint, as last checked
        # ms the training thread's last exchanges waited for the other ranks, by step ("agree", "sums"):
        # named waits in the publish's timings (Publisher.publish adds them as "<step>_wait")
        self.waits: dict[str, float] = {}

    # -- the training thread ---------------------------------------------------------------------
    def agree(self, failure: UploadFailure | None, propose: Callable[[], Proposal]) -> Agreement | UploadsFailed:
        own: Proposal | None = None
        try:
            own = propose()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, raised by every rank
            local_exc: Exception | None = exc
            msg = AgreeMessage(failure, None, _describe(exc))
        else:
            local_exc = None
            o = own.ownership
            msg = AgreeMessage(
                failure,
                Terms(
                    own.version, o.fingerprint, o.layout_fingerprint, own.anchor, own.dtype, own.codec, self.store.uri
                ),
            )
        msgs = self._control.all_gather(msg, what="agree")
        self.waits["agree"] = self._control.last_wait_ms
        try:
            settled = settle(msgs)
        except ShardingError as exc:
            raise exc from local_exc
        if isinstance(settled, UploadsFailed):
            return settled
        assert own is not None  # every rank proposed
        spec = own.ownership.spec
        if len({t.tensors for t in settled}) > 1:
            mismatch = self._control.exchange(spec, describe_mismatch, what="the tensor sets")
            raise ShardingError("ranks publish different tensors: " + mismatch)
        layouts = [t.layout for t in settled]
        if layouts != self._layouts:
            self._control.exchange(own.ownership.ranges, lambda ranges: check_layouts(spec, ranges), what="the layouts")
            self._layouts = layouts
        return Agreement(own.version, own.ownership, anchor=any(t.anchor for t in settled))

    def wait_for_replicas(self, gate: StalenessGate, version: int) -> frozenset[int]:
        """Rank 0 reads the ledger; every rank learns the outcome (all publish, or all raise) and the
        marked versions that released the wait."""
        outcome = None
        if self.rank == 0:
            try:
                gate.wait(version)
                outcome = GateOutcome(None, gate.released_by)
            except StalenessTimeoutError as exc:
                outcome = GateOutcome(str(exc), frozenset())
        # The others wait as long as rank 0 may: its staleness deadline, then the group's.
        with self._control.longer_deadline(gate.policy.timeout_s):
            agreed: GateOutcome = self._control.broadcast(outcome, what="the staleness wait")
        if agreed.error is not None:
            raise StalenessTimeoutError(agreed.error)
        return agreed.released_by

    def whole_sums(
        self, own: Ownership, partials: np.ndarray, nnz: int, error: Exception | None
    ) -> tuple[np.ndarray, int]:
        mine = (
            PartialSums(_NO_SUMS, 0, _describe(error)) if error is not None else PartialSums(own.spread(partials), nnz)
        )
        total = self._control.exchange(mine, add_partials, what="the checksum partials")
        self.waits["sums"] = self._control.last_wait_ms
        if total.error is not None:
            if error is not None:
                raise error
            raise ShardingError(total.error)
        return total.values, total.nnz

    def part_of(self, own: Ownership, partials: np.ndarray) -> PartInfo | None:
        return PartInfo(
            index=self.rank,
            count=self.world,
            checksum=to_hex(combine_arrays(own.keys[own.owned_at], partials)),
            rows=dict(own.part_rows),  # the ranges are shared; the mapping is the part's own
        )

    # -- the upload thread -----------------------------------------------------------------------
    def commit(self, job: UploadJob, write: WriteFile, *, base_missing: bool) -> CommitOutcome:
        """Upload this rank's part, agree on the outcome with the other ranks; rank 0 commits."""
        if self._upload.broken is not None:
            raise PublishError(f"the publisher group failed earlier: {self._upload.broken}", version=job.version)
        report: PartReport = BaseMissing(job.base) if base_missing else self._put_part(job, write)
        try:
            with job.timed("commit"):
                decision: Decision = self._upload.exchange(
                    report,
                    lambda reports: self._timed_decide(job, reports),
                    what=f"the commit of version {job.version}",
                )
            job.timings["commit_wait"] = self._upload.last_wait_ms  # for the other ranks' parts (or rank 0)
        except Exception as exc:  # noqa: BLE001 - a rank died or timed out: the outcome is unknown here
            raise PublishError(
                f"rank {self.rank}: the publisher group failed while committing "
                f"({_describe(exc)}); the version is not visible unless rank 0 committed it",
                version=job.version,
            ) from exc
        if isinstance(decision, Committed):
            return decision
        if isinstance(report, PartUploaded):
            self.store.writer.discard_parts([report.part])
        if isinstance(decision, BaseMissing):
            return decision
        raise PublishError(decision.error, version=job.version)

    def _put_part(self, job: UploadJob, write: WriteFile) -> PartUploaded | PartFailed:
        try:
            with write() as f, job.timed("put_part"):
                return PartUploaded(self.store.writer.put_part(f.header, f.path, move=True))
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            log.error("rank %d: part of version %d failed: %s", self.rank, job.version, exc)
            return PartFailed(_describe(exc))

    def _timed_decide(self, job: UploadJob, reports: Sequence[PartReport]) -> Decision:
        with job.timed("record"):  # rank 0: the commit record written (the rest of "commit" is waiting)
            return self._decide(job, reports)

    def _decide(self, job: UploadJob, reports: Sequence[PartReport]) -> Decision:
        """Rank 0: the record, if every part is in the store."""
        parts = decide_reports(reports, job.base)
        if not isinstance(parts, list):
            return parts
        try:
            return Committed(
                self.store.writer.commit_parts(
                    version=job.version,
                    kind=job.kind,
                    base=job.base,
                    codec=job.codec,
                    nnz=job.nnz,
                    numel=job.numel,
                    checksum=job.checksum,
                    base_checksum=job.base_checksum,
                    parts=parts,
                    created=job.created,
                )
            )
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            log.error("commit of version %d failed: %s", job.version, exc)
            return CommitFailed(f"rank 0 could not commit: {_describe(exc)}")

    def close(self) -> None:
        self._control.close()
        self._upload.close()


def add_partials(msgs: Sequence[PartialSums]) -> PartialSums:
    """Rank 0: every rank's partials added up, per tensor (or the first rank's detection error)."""
    for r, m in enumerate(msgs):
        if m.error is not None:
            return PartialSums(_NO_SUMS, 0, f"rank {r} failed to detect its changes: {m.error}")
    # uint64 addition wraps mod 2^64, as checksums.add_sums does; one array op instead of world x tensors
    table = np.stack([np.asarray(m.values, dtype=np.uint64) for m in msgs])
    return PartialSums(table.sum(axis=0, dtype=np.uint64), sum(m.nnz for m in msgs))


__all__ = [
    "AgreeMessage",
    "add_partials",
    "GateOutcome",
    "PartReport",
    "PartialSums",
    "ShardGroup",
    "Terms",
    "decide_reports",
    "settle",
]
