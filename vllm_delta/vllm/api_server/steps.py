"""The update protocol's steps in the API process (shared/commit.py owns their order).

stage_ranks          fetch the versions' files once into the host's cache (each checked against
                     the record the plan was decided on; the target's header is kept), probe the
                     layout if no rank has, start staging on every rank, poll until done
verification_basis   the served version's recorded sums (the service keeps them) and that header
commit_ranks         ONE engine-core call (rpc.COMMIT_ALL): inside a pause (keep | wait | abort:
                     pause, commit + label, prefix-cache reset, resume) or between two engine
                     steps (inflight)
release              the ticket on every rank that may hold it
drop_cached          the versions' cached copies (after an integrity failure)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...checksums import Sums
from ...errors import DeltaError, RollbackFailedError
from ...format import VersionHeader
from ...server_api import PAUSE_MODES
from ..shared import rpc
from ..shared.commit import CommitOptions, Staged, TwoPhaseCommit, Update
from ..shared.messages import CommittedAll, StageSummary, WorkerStatus
from ..shared.options import StoreSpec
from ..shared.plan import UpdatePlan
from .deadline import Deadline

if TYPE_CHECKING:
    from ...store import DeltaStore, VersionRecord

log = logging.getLogger(__name__)

POLL_S = 0.005  # first staging poll interval (each poll is one cheap RPC between forward passes) ...
POLL_MAX_S = 0.04  # ... growing to this: a long staging is not polled 200 times a second
RPC_TIMEOUT_S = float(os.environ.get("VLLM_DELTA_RPC_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class ApiProcess:
    """What the steps use in the API process."""

    engine: Any  # vLLM's EngineClient: pause, resume, prefix-cache reset
    workers: rpc.Workers
    engine_core: rpc.EngineCore
    spec: StoreSpec
    deadline: Deadline

    @property
    def vllm_config(self) -> Any:
        """vLLM's config of the engine (None for a stand-in engine without one)."""
        return getattr(self.engine, "vllm_config", None)

    @classmethod
    def of(cls, engine_client: Any, spec: StoreSpec) -> ApiProcess:
        transport = rpc.engine_client_transport(engine_client, RPC_TIMEOUT_S)
        return cls(
            engine_client,
            rpc.Workers(transport),
            rpc.EngineCore(transport),
            spec,
            Deadline(spec.update_timeout_s, spec.uri),
        )


@dataclass(frozen=True)
class Applied:
    """A committed update, as the API process sees it."""

    staged: Staged
    pause_ms: float  # pause to resume; in flight: the engine loop's stall
    apply_ms: float  # the in-place writes, slowest rank
    inflight: CommittedAll | None = None  # mode "inflight": what the engine core did


class WorkerUpdate(TwoPhaseCommit[Applied]):
    """The protocol's steps for one plan made against `served`."""

    def __init__(
        self,
        api: ApiProcess,
        store: DeltaStore,
        served: WorkerStatus,
        plan: UpdatePlan,
        served_sums: Callable[[WorkerStatus], Awaitable[Sums]],
    ):
        self.api = api
        self.store = store
        self.served = served
        self.plan = plan
        self._served_sums = served_sums
        self.target_header: VersionHeader | None = None
        self._sent: set[str] = set()  # tickets some rank may hold (staging was asked for)

    async def stage_ranks(self, update: Update) -> rpc.Replies[StageSummary]:
        api = self.api
        # Fetch once here (a cache shared with the workers of this host), off the event loop, each file
        # checked against the record this plan was decided on; the target's header is kept to verify.
        for rec in self.plan.records:
            self.target_header = await api.deadline.in_thread(functools.partial(_header_of, self.store, rec))
        if not self.served.prepared:
            (await api.workers.prepare(api.spec, update.target)).all()
        args = rpc.StageArgs(
            ticket=update.ticket,
            store=api.spec,
            versions=update.versions,
            method=update.method,
            records=[r.to_json() for r in self.plan.records],
        )
        self._sent.add(update.ticket)
        (await api.workers.stage_start(args)).all()
        return await self._wait_staged(update.ticket)

    async def _wait_staged(self, ticket: str) -> rpc.Replies[StageSummary]:
        """Poll every rank until its staging is done (or failed): its summary."""
        give_up = time.monotonic() + RPC_TIMEOUT_S
        interval = POLL_S
        while True:
            await asyncio.sleep(interval)
            polls = (await self.api.workers.stage_poll(ticket)).all()
            if all(p.summary is not None for p in polls):
                return rpc.Replies([p.summary for p in polls], [])
            self.api.deadline.left("the workers staged")
            if time.monotonic() > give_up:
                raise DeltaError(f"staging did not finish within {RPC_TIMEOUT_S:.0f} s")
            interval = min(interval * 1.5, POLL_MAX_S)

    async def verification_basis(self, update: Update) -> tuple[Sums, VersionHeader]:
        assert self.target_header is not None
        return await self._served_sums(self.served), self.target_header

    async def commit_ranks(self, staged: Staged, options: CommitOptions) -> Applied:
        return await commit_through_engine_core(self.api, staged, options)

    async def release(self, ticket: str) -> None:
        if ticket in self._sent:  # best effort: errors are the workers' to log
            self._sent.discard(ticket)
            await self.api.workers.release(ticket)

    async def drop_cached(self, versions: list[int]) -> None:
        await self.api.deadline.in_thread(functools.partial(self.store.prune_cache, versions=versions))


def _header_of(store: DeltaStore, rec: VersionRecord) -> VersionHeader:
    """Download (or find in the cache) a version's files, checked against `rec`; its header."""
    vf = store.open(rec.version, record=rec)
    try:
        return vf.header
    finally:
        vf.close()


async def commit_through_engine_core(api: ApiProcess, staged: Staged, options: CommitOptions) -> Applied:
    """Commit a staged, verified update on every rank through ONE engine-core call (rpc.COMMIT_ALL):
    inside a pause (mode keep | wait | abort), or between two engine steps with no pause (mode
    "inflight"; InflightRefusedError, 409, where the engine cannot take it safely). A rank that fails
    rolls every rank back (CommitFailedError, 500); nothing has changed then."""
    api.deadline.clear()  # the pause is not cut short: commit and roll back run to the end
    update = staged.update
    args = rpc.CommitAllArgs(update.ticket, update.target, update.method, options.fault, options.mode)
    if options.mode not in PAUSE_MODES:
        inflight = await api.engine_core.commit_all(args)
        return Applied(staged, inflight.engine_ms, inflight.apply_ms, inflight)
    t0 = time.perf_counter()
    # Caches are reset after a successful commit only: a failed update leaves them valid.
    await api.engine.pause_generation(mode=options.mode, clear_cache=False)
    resume = True
    try:
        committed = await api.engine_core.commit_all(args)
        await _reset_prefix_cache(api.engine)
    except RollbackFailedError:
        resume = False  # the engine core stopped scheduling: the ranks may disagree
        raise
    finally:
        if resume:
            await api.engine.resume_generation()
    return Applied(staged, (time.perf_counter() - t0) * 1e3, committed.apply_ms)


async def _reset_prefix_cache(engine: Any) -> None:
    for _ in range(50):
        if await engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            return
        await asyncio.sleep(0.01)
    log.warning("vllm-delta: the prefix cache could not be reset after an update")
