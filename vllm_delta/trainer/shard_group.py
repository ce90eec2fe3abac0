"""The shard group: the ranks of a sharded trainer publish each version together, one part per rank.

Every rank calls `publish` at the same step, detects, encodes and uploads only the elements it owns
(shard.py) as one *part* of the version; rank 0 writes the version's record once every part is
durable. Per publish, on the training thread (the control group):

1. `agree`: one small all_gather_object of an `AgreeMessage` (the version number, the tensor-set and
   layout fingerprints, dtype, codec, whether an anchor is needed, any unraised upload failure). Every
   rank leaves with the same version and anchor decision, or raises the same error: the upload
   failures first (PublishError), then any rank's bad input, then the disagreements (ShardingError,
   naming the tensor and the ranks; the row ranges are gathered and checked only when the layout is
   new);
2. `whole_sums`: after one device synchronization, one all_gather_object of per-tensor checksum
   partials (`PartialSums`), so every rank knows the whole-tensor checksums its part header records.

Per version, on each rank's upload thread (the upload group), `commit`: write and upload the part,
all_gather_object of a `PartReport` (the part's record, its error, or "my base is missing"), rank 0
commits the record only if every part is in the store, then broadcasts its `Decision` so that every
rank's `uploaded` future ends the same way. A failure anywhere leaves nothing visible; every rank
raises at its next `publish`/`flush`, and the next version is an anchor on every rank (decided
through the control gather). Both groups are gloo groups with a timeout, so a rank that dies makes the
others raise instead of waiting forever.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..checksums import add_sums, combine, to_hex
from ..errors import PublishError, ShardingError, StalenessTimeoutError
from ..format import PartInfo
from ..store import DeltaStore, PartRecord
from .encode import WriteFile
from .group import Agreement, Proposal, UploadsFailed
from .job import BaseMissing, CommitOutcome, Committed, UploadFailure, UploadJob
from .shard import Owned, check_layouts, describe_mismatch
from .staleness import StalenessGate

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)
M = TypeVar("M")


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


@dataclass(frozen=True)
class AgreeMessage:
    failure: UploadFailure | None  # an upload failure this rank has not raised yet
    terms: Terms | None  # None: this rank could not propose (`error` says why)
    error: str | None = None


@dataclass(frozen=True)
class PartialSums:
    values: list[int]  # per tensor, in the tensor set's order: the sum over this rank's elements
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
    """One rank of a sharded publisher (created collectively: every rank of `group` constructs one)."""

    def __init__(self, group: ProcessGroup, store: DeltaStore, *, timeout_s: float):
        import torch.distributed as dist

        self._dist = dist
        self.store = store
        ranks = dist.get_process_group_ranks(group)
        self.rank: int = dist.get_rank(group)
        self.world = len(ranks)
        self._src = ranks[0]  # global rank of the coordinator (group rank 0)
        timeout = datetime.timedelta(seconds=timeout_s)
        kw: dict[str, Any] = {"backend": "gloo", "timeout": timeout, "use_local_synchronization": True}
        self._control = dist.new_group(ranks, **kw)  # the training thread's collectives
        self._upload = dist.new_group(ranks, **kw)  # the upload thread's
        self._layouts: list[str] | None = None  # every rank's layout fingerprint, as last checked
        self._upload_broken: str | None = None  # a collective of the upload group failed: no more

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
                failure, Terms(own.version, o.fingerprint, o.layout_fingerprint, own.anchor, own.dtype, own.codec)
            )
        msgs = self._collective(lambda: self._gather(msg, self._control))
        try:
            settled = settle(msgs)
        except ShardingError as exc:
            raise exc from local_exc
        if isinstance(settled, UploadsFailed):
            return settled
        assert own is not None  # every rank proposed
        spec = own.ownership.spec
        if len({t.tensors for t in settled}) > 1:
            specs = self._collective(lambda: self._gather(spec, self._control))
            raise ShardingError("ranks publish different tensors: " + describe_mismatch(specs))
        layouts = [t.layout for t in settled]
        if layouts != self._layouts:
            ranges = self._collective(lambda: self._gather(own.ownership.ranges, self._control))
            check_layouts(spec, ranges)
            self._layouts = layouts
        return Agreement(own.version, own.ownership, anchor=any(t.anchor for t in settled))

    def wait_for_replicas(self, gate: StalenessGate, version: int) -> None:
        """Rank 0 reads the ledger; every rank learns the outcome (all publish, or all raise)."""
        error = None
        if self.rank == 0:
            try:
                gate.wait(version)
            except StalenessTimeoutError as exc:
                error = str(exc)
        errors = [e for e in self._collective(lambda: self._gather(error, self._control)) if e is not None]
        if errors:
            raise StalenessTimeoutError(errors[0])

    def whole_sums(
        self, names: list[str], partials: dict[str, int], nnz: int, error: Exception | None
    ) -> tuple[dict[str, int], int]:
        mine = (
            PartialSums([], 0, _describe(error))
            if error is not None
            else PartialSums([partials.get(n, 0) for n in names], nnz)
        )
        msgs = self._collective(lambda: self._gather(mine, self._control))
        for r, m in enumerate(msgs):
            if m.error is not None:
                if error is not None:
                    raise error
                raise ShardingError(f"rank {r} failed to detect its changes: {m.error}")
        return add_sums(dict(zip(names, m.values)) for m in msgs), sum(m.nnz for m in msgs)

    def part_of(self, owned: list[Owned], partials: dict[str, int]) -> PartInfo | None:
        return PartInfo(
            index=self.rank,
            count=self.world,
            checksum=to_hex(combine((o.name, partials[o.name]) for o in owned)),
            rows={o.name: [o.row0, o.row1] for o in owned},
        )

    # -- the upload thread -----------------------------------------------------------------------
    def commit(self, job: UploadJob, write: WriteFile, *, base_missing: bool) -> CommitOutcome:
        """Upload this rank's part, agree on the outcome with the other ranks; rank 0 commits."""
        if self._upload_broken is not None:
            raise PublishError(f"the publisher group failed earlier: {self._upload_broken}", version=job.version)
        report: PartReport = BaseMissing(job.base) if base_missing else self._put_part(job, write)
        try:
            with job.timed("commit"):
                reports = self._gather(report, self._upload)
                decision = self._broadcast(self._decide(job, reports) if self.rank == 0 else None)
        except Exception as exc:  # noqa: BLE001 - a rank died or timed out: the outcome is unknown here
            self._upload_broken = _describe(exc)
            raise PublishError(
                f"rank {self.rank}: the publisher group failed while committing "
                f"({self._upload_broken}); the version is not visible unless rank 0 committed it",
                version=job.version,
            ) from exc
        if isinstance(decision, Committed):
            return decision
        if isinstance(report, PartUploaded):
            self.store.discard_parts([report.part])
        if isinstance(decision, BaseMissing):
            return decision
        raise PublishError(decision.error, version=job.version)

    def _put_part(self, job: UploadJob, write: WriteFile) -> PartUploaded | PartFailed:
        try:
            with write() as f, job.timed("put_part"):
                return PartUploaded(self.store.put_part(f.header, f.path, move=True))
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            log.error("rank %d: part of version %d failed: %s", self.rank, job.version, exc)
            return PartFailed(_describe(exc))

    def _decide(self, job: UploadJob, reports: Sequence[PartReport]) -> Decision:
        """Rank 0: the record, if every part is in the store."""
        parts = decide_reports(reports, job.base)
        if not isinstance(parts, list):
            return parts
        try:
            return Committed(
                self.store.commit_parts(
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

    # -- collectives -----------------------------------------------------------------------------
    def _gather(self, obj: M, group: ProcessGroup) -> list[M]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=group)
        return out

    def _broadcast(self, obj: Decision | None) -> Decision:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._src, group=self._upload)
        decision = box[0]
        assert decision is not None
        return decision

    def _collective(self, fn: Callable[[], M]) -> M:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a rank died or timed out: nothing of this version exists
            raise PublishError(f"rank {self.rank}: the publisher group failed ({_describe(exc)})") from exc

    def close(self) -> None:
        for g in (self._control, self._upload):
            try:
                self._dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


__all__ = ["AgreeMessage", "PartReport", "PartialSums", "ShardGroup", "Terms", "decide_reports", "settle"]
