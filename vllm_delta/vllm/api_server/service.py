"""The API server process's side of updates: `DeltaService`, what the HTTP routes and follow mode call.

An update runs the one protocol (shared/commit.py; its steps here: steps.py):

    plan      which versions to apply (shared/plan.py: successor rule, 404 / 409)
    fetch     download the versions' files once into the host's cache, each checked against the
              record the plan was decided on (the workers of this host find them there)
    prepare   probe the layout on every rank, once
    stage     every rank decodes its share on a background thread; the server keeps generating
    verify    the ranks' checksum partials added to the served version's sums must give the target
              header's sums, per tensor (422 on mismatch: nothing has been written)
    pause     pause scheduling (mode keep | wait | abort)
    commit    ONE engine-core call (rpc.COMMIT_ALL, engine_core/reserved.py): every rank writes in
              place; if any rank fails, every rank rolls back; the weight-version label := the new version
    reset     the prefix cache (its KV was computed with the old weights), only after a commit
    resume    always (finally), unless a rollback failed: then the engine core stopped scheduling
    release   the staged buffers, on every rank

Mode "inflight" makes the same engine-core call with no pause: it runs between two engine steps and
also drops the prefix-cache hashes and taints running requests. Nothing is preempted.

Updates and prefetches are serialized by one asyncio.Lock, so two updates never interleave. Status
never takes it and never calls a worker: the live checksum is recomputed once at start-up and kept
current at every commit (live.py), so a status answers at once, during an update too (a hung store
must not hang the control plane), with the served version, its checksum and what is in progress
since when. `?verify=true` recomputes it from every rank's parameters (under the lock), and so does
the background audit (`delta_audit_s`); a mismatch is logged, counted and shown in status.

Every commit goes through the version gate (gating.py): requests that name a `min_weight_version`
wait for it, and a commit to an older version than a running request needs is refused.

Deadlines (deadline.py): every store operation is bounded by the store's `timeout_s`, and everything
an update does before its pause by `update_timeout_s`; past it the update fails with StoreTimeoutError
(504) and nothing is written. After an applied update the download cache keeps the served version's
chain (and a prefetched one) and drops the rest; a staging that failed an integrity check drops the
cached copies of its versions, so the next try fetches them again.

Follow mode (follower.py): `start_follower` runs a Follower beside the service, which updates through
`follow_update` (the same steps under the same lock as /v1/delta/update_weights); its state is part of
GET /v1/delta/status.

What the service knows of the workers without asking them (`Served`): the served version and checksum
as last read or applied, and the served version's per-tensor sums (what staged partials add to; they
are those of its header, so they stay valid while the workers report the same version and checksum);
the live sums (`LiveChecksum`); rank 0's last status (coverage, tensors through vLLM's path).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...checksums import Sums, add_sums
from ...errors import (
    DeltaError,
    InflightRefusedError,
    ServerBusyError,
    WorkerError,
    http_status,
)
from ...format import VersionHeader
from ...server_api import (
    AppliedUpdate,
    Failure,
    FollowStatus,
    InProgress,
    Method,
    Operation,
    Readiness,
    ServerStatus,
    StageRequest,
    StageResult,
    UpdateMode,
    UpdateRequest,
    UpdateResult,
    Verification,
    VerifyTrigger,
)
from ..shared.commit import CommitOptions, Staged, Update
from ..shared.eplb import refuse_eplb
from ..shared.messages import WorkerStatus
from ..shared.options import FollowOptions, ServiceOptions, StoreSpec
from ..shared.plan import UpdatePlan, plan_update
from .gating import VersionGate
from .live import LiveChecksum
from .metrics import metrics, vllm_operation
from .steps import ApiProcess, WorkerUpdate

if TYPE_CHECKING:
    from ...store import DeltaStore
    from .follower import Follower

log = logging.getLogger(__name__)

SEEN_S = 30.0  # the follower's polls reuse the served version read from the workers this recently
VERIFY_WAIT_S = 60.0  # ?verify=true waits this long for a running update to end, then answers 503


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


class DeltaService:
    def __init__(
        self,
        engine_client: Any,
        spec: StoreSpec,
        options: ServiceOptions | None = None,
        gate: VersionGate | None = None,
    ):
        self.spec = spec
        self.options = options or ServiceOptions()
        self.gate = gate or VersionGate()
        self.gate.wait_s = self.options.min_version_wait_s
        self.api = ApiProcess.of(engine_client, spec)
        self.workers = self.api.workers
        self.engine_core = self.api.engine_core
        self.deadline = self.api.deadline
        self._store: DeltaStore | None = None
        self.lock = asyncio.Lock()
        self.prefetched: Prefetched | None = None
        self.last_update: AppliedUpdate | None = None
        self.in_progress: InProgress | None = None
        self.last_failure: Failure | None = None
        self.follower: Follower | None = None
        self._served = Served()
        self.live = LiveChecksum()  # the live sums over all ranks, kept current at every commit
        self.verification: Verification | None = None  # the last recomputation of the live sums
        self._view: WorkerStatus | None = None  # rank 0's last status: coverage, tensors through vLLM's path
        self._chain: list[int] | None = None  # the served version's chain (kept in the cache)
        self._operations = 0  # updates and prefetches started (a recomputation notices one starting)
        self._learning = asyncio.Lock()  # recomputations outside the update lock, one at a time
        self._inflight_refused: str | None = None  # why this engine refused an in-flight update (follow mode)
        self._audit: asyncio.Task[None] | None = None
        self._stale = False  # vLLM's own routes may have changed the weights (outside.py): re-read once
        self._reverify = False  # one of them wrote the weights, the workers' record unchanged: recompute once
        self._resyncing: asyncio.Task[None] | None = None

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
            self.deadline.start()
            m = metrics()
            if m is not None:
                m.in_progress.set(1)
            try:
                with vllm_operation(name):  # vLLM's vllm:rl_weight_update_* series, beside ours
                    refuse_eplb(self.api.vllm_config, "weight updates" if name == "update" else "staging a version")
                    yield
            except Exception as exc:
                type_name = exc.type_name if isinstance(exc, WorkerError) else type(exc).__name__
                self.last_failure = Failure(name, version, type_name, http_status(exc), str(exc)[:2000], time.time())
                if m is not None:
                    m.failed(name, type_name, http_status(exc))
                raise
            finally:
                self.in_progress = None
                self.deadline.clear()
                if m is not None:
                    m.in_progress.set(0)

    # -- what the workers serve -------------------------------------------------------------------
    async def _read_served(self, *, live_sums: bool = False) -> tuple[WorkerStatus, list[WorkerStatus]]:
        """Every rank's status (one RPC); rank 0's, after checking that the ranks agree."""
        ranks = (await self.workers.status(live_sums=live_sums)).all()
        versions = {(r.version, r.checksum) for r in ranks}
        if len(versions) != 1:
            raise DeltaError(f"worker ranks disagree on the served version: {sorted(versions, key=str)}")
        rank0 = ranks[0]
        known = self._served
        if known.seen > float("-inf") and (known.version, known.checksum) != (rank0.version, rank0.checksum):
            # Not a commit of this process (an update past the plugin): the live sums are unknown now.
            log.warning(
                "vllm-delta: the workers serve version %s (%s), not %s (%s) as last known",
                rank0.version,
                rank0.checksum,
                known.version,
                known.checksum,
            )
            self.live.forget()
        self._view = rank0
        self._note_served(rank0.version, rank0.checksum)
        return rank0, ranks

    def _note_served(self, version: int | None, checksum: str | None, sums: Sums | None = None) -> None:
        known = self._served
        if sums is None and (known.version, known.checksum) == (version, checksum):
            sums = known.sums  # the same version: its recorded sums still hold
        self._served = Served(version, checksum, time.monotonic(), sums)
        self.gate.note_served(version)  # wakes requests waiting for this version
        m = metrics()
        if m is not None and version is not None:
            m.served_version.set(version)

    async def served_sums(self, served: WorkerStatus) -> Sums:
        """The per-tensor sums staged partials add to: the served version's recorded sums (known since
        the last update, else asked once), or the live sums when the served version is unknown or the
        last verification found the weights are not that version's any more (something wrote them past
        the plugin, e.g. vLLM's /weight_checker reset: a re-anchor, staged against the live weights,
        then verifies against what they really are)."""
        if served.version is None:
            return await self._live_sums()
        v = self.verification
        if v is not None and not v.ok and v.version == served.version and self.live.known_for(served.version):
            assert self.live.sums is not None
            return dict(self.live.sums)
        known = self._served
        if (known.version, known.checksum) == (served.version, served.checksum) and known.sums is not None:
            return known.sums
        sums = (await self.workers.served_sums()).all()[0].sums
        self._note_served(served.version, served.checksum, sums)
        return sums

    async def _live_sums(self) -> Sums:
        return add_sums(r.sums for r in (await self.workers.live_sums()).all())

    async def _ensure_prepared(self, served: WorkerStatus) -> bool:
        """Probe the layout if no rank has yet; True if it had to."""
        if served.prepared:
            return False
        until = time.monotonic() + self.spec.update_timeout_s
        version = served.version
        target = (
            version
            if version is not None
            else await self.deadline.in_thread(functools.partial(self.store.resolve, "latest"), until)
        )
        (await self.workers.prepare(self.spec, target)).all()
        return True

    # -- staging --------------------------------------------------------------------------------
    async def _plan(self, served: WorkerStatus, request: StageRequest | UpdateRequest) -> UpdatePlan:
        return await self.deadline.in_thread(
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
                steps = WorkerUpdate(self.api, self.store, served, plan, self.served_sums)
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

    async def checksums(self) -> tuple[str | None, str | None]:
        """(live checksum over all ranks, the served version's recorded checksum), for ledger reports: the
        live checksum kept current (recomputed only when unknown), with no call into the workers."""
        if not self.live.known_for(self._served.version):
            await self._learn()
        return self.live.checksum if self.live.known_for(self._served.version) else None, self._served.checksum

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
        self.gate.begin_commit(plan.target)  # 409 if running requests need a newer version than the target
        try:
            out = await self._commit_plan(served, plan, request)
        finally:
            self.gate.end_commit()
        if not served.prepared:  # the layout was probed by this update: learn the coverage once
            with contextlib.suppress(Exception):
                await self._read_served()
        await self._prune_cache(out.version)
        return out

    async def _commit_plan(self, served: WorkerStatus, plan: UpdatePlan, request: UpdateRequest) -> UpdateResult:
        options = CommitOptions(request.mode, request.fault)
        prefetched = self._take_prefetched(served, plan, request.method)
        if prefetched is not None:
            steps = prefetched.steps
            applied = await steps.commit(prefetched.staged, options)
        else:
            await self._drop_prefetched()
            steps = WorkerUpdate(self.api, self.store, served, plan, self.served_sums)
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
        self._note_applied(plan, out, steps.target_header, [s.partials for s in summaries])
        return out

    async def _unchanged(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        """The answer to an update to the version already served: no pause, nothing applied."""
        target = await self.deadline.in_thread(functools.partial(self.store.resolve, request.version))
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

    def _note_applied(self, plan: UpdatePlan, out: UpdateResult, header: VersionHeader, partials: list[Sums]) -> None:
        """What an applied update changed: the live sums (plus the ranks' partials), the served version and
        its recorded sums, its chain in the cache, the metrics."""
        self.last_update = AppliedUpdate.of(out, time.time())
        recorded = {n: int(e.checksum, 16) for n, e in header.tensors.items()}
        self.live.committed(out.previous_version, out.version, partials, recorded)
        self._note_served(out.version, header.checksum, recorded)
        if plan.reanchor:
            self._chain = list(plan.versions)
        elif self._chain is not None:
            self._chain += plan.versions
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
                self._chain = [
                    r.version for r in await self.deadline.in_thread(functools.partial(self.store.chain, served))
                ]
            staged = self.prefetched.plan.versions if self.prefetched else []
            keep = set(self._chain) | set(staged)
            await self.deadline.in_thread(
                functools.partial(
                    self.store.prune_cache, keep, max_bytes=self.spec.cache_max_bytes, protect=set(staged)
                )
            )
            m = metrics()
            if m is not None:
                m.cache_bytes.set(await self.deadline.in_thread(self.store.cache_bytes))
        except Exception as exc:  # noqa: BLE001 - a cache that can't be pruned now is pruned next time
            log.warning("vllm-delta: pruning the download cache failed: %s", exc)

    async def startup(self) -> None:
        """At start-up, before any request: learn what the workers serve and recompute their live sums
        (one pass over the weights; a server whose layout is not probed yet learns them at its first
        status), and label outputs with the served version (vLLM says "default")."""
        async with self.lock:
            t0 = time.perf_counter()
            served, ranks = await self._read_served(live_sums=True)
            if all(r.live_sums is not None for r in ranks):
                live = add_sums(r.live_sums or {} for r in ranks)
                self._recomputed(served, live, "startup", (time.perf_counter() - t0) * 1e3)
            if served.version is not None:
                try:
                    await self.engine_core.set_label(served.version, "startup")
                except Exception as exc:  # noqa: BLE001 - bookkeeping: attribution says "default" meanwhile
                    log.warning("vllm-delta: the weight-version label was not set: %s", exc)

    # -- follow mode ----------------------------------------------------------------------------------
    def start_follower(self, options: FollowOptions) -> Follower:
        """A Follower whose every update goes through this service (its lock, staging, verification,
        two-phase commit and rollback), started as a task of the running event loop; its state is part
        of status(). `stop_follower` ends it. Following on a server with EPLB is refused (the server
        does not start: shared/eplb.py)."""
        from .follower import Follower

        if options.follow:
            refuse_eplb(self.api.vllm_config, "to follow the store")

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

    # -- status, verification, readiness -------------------------------------------------------------
    async def status(self, *, verify: bool = False) -> ServerStatus:
        """What the server serves, from what this process keeps current: no worker call (except once, while
        the live sums are unknown: a server that has not probed its layout yet). With `verify`, the live
        sums are recomputed from every rank first (a full pass; waits for a running update)."""
        if self._stale and self.in_progress is None:
            await self._resync()
        if verify:
            await self.verify("request")
        elif self._reverify and self.in_progress is None:
            self._reverify = False
            await self.verify("outside")
        elif not self.live.known_for(self._served.version) and self.in_progress is None:
            await self._learn()
        served, view = self._served, self._view
        known = self.live.known_for(served.version)
        return ServerStatus(
            version=served.version,
            store=self.spec.uri,
            checksum=self.live.checksum if known else None,
            version_checksum=served.checksum,
            staged=self.prefetched.plan.versions if self.prefetched else [],
            last_update=self.last_update,
            tensors_via_vllm_path=view.fallback if view is not None else [],
            coverage=view.coverage if view is not None else None,
            as_of=self.live.as_of if known else None,
            update_in_progress=self.in_progress.as_of_now() if self.in_progress is not None else None,
            last_failure=self.last_failure,
            follow=self._follow_status(),
            verification=self.verification,
        )

    async def verify(self, trigger: VerifyTrigger) -> Verification:
        """Recompute the live sums from every rank's parameters and compare them with those kept current
        (and the served version's recorded checksum). Holds the update lock: waits up to VERIFY_WAIT_S for
        a running update (then ServerBusyError, 503)."""
        try:
            await asyncio.wait_for(self.lock.acquire(), VERIFY_WAIT_S)
        except asyncio.TimeoutError:
            raise ServerBusyError(f"an update has held the lock for over {VERIFY_WAIT_S:.0f} s: verify later") from None
        try:
            t0 = time.perf_counter()
            served, live = await self._live_state()
            return self._recomputed(served, live, trigger, (time.perf_counter() - t0) * 1e3)
        finally:
            self.lock.release()

    async def _learn(self) -> None:
        """Recompute the live sums outside the update lock, once, when they are unknown; kept only if no
        update started meanwhile (what was read could be torn)."""
        async with self._learning:
            if self.live.known_for(self._served.version) or self.in_progress is not None:
                return
            started, t0 = self._operations, time.perf_counter()
            served, live = await self._live_state()
            if self._operations == started and self.in_progress is None:
                self._recomputed(served, live, "startup", (time.perf_counter() - t0) * 1e3)

    def past_the_plugin(self, *, weights_reset: bool = False) -> None:
        """One of vLLM's own routes may have changed the weights (outside.py): re-read what the workers
        serve before the next status answers, and soon in the background (so the gate learns it). After a
        reset (the weights written, the workers' record unchanged) the next status also recomputes the
        live sums (a verification: the tensors that changed are named)."""
        self._stale = True
        if weights_reset:
            self._reverify = True
        if self._resyncing is None or self._resyncing.done():
            self._resyncing = asyncio.get_running_loop().create_task(self._resync_quietly(), name="vllm-delta-resync")

    async def _resync_quietly(self) -> None:
        try:
            await self._resync()
        except Exception as exc:  # noqa: BLE001 - the next status tries again
            log.warning("vllm-delta: could not re-read the workers after one of vLLM's own routes: %s", exc)

    async def _resync(self) -> None:
        async with self._learning:
            if not self._stale or self.in_progress is not None:
                return  # an update reads the workers itself; a status after it re-reads if still stale
            self._stale = False
            try:
                await self._read_served()  # a different version or checksum forgets the live sums
            except Exception:
                self._stale = True
                raise

    def _recomputed(self, served: WorkerStatus, live: Sums, trigger: VerifyTrigger, ms: float) -> Verification:
        v = self.live.recomputed(served.version, live, version_checksum=served.checksum, trigger=trigger, ms=ms)
        self.verification = v
        m = metrics()
        if m is not None:
            m.verified(v)
        if not v.ok:
            log.error(
                "vllm-delta: LIVE CHECKSUM MISMATCH (%s): the live weights have checksum %s, version %s records %s, "
                "kept current %s; tensors that changed behind the plugin's back: %s",
                trigger,
                v.checksum,
                served.version,
                served.checksum,
                v.expected,
                v.mismatched or "none found (the weights differ from the version's since before)",
            )
        return v

    def readiness(self, min_version: int | None) -> Readiness:
        """GET /v1/delta/ready: whether to route traffic here (no worker call). With `min_version`: the served
        version reaches it. Without: a version is served and, in follow mode, it is the newest version the
        follower saw (or that one was skipped as bad): a server that starts or recovers behind is not ready."""
        served = self._served.version
        following = self.follower is not None and self.follower.options.follow
        newest = self.follower.state.newest_seen if self.follower is not None and following else None
        reason = None
        if served is None:
            reason = "the server serves no store version"
        elif min_version is not None:
            if served < min_version:
                reason = f"the server serves version {served}, below {min_version}"
        elif following and self.follower is not None:
            if newest is None:
                reason = "its follower has not read the store yet"
            elif served < newest and newest not in self.follower.state.skipped:
                reason = f"the server serves version {served}; its follower saw version {newest} in the store"
        return Readiness(
            ready=reason is None, version=served, min_version=min_version, newest_seen=newest, reason=reason
        )

    # -- the background audit -----------------------------------------------------------------------
    def start_audit(self, period_s: float) -> None:
        """Recompute the live sums every `period_s` seconds, skipping a round while an update runs."""
        if self._audit is None and period_s > 0:
            self._audit = asyncio.get_running_loop().create_task(self._audit_loop(period_s), name="vllm-delta-audit")

    async def _audit_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            if self.lock.locked():
                continue
            try:
                await self.verify("audit")
            except Exception as exc:  # noqa: BLE001 - the audit never dies: the next round tries again
                log.warning("vllm-delta: the live-checksum audit failed: %s", exc)

    async def stop(self) -> None:
        """Stop the follower, the audit and a re-read in progress (the app shuts down)."""
        for task in (self._audit, self._resyncing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._audit = self._resyncing = None
        await self.stop_follower()
