"""The update protocol as the API server process runs it (commit.TwoPhaseCommit over rpc.py's calls).

    plan      which versions to apply (plan.py: successor rule, 404 / 409)
    fetch     download the versions' files once into the host's cache, each checked against the
              record the plan was decided on (the workers of this host find them there)
    prepare   probe the layout on every rank, once
    stage     every rank decodes its share on a background thread; the server keeps generating
    verify    the ranks' checksum partials added to the served version's sums must give the target
              header's sums, per tensor (422 on mismatch: nothing has been written)
    pause     pause scheduling (mode keep | wait | abort)
    commit    ONE engine-core call (rpc.COMMIT_ALL, engine_core/reserved.py): every rank writes in place; if any
              rank fails, every rank rolls back; the weight-version label := the new version
    reset     the prefix cache (its KV was computed with the old weights), only after a commit
    resume    always (finally), unless a rollback failed: then the engine core stopped scheduling
    release   the staged buffers, on every rank

Mode "inflight" makes the same engine-core call with no pause: it runs between two engine steps and
also drops the prefix-cache hashes and taints running requests. Nothing is preempted.

Updates and prefetches are serialized by one asyncio.Lock, so two updates never interleave. Status
reads never take it: during an update a status answers at once from the last state it read, and says
what is in progress since when (a hung store must not hang the control plane); a status that an
update overtook while it read the workers answers the same way.

Deadlines: every store operation is bounded by the store's `timeout_s` (store.py), and everything an
update does before its pause by `update_timeout_s`; past it the update fails with StoreTimeoutError
(504) and nothing is written. After an applied update the download cache keeps the served version's
chain (and a prefetched one) and drops the rest; a staging that failed an integrity check drops the
cached copies of its versions, so the next try fetches them again.

Follow mode (follower.py): `start_follower` runs a Follower beside the service, which updates through
`follow_update` (the same steps under the same lock as /v1/delta/update_weights); its state is part of
GET /v1/delta/status.

What the service knows of the workers without asking them (`Served`): the served version and checksum
as last read or applied, and the served version's per-tensor sums (what staged partials add to; they
are those of its header, so they stay valid while the workers report the same version and checksum).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ...checksums import Sums, add_sums, combine, to_hex
from ...errors import (
    DeltaError,
    InflightRefusedError,
    RollbackFailedError,
    StoreTimeoutError,
    WorkerError,
    http_status,
)
from ...format import VersionHeader
from ..shared import rpc
from ..shared.commit import CommitOptions, Staged, TwoPhaseCommit, Update
from ..shared.messages import (
    PAUSE_MODES,
    AppliedUpdate,
    CommittedAll,
    Failure,
    FollowStatus,
    InProgress,
    Method,
    Operation,
    ServerStatus,
    StageRequest,
    StageResult,
    StageSummary,
    UpdateMode,
    UpdateRequest,
    UpdateResult,
    WorkerStatus,
)
from ..shared.options import FollowOptions, StoreSpec
from ..shared.plan import UpdatePlan, plan_update
from .metrics import metrics

if TYPE_CHECKING:
    from ...store import DeltaStore, VersionRecord
    from .follower import Follower

log = logging.getLogger(__name__)

SEEN_S = 30.0  # the follower's polls and reports reuse what was read from the workers this recently

POLL_S = 0.005  # first staging poll interval (each poll is one cheap RPC between forward passes) ...
POLL_MAX_S = 0.04  # ... growing to this: a long staging is not polled 200 times a second
RPC_TIMEOUT_S = float(os.environ.get("VLLM_DELTA_RPC_TIMEOUT_S", "600"))

R = TypeVar("R")


@dataclass(frozen=True)
class Applied:
    """A committed update, as the API process sees it."""

    staged: Staged
    pause_ms: float  # pause to resume; in flight: the engine loop's stall
    apply_ms: float  # the in-place writes, slowest rank
    inflight: CommittedAll | None = None  # mode "inflight": what the engine core did


@dataclass(frozen=True)
class Prefetched:
    """A staged, verified update (/v1/delta/stage), held until an update to the same target commits it."""

    served: int | None
    plan: UpdatePlan
    staged: Staged
    steps: WorkerUpdate  # the protocol that staged it, which commits it

    @property
    def ticket(self) -> str:
        return self.staged.update.ticket


@dataclass
class Served:
    """The served version as last read from the workers (or applied), and its recorded sums."""

    version: int | None = None
    checksum: str | None = None
    seen: float = float("-inf")  # time.monotonic() of the read or the commit
    sums: Sums | None = None  # the served version's per-tensor sums (its header's), when known


class WorkerUpdate(TwoPhaseCommit[Applied]):
    """The protocol's steps in the API process, for one plan made against `served`."""

    def __init__(self, service: DeltaService, served: WorkerStatus, plan: UpdatePlan):
        self.service = service
        self.served = served
        self.plan = plan
        self.target_header: VersionHeader | None = None
        self._sent: set[str] = set()  # tickets some rank may hold (staging was asked for)

    async def stage_ranks(self, update: Update) -> rpc.Replies[StageSummary]:
        svc = self.service
        # Fetch once here (a cache shared with the workers of this host), off the event loop, each file
        # checked against the record this plan was decided on; the target's header is kept to verify.
        for rec in self.plan.records:
            self.target_header = await svc.in_thread(functools.partial(_header_of, svc.store, rec))
        await svc.prepare(self.served, update.target)
        args = rpc.StageArgs(
            ticket=update.ticket,
            store=svc.spec,
            versions=update.versions,
            method=update.method,
            records=[r.to_json() for r in self.plan.records],
        )
        self._sent.add(update.ticket)
        (await svc.workers.stage_start(args)).all()
        return await svc.wait_staged(update.ticket)

    async def verification_basis(self, update: Update) -> tuple[Sums, VersionHeader]:
        assert self.target_header is not None
        return await self.service.served_sums(self.served), self.target_header

    async def commit_ranks(self, staged: Staged, options: CommitOptions) -> Applied:
        return await self.service.commit_staged(staged, options)

    async def release(self, ticket: str) -> None:
        if ticket in self._sent:  # best effort: errors are the workers' to log
            self._sent.discard(ticket)
            await self.service.workers.release(ticket)

    async def drop_cached(self, versions: list[int]) -> None:
        store = self.service.store
        await self.service.in_thread(functools.partial(store.prune_cache, versions=versions))


def _header_of(store: DeltaStore, rec: VersionRecord) -> VersionHeader:
    """Download (or find in the cache) a version's files, checked against `rec`; its header."""
    vf = store.open(rec.version, record=rec)
    try:
        return vf.header
    finally:
        vf.close()


class DeltaService:
    def __init__(self, engine_client: Any, spec: StoreSpec):
        self.engine = engine_client
        self.spec = spec
        transport = rpc.engine_client_transport(engine_client, RPC_TIMEOUT_S)
        self.workers = rpc.Workers(transport)
        self.engine_core = rpc.EngineCore(transport)
        self._store: DeltaStore | None = None
        self.lock = asyncio.Lock()
        self.prefetched: Prefetched | None = None
        self.last_update: AppliedUpdate | None = None
        self.in_progress: InProgress | None = None
        self.last_failure: Failure | None = None
        self.follower: Follower | None = None
        self._served = Served()
        self._last_status: ServerStatus | None = None  # what status answers while an update runs
        self._chain: list[int] | None = None  # the served version's chain (kept in the cache)
        self._deadline = float("inf")  # time.monotonic() by which the running update must reach its pause
        self._operations = 0  # updates and prefetches started (a status read notices one starting)
        self._status_lock = asyncio.Lock()  # status reads, one at a time (never the update lock)
        self._checksums_seen: tuple[int | None, str, str | None, float] | None = None  # for ledger reports
        self._inflight_refused: str | None = None  # why this engine refused an in-flight update (follow mode)

    @property
    def store(self) -> DeltaStore:
        if self._store is None:
            self._store = self.spec.open()
        return self._store

    # -- one operation at a time, with a deadline ---------------------------------------------
    @contextlib.asynccontextmanager
    async def _operation(self, name: Operation, version: int | str) -> AsyncIterator[None]:
        """Hold the lock for one update or prefetch: its deadline, in-progress state and metrics."""
        async with self.lock:
            self._operations += 1
            self.in_progress = InProgress(name, version, time.time())
            self._deadline = time.monotonic() + self.spec.update_timeout_s
            m = metrics()
            if m is not None:
                m.in_progress.set(1)
            try:
                yield
            except Exception as exc:
                type_name = exc.type_name if isinstance(exc, WorkerError) else type(exc).__name__
                self.last_failure = Failure(name, version, type_name, http_status(exc), str(exc)[:2000], time.time())
                if m is not None:
                    m.failed(name, type_name, http_status(exc))
                raise
            finally:
                self.in_progress = None
                self._deadline = float("inf")
                if m is not None:
                    m.in_progress.set(0)

    def _left(self, what: str, deadline: float | None = None) -> float:
        """Seconds left before the running update's deadline (or `deadline`); StoreTimeoutError when none are."""
        left = (self._deadline if deadline is None else deadline) - time.monotonic()
        if left <= 0:
            raise StoreTimeoutError(
                f"the update did not reach its pause within {self.spec.update_timeout_s:.0f} s "
                f"(update_timeout_s; store {self.spec.uri}, while {what}): nothing was written"
            )
        return left

    async def in_thread(self, fn: Callable[[], R], deadline: float | None = None) -> R:
        """`fn()` on a thread (store I/O stays off the event loop), bounded by the running update's
        deadline (or `deadline`, a time.monotonic()). A call past it is abandoned (its own store timeout
        ends it) and StoreTimeoutError is raised."""
        what = str(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "a store operation"))
        until = self._deadline if deadline is None else deadline
        future = asyncio.get_running_loop().run_in_executor(None, fn)
        try:
            return await asyncio.wait_for(future, self._left(what, until) if until != float("inf") else None)
        except asyncio.TimeoutError:
            self._left(what, until)  # raises: the deadline has passed
            raise

    # -- what the workers serve -------------------------------------------------------------------
    async def _read_served(self, *, live_sums: bool = False) -> tuple[WorkerStatus, list[WorkerStatus]]:
        """Every rank's status (one RPC); rank 0's, after checking that the ranks agree."""
        ranks = (await self.workers.status(live_sums=live_sums)).all()
        versions = {(r.version, r.checksum) for r in ranks}
        if len(versions) != 1:
            raise DeltaError(f"worker ranks disagree on the served version: {sorted(versions, key=str)}")
        rank0 = ranks[0]
        self._note_served(rank0.version, rank0.checksum)
        return rank0, ranks

    def _note_served(self, version: int | None, checksum: str | None, sums: Sums | None = None) -> None:
        known = self._served
        if sums is None and (known.version, known.checksum) == (version, checksum):
            sums = known.sums  # the same version: its recorded sums still hold
        self._served = Served(version, checksum, time.monotonic(), sums)
        m = metrics()
        if m is not None and version is not None:
            m.served_version.set(version)

    async def served_sums(self, served: WorkerStatus) -> Sums:
        """The per-tensor sums staged partials add to: the served version's recorded sums (known since
        the last update, else asked once), or the live sums when the served version is unknown."""
        if served.version is None:
            return await self._live_sums()
        known = self._served
        if (known.version, known.checksum) == (served.version, served.checksum) and known.sums is not None:
            return known.sums
        sums = (await self.workers.served_sums()).all()[0].sums
        self._note_served(served.version, served.checksum, sums)
        return sums

    async def _live_sums(self) -> Sums:
        return add_sums(r.sums for r in (await self.workers.live_sums()).all())

    async def prepare(self, served: WorkerStatus, version: int) -> None:
        if not served.prepared:
            (await self.workers.prepare(self.spec, version)).all()

    async def _ensure_prepared(self, served: WorkerStatus) -> bool:
        """Probe the layout if no rank has yet; True if it had to."""
        if served.prepared:
            return False
        until = time.monotonic() + self.spec.update_timeout_s
        version = served.version
        target = (
            version
            if version is not None
            else await self.in_thread(functools.partial(self.store.resolve, "latest"), deadline=until)
        )
        await self.prepare(served, target)
        return True

    # -- staging --------------------------------------------------------------------------------
    async def _plan(self, served: WorkerStatus, request: StageRequest | UpdateRequest) -> UpdatePlan:
        return await self.in_thread(
            functools.partial(
                plan_update, self.store, served.version, served.checksum, request.version, request.allow_reanchor
            )
        )

    def _take_prefetched(self, served: WorkerStatus, plan: UpdatePlan, method: Method) -> Prefetched | None:
        """The prefetched update if it is this plan's, from the same served version (then no longer held)."""
        p = self.prefetched
        if (
            p is not None
            and p.served == served.version
            and p.plan.versions == plan.versions
            and [r.to_json() for r in p.plan.records] == [r.to_json() for r in plan.records]
            and p.staged.update.method == method
        ):
            self.prefetched = None
            return p
        return None

    async def wait_staged(self, ticket: str) -> rpc.Replies[StageSummary]:
        """Poll every rank until its staging is done (or failed): its summary."""
        deadline = time.monotonic() + RPC_TIMEOUT_S
        interval = POLL_S
        while True:
            await asyncio.sleep(interval)
            polls = (await self.workers.stage_poll(ticket)).all()
            if all(p.summary is not None for p in polls):
                return rpc.Replies([p.summary for p in polls], [])
            self._left("the workers staged")
            if time.monotonic() > deadline:
                raise DeltaError(f"staging did not finish within {RPC_TIMEOUT_S:.0f} s")
            interval = min(interval * 1.5, POLL_MAX_S)

    async def _drop_prefetched(self) -> None:
        if self.prefetched is not None:
            ticket, self.prefetched = self.prefetched.ticket, None
            await self.workers.release(ticket)

    # -- public operations ----------------------------------------------------------------------
    async def stage(self, request: StageRequest) -> StageResult:
        async with self._operation("stage", request.version):
            served, _ = await self._read_served()
            plan = await self._plan(served, request)
            if not plan.versions:
                return StageResult(version=served.version, staged=[])
            staged = self._take_prefetched(served, plan, request.method)
            if staged is None:
                await self._drop_prefetched()
                steps = WorkerUpdate(self, served, plan)
                update = Update(uuid.uuid4().hex, plan.versions, plan.target, request.method)
                staged = Prefetched(served.version, plan, await steps.stage(update), steps)
            self.prefetched = staged
            await self._prune_cache(served.version)
            return StageResult(
                version=served.version,
                staged=staged.plan.versions,
                target=staged.plan.target,
                stage_ms=staged.staged.stage_ms,
                nnz=staged.plan.nnz,
                bytes=staged.plan.bytes,
            )

    async def update(self, request: UpdateRequest) -> UpdateResult:
        async with self._operation("update", request.version):
            served, _ = await self._read_served()
            return await self._update(served, request)

    async def follow_update(self, version: int, mode: UpdateMode) -> UpdateResult | None:
        """The follower's update: as /v1/delta/update_weights, unless the server already serves `version`
        or a newer one (a client's update got there first between the follower's poll and this lock):
        then None, and nothing is staged or applied. A follower never moves a server backwards."""
        async with self._operation("update", version):
            served, _ = await self._read_served()
            if served.version is not None and served.version >= version:
                return None
            if mode == "inflight" and self._inflight_refused is not None:
                mode = "keep"
            try:
                return await self._update(served, UpdateRequest(version, mode=mode))
            except InflightRefusedError as exc:
                # This engine can't take in-flight updates (the reason does not change while it runs):
                # the follower goes on in keep mode, instead of skipping a good version as refused.
                log.warning("vllm-delta: follow mode falls back from inflight to keep: %s", exc)
                self._inflight_refused = str(exc)
                served, _ = await self._read_served()
                return await self._update(served, UpdateRequest(version, mode="keep"))

    async def served_version(self) -> int | None:
        """The served version, for the follower's polls: as last read or applied, re-read from the workers
        at most every SEEN_S. Every RPC keeps vLLM's worker message queue spinning for a second (its
        idle mode starts after 1 s without messages): asking the workers at every 0.5-2 s poll would
        keep a core per worker busy. What a poll decides is re-read under the lock by follow_update."""
        if time.monotonic() - self._served.seen < SEEN_S:
            return self._served.version
        async with self.lock:
            return (await self._read_served())[0].version

    async def checksums(self) -> tuple[str, str | None]:
        """(live checksum over all ranks, the served version's recorded checksum), for ledger reports:
        computed when the served version changed, else at most every SEEN_S (see served_version)."""
        known = self._checksums_seen
        if known is not None and known[0] == self._served.version and time.monotonic() - known[3] < SEEN_S:
            return known[1], known[2]
        async with self.lock:
            served, live = await self._live_state()
            checksum = to_hex(combine(live.items()))
            self._checksums_seen = (served.version, checksum, served.checksum, time.monotonic())
            return checksum, served.checksum

    async def _live_state(self) -> tuple[WorkerStatus, Sums]:
        """Rank 0's status and the live per-tensor sums over all ranks, in one RPC (two the first time,
        when the layout has to be probed)."""
        served, ranks = await self._read_served(live_sums=True)
        if await self._ensure_prepared(served):
            served, ranks = await self._read_served(live_sums=True)
        if any(r.live_sums is None for r in ranks):
            raise DeltaError("a worker rank did not report its live sums")
        return served, add_sums(r.live_sums or {} for r in ranks)

    async def _update(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        """One update from `served` (read under the lock, which the caller holds through _operation)."""
        plan = await self._plan(served, request)
        if not plan.versions:
            return await self._unchanged(served, request)
        options = CommitOptions(request.mode, request.fault)
        prefetched = self._take_prefetched(served, plan, request.method)
        if prefetched is not None:
            steps = prefetched.steps
            applied = await steps.commit(prefetched.staged, options)
        else:
            await self._drop_prefetched()
            steps = WorkerUpdate(self, served, plan)
            applied = await steps.apply(Update(uuid.uuid4().hex, plan.versions, plan.target, request.method), options)
        summaries = applied.staged.summaries
        out = UpdateResult(
            version=plan.target,
            previous_version=served.version,
            pause_ms=applied.pause_ms,
            apply_ms=applied.apply_ms,
            stage_ms=applied.staged.stage_ms,
            nnz=plan.nnz,
            bytes=plan.bytes,
            applied=plan.versions,
            mode=request.mode,
            method=request.method,
            reanchored=plan.reanchor,
            prefetched=prefetched is not None,
            elements_written=sum(s.nnz for s in summaries),
            staged_bytes=sum(s.bytes for s in summaries),
            timings=summaries[0].timings,
            inflight=applied.inflight.answer() if applied.inflight is not None else None,
        )
        assert steps.target_header is not None
        self._note_applied(plan, out, steps.target_header)
        await self._prune_cache(out.version)
        return out

    async def _unchanged(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        """The answer to an update to the version already served: no pause, nothing applied."""
        target = await self.in_thread(functools.partial(self.store.resolve, request.version))
        m = metrics()
        if m is not None:
            m.updates.labels(outcome="unchanged").inc()
        return UpdateResult(
            version=target,
            previous_version=served.version,
            pause_ms=0.0,
            apply_ms=0.0,
            stage_ms=0.0,
            nnz=0,
            bytes=0,
            applied=[],
            mode=request.mode,
            method=request.method,
        )

    def _note_applied(self, plan: UpdatePlan, out: UpdateResult, header: VersionHeader) -> None:
        """What an applied update changed: the served version and its recorded sums, its chain in the
        cache, the state status answers while busy, the metrics."""
        self.last_update = AppliedUpdate.of(out, time.time())
        self._note_served(out.version, header.checksum, {n: int(e.checksum, 16) for n, e in header.tensors.items()})
        if plan.reanchor:
            self._chain = list(plan.versions)
        elif self._chain is not None:
            self._chain += plan.versions
        if self._last_status is not None:
            # What the commit verified: the target's sums (status reads the live ones when idle).
            self._last_status = dataclasses.replace(
                self._last_status,
                version=out.version,
                checksum=header.checksum,
                version_checksum=header.checksum,
                as_of=time.time(),
            )
        m = metrics()
        if m is not None:
            m.applied(out)

    async def _prune_cache(self, served: int | None) -> None:
        """Keep the served version's chain and the prefetched versions in the download cache, drop the
        rest (and a dead process's partial downloads); then apply the size cap. Never fails an update."""
        if served is None or self.store.is_local:
            return
        try:
            if self._chain is None or self._chain[-1] != served:
                self._chain = [r.version for r in await self.in_thread(functools.partial(self.store.chain, served))]
            staged = self.prefetched.plan.versions if self.prefetched else []
            keep = set(self._chain) | set(staged)
            await self.in_thread(
                functools.partial(
                    self.store.prune_cache, keep, max_bytes=self.spec.cache_max_bytes, protect=set(staged)
                )
            )
            m = metrics()
            if m is not None:
                m.cache_bytes.set(await self.in_thread(self.store.cache_bytes))
        except Exception as exc:  # noqa: BLE001 - a cache that can't be pruned now is pruned next time
            log.warning("vllm-delta: pruning the download cache failed: %s", exc)

    # -- the commit (WorkerUpdate.commit_ranks) -----------------------------------------------------
    async def commit_staged(self, staged: Staged, options: CommitOptions) -> Applied:
        """Commit a staged, verified update on every rank through ONE engine-core call (rpc.COMMIT_ALL):
        inside a pause (mode keep | wait | abort), or between two engine steps with no pause (mode
        "inflight"; InflightRefusedError, 409, where the engine cannot take it safely). A rank that
        fails rolls every rank back (CommitFailedError, 500); nothing has changed then."""
        self._deadline = float("inf")  # the pause is not cut short: commit and roll back run to the end
        update = staged.update
        args = rpc.CommitAllArgs(update.ticket, update.target, update.method, options.fault, options.mode)
        if options.mode not in PAUSE_MODES:
            inflight = await self.engine_core.commit_all(args)
            return Applied(staged, inflight.engine_ms, inflight.apply_ms, inflight)
        t0 = time.perf_counter()
        # Caches are reset after a successful commit only: a failed update leaves them valid.
        await self.engine.pause_generation(mode=options.mode, clear_cache=False)
        resume = True
        try:
            committed = await self.engine_core.commit_all(args)
            await self._reset_prefix_cache()
        except RollbackFailedError:
            resume = False  # the engine core stopped scheduling: the ranks may disagree
            raise
        finally:
            if resume:
                await self.engine.resume_generation()
        return Applied(staged, (time.perf_counter() - t0) * 1e3, committed.apply_ms)

    async def sync_label(self) -> None:
        """At start-up: label outputs with the version the workers serve (vLLM says "default")."""
        async with self.lock:
            served, _ = await self._read_served()
            if served.version is not None:
                try:
                    await self.engine_core.set_label(served.version, "startup")
                except Exception as exc:  # noqa: BLE001 - bookkeeping: attribution says "default" meanwhile
                    log.warning("vllm-delta: the weight-version label was not set: %s", exc)

    async def _reset_prefix_cache(self) -> None:
        for _ in range(50):
            if await self.engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
                return
            await asyncio.sleep(0.01)
        log.warning("vllm-delta: the prefix cache could not be reset after an update")

    # -- follow mode ----------------------------------------------------------------------------------
    def start_follower(self, options: FollowOptions) -> Follower:
        """A Follower whose every update goes through this service (its lock, staging, verification,
        two-phase commit and rollback), started as a task of the running event loop; its state is part
        of status(). `stop_follower` ends it."""
        from .follower import Follower

        async def apply(version: int) -> float | None:
            result = await self.follow_update(version, options.mode)
            return None if result is None else result.pause_ms

        self.follower = Follower(self.store, options, served=self.served_version, apply=apply, checksums=self.checksums)
        self.follower.start()
        what = "following" if options.follow else "reporting to the ledger of"
        log.info("vllm-delta: %s %s (poll every %.1f s)", what, self.store.uri, options.poll_s)
        return self.follower

    async def stop_follower(self) -> None:
        if self.follower is not None:
            await self.follower.stop()
            self.follower = None

    def _follow_status(self) -> FollowStatus | None:
        return self.follower.status if self.follower is not None else None

    # -- status ---------------------------------------------------------------------------------------
    async def status(self) -> ServerStatus:
        if self.in_progress is not None:
            return self._status_while_busy()
        async with self._status_lock:
            started = self._operations
            served, live = await self._live_state()
            if self._operations != started or self.in_progress is not None:
                return self._status_while_busy()  # an update started meanwhile: what was read may be torn
            self._last_status = ServerStatus(
                version=served.version,
                store=self.spec.uri,
                checksum=to_hex(combine(live.items())),
                version_checksum=served.checksum,
                staged=self.prefetched.plan.versions if self.prefetched else [],
                last_update=self.last_update,
                tensors_via_vllm_path=served.fallback,
                coverage=served.coverage,
                as_of=time.time(),
                last_failure=self.last_failure,
                follow=self._follow_status(),
            )
            return self._last_status

    def _status_while_busy(self) -> ServerStatus:
        """The last state read, marked with what runs now: never waits for the running update."""
        last = self.last_update
        known = self._last_status
        return ServerStatus(
            version=known.version if known else (last.version if last else None),
            store=self.spec.uri,
            checksum=known.checksum if known else None,
            version_checksum=known.version_checksum if known else None,
            staged=self.prefetched.plan.versions if self.prefetched else [],
            last_update=last,
            tensors_via_vllm_path=known.tensors_via_vllm_path if known else [],
            as_of=known.as_of if known else None,
            update_in_progress=self.in_progress.as_of_now() if self.in_progress is not None else None,
            last_failure=self.last_failure,
            coverage=known.coverage if known else None,
            follow=self._follow_status(),
        )
