"""The API process's side of updates: `DeltaService`, what the HTTP routes and follow mode call.

The service keeps the request flow; its parts are given to it (`DeltaService.of` wires a server's):

    Operations    one update or prefetch at a time: the lock, its deadline, what runs, the last
                  failure (operations.py)
    Ranks         the worker ranks: what they serve, read with as few calls as possible; the download
                  cache after an update (ranks.py; the policy: shared/cache_keep.py)
    WorkerUpdate  the protocol's steps here, one per update (worker_update.py; order: shared/two_phase.py)
    PrefetchSlot  a staged, verified update held for the update that takes it (prefetch.py)
    LiveChecks    the live checksum kept current, recomputed when it must be (live_checks.py)
    VersionGate   requests naming a `min_weight_version` (gating.py): told of every update, refuses
                  one (409) whose target is older than running requests need
    Follower      follow mode (follower.py): its updates go through `following` (following.py), the same steps
                  under the same lock as /v1/delta/update_weights; its state is part of status

An update: read what the ranks serve -> plan -> the gate -> stage, verify, write (or write the
prefetched update of the same plan) -> note what was written -> prune the download cache. Deadlines
(deadline.py) bound every store operation and everything before the pause (504, nothing written).
Status never takes the lock and never calls a worker (but while the live sums are unknown): it
answers at once, during an update too (a hung store must not hang the control plane).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...checksums import Sums
from ...format import VersionHeader
from ...server_api import (
    AppliedUpdate,
    Method,
    PrefetchRequest,
    PrefetchResult,
    Readiness,
    ServerStatus,
    UpdateMode,
    UpdateRequest,
    UpdateResult,
)
from ..shared.cache_keep import CacheKeeper
from ..shared.eplb import refuse_eplb, refuse_operation
from ..shared.messages import WorkerStatus
from ..shared.options import FollowOptions, ServiceOptions, StoreSpec
from ..shared.plan import UpdatePlan, plan_update
from ..shared.two_phase import PatchOptions, Update
from .api_process import ApiProcess
from .follower import Follower, readiness
from .following import FollowUpdates
from .gating import VersionGate
from .live_checks import LiveChecks
from .metrics import metrics
from .operations import Operations
from .prefetch import Prefetched, PrefetchSlot
from .ranks import Ranks
from .worker_update import WorkerUpdate, unchanged_result, update_result

if TYPE_CHECKING:
    from ...store import DeltaStore

log = logging.getLogger(__name__)


class DeltaService:
    def __init__(
        self,
        api: ApiProcess,
        store: Callable[[], DeltaStore],
        operations: Operations,
        ranks: Ranks,
        checks: LiveChecks,
        prefetched: PrefetchSlot,
    ) -> None:
        self.api = api
        self.spec = api.spec
        self.workers, self.engine_core = api.workers, api.engine_core  # for the routes that call them directly
        self._store = store
        self.operations = operations
        self.ranks = ranks
        self.gate = ranks.gate
        self.checks = checks
        self.prefetched = prefetched
        self.last_update: AppliedUpdate | None = None
        self.follower: Follower | None = None
        self.following = FollowUpdates(operations, ranks, ranks.gate, self._update)  # the follower's updates

    @classmethod
    def of(
        cls,
        engine_client: Any,
        spec: StoreSpec,
        options: ServiceOptions | None = None,
        gate: VersionGate | None = None,
        store: DeltaStore | None = None,
    ) -> DeltaService:
        """A server's service: its parts over vLLM's `engine_client`; the store (`spec.open()`, unless
        given) is opened at its first use."""
        options = options or ServiceOptions()
        gate = gate or VersionGate()
        gate.wait_s = options.min_version_wait_s
        api = ApiProcess.of(engine_client, spec)
        opened = functools.cache(lambda: store or spec.open())
        ranks = Ranks(api, opened, gate, functools.cache(lambda: CacheKeeper(opened(), spec.cache_max_bytes)))
        operations = Operations(api.deadline, functools.partial(refuse_operation, api.vllm_config))
        return cls(api, opened, operations, ranks, LiveChecks(ranks, operations), PrefetchSlot(api.workers))

    @property
    def store(self) -> DeltaStore:
        return self._store()

    # -- updates and prefetch -------------------------------------------------------------------
    async def prefetch(self, request: PrefetchRequest) -> PrefetchResult:
        async with self.operations.run("stage", request.version):
            served, _ = await self.ranks.read()
            plan = await self._plan(served, request)
            if not plan.versions:
                return PrefetchResult(version=served.version, staged=[])
            held = self.prefetched.take(served, plan, request.method)
            if held is None:
                await self.prefetched.drop()
                steps = self._steps(served, plan)
                staged = await steps.stage(self._new_update(plan, request.method, None))
                held = Prefetched(served.version, plan, staged, steps)
            self.prefetched.held = held
            await self.ranks.prune_cache(served.version, self.prefetched.versions)
            return held.result()

    async def update(self, request: UpdateRequest) -> UpdateResult:
        async with self.operations.run("update", request.version):
            served, _ = await self.ranks.read()
            return await self._update(served, request)

    async def follow_update(self, version: int, mode: UpdateMode) -> UpdateResult | None:
        """The follower's update (following.py): None when the server already serves `version` or newer."""
        return await self.following.forward(version, mode)

    async def _update(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        """One update from `served` (read under the lock, which the caller holds)."""
        plan = await self._plan(served, request)
        if not plan.versions:
            return await self._unchanged(served, request)
        self.gate.begin_update(plan.target)  # 409 if running requests need a newer version than the target
        try:
            out = await self._apply_plan(served, plan, request)
        finally:
            self.gate.end_update()
        if not served.probed:  # the layout was probed by this update: learn the coverage once
            with contextlib.suppress(Exception):
                await self.ranks.read()
        await self.ranks.prune_cache(out.version, self.prefetched.versions)
        return out

    async def _apply_plan(self, served: WorkerStatus, plan: UpdatePlan, request: UpdateRequest) -> UpdateResult:
        options = PatchOptions(request.mode, request.fault)
        prefetched = self.prefetched.take(served, plan, request.method)
        if prefetched is not None:
            steps = prefetched.steps
            applied = await steps.patch(prefetched.staged, options)
        else:
            await self.prefetched.drop()
            steps = self._steps(served, plan)
            applied = await steps.apply(self._new_update(plan, request.method, request.fault), options)
        out = update_result(plan, served.version, request, applied, prefetched is not None)
        assert steps.target_header is not None
        # One world's partials: every engine's copy was verified to move by the same (two_phase.worlds).
        self._note_applied(plan, out, steps.target_header, [s.partials for s in applied.staged.one_world()])
        return out

    async def _plan(self, served: WorkerStatus, request: PrefetchRequest | UpdateRequest) -> UpdatePlan:
        args = (self.store, served.version, served.checksum, request.version, request.allow_reanchor, self.api.trust)
        return await self.api.deadline.in_thread(functools.partial(plan_update, *args))

    def _steps(self, served: WorkerStatus, plan: UpdatePlan) -> WorkerUpdate:
        return WorkerUpdate(self.api, self.store, served, plan, self.checks.staged_against)

    @staticmethod
    def _new_update(plan: UpdatePlan, method: Method, fault: str | None) -> Update:
        return Update(uuid.uuid4().hex, plan.versions, plan.target, method, fault)

    async def _unchanged(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        target = await self.api.deadline.in_thread(functools.partial(self.store.resolve, request.version))
        if (m := metrics()) is not None:
            m.updates.labels(outcome="unchanged").inc()
        return unchanged_result(target, served.version, request)

    def _note_applied(self, plan: UpdatePlan, out: UpdateResult, header: VersionHeader, partials: list[Sums]) -> None:
        """What a written update changed: the served version, its recorded sums and chain (Ranks), the live
        sums (plus the ranks' partials), the metrics."""
        self.last_update = AppliedUpdate.of(out, time.time())
        recorded = self.ranks.written(plan, header)
        self.checks.applied(out.previous_version, out.version, partials, recorded)
        if (m := metrics()) is not None:
            m.applied(out)

    async def startup(self) -> None:
        """At start-up, before any request: learn what the ranks serve and their live sums (LiveChecks),
        and label outputs with the served version (vLLM says "default")."""
        async with self.operations.lock:
            served = await self.checks.at_startup()
            if served.version is not None and self.ranks.disagreement is None:
                try:
                    await self.api.engine_core.set_label(served.version, "startup")
                except Exception as exc:  # noqa: BLE001 - bookkeeping: attribution says "default" meanwhile
                    log.warning("vllm-delta: the weight-version label was not set: %s", exc)

    # -- follow mode ----------------------------------------------------------------------------------
    def start_follower(self, options: FollowOptions) -> Follower:
        """A Follower whose every update goes through this service (following.py), started as a task of the
        running event loop; its state is part of status(). `stop` ends it. Following on a server with
        EPLB is refused (the server does not start: shared/eplb.py)."""
        if options.follow:
            refuse_eplb(self.api.vllm_config, "to follow the store")
        self.follower = self.following.follower(self.store, options, self.served_version, self.checksums)
        self.follower.start()
        what = "following" if options.follow else "reporting to the ledger of"
        log.info("vllm-delta: %s %s (poll every %.1f s)", what, self.store.uri, options.poll_s)
        return self.follower

    async def served_version(self) -> int | None:
        """The served version, for the follower's polls: as last read or written, re-read from the ranks at
        most every ranks.SEEN_S (an RPC keeps vLLM's worker message queue spinning for a second: a poll
        every 0.5-2 s would keep a core per worker busy). follow_update re-reads under the lock."""
        if self.ranks.seen_recently():
            return self.ranks.served.version
        async with self.operations.lock:
            return (await self.ranks.read())[0].version

    async def checksums(self) -> tuple[str | None, str | None]:
        """(live checksum, the served version's recorded checksum), for ledger reports (LiveChecks.learnt)."""
        return await self.checks.learnt(), self.ranks.served.checksum

    # -- status, readiness ------------------------------------------------------------------------------
    async def status(self, *, verify: bool = False) -> ServerStatus:
        """What the server serves, from what this process keeps current (LiveChecks.before_status says
        when a worker is called). With `verify`, the live sums are recomputed from every rank first."""
        await self.checks.before_status(verify)
        served, view = self.ranks.served, self.ranks.view
        checksum, as_of = self.checks.current()
        ops = self.operations
        return ServerStatus(
            version=served.version,
            store=self.spec.uri,
            checksum=checksum,
            version_checksum=served.checksum,
            staged=self.prefetched.versions,
            last_update=self.last_update,
            tensors_via_vllm_path=view.fallback if view is not None else [],
            coverage=view.coverage if view is not None else None,
            as_of=as_of,
            update_in_progress=ops.in_progress.as_of_now() if ops.in_progress is not None else None,
            last_failure=ops.last_failure,
            follow=self.follower.status if self.follower is not None else None,
            verification=self.checks.verification,
            engines=self.ranks.engines or None,
            engines_disagree=self.ranks.disagreement,
        )

    def readiness(self, min_version: int | None) -> Readiness:
        """GET /v1/delta/ready (no worker call): follower.readiness; never ready while the data-parallel
        engines serve different versions."""
        answer = readiness(self.ranks.served.version, min_version, self.follower)
        if self.ranks.disagreement is not None:
            return dataclasses.replace(answer, ready=False, reason=self.ranks.disagreement)
        return answer

    async def stop(self) -> None:
        """Stop the follower, the audit and a re-read in progress (the app shuts down)."""
        await self.checks.stop()
        if self.follower is not None:
            await self.follower.stop()
            self.follower = None
