"""The update protocol's steps in the API process (shared/two_phase.py owns their order).

One update, from the plan on (the service reads what the ranks serve and plans first):

    plan      which versions to apply, or to undo back to an older one (shared/plan.py: successor rule,
              backward path, 404 / 409)
    fetch     download the versions' files once into the host's cache, each checked against the
              record the plan was decided on; the target's header is kept (the workers of this host
              find the files there)
    probe     the layout on every rank, once
    stage     every rank decodes its share on a background thread, polled until done; the server
              keeps generating
    verify    the ranks' checksum partials added to the served version's sums (`Ranks.served_sums`)
              must give the target header's sums, per tensor (422 on mismatch: nothing has been written)
    pause     pause scheduling (mode keep | wait | abort)
    write     ONE engine-core call (rpc.PATCH_ALL, engine_core/calls.py): every rank writes in place;
              if any rank fails, every rank rolls back; the weight-version label := the new version
    reset     the prefix cache (its KV was computed with the old weights), only after the writes
    resume    always (finally), unless a rollback failed: then the engine core stopped scheduling
    release   the staged buffers, on every rank (drop_cached: the versions' cached copies, after an
              integrity failure)

Mode "inflight" makes the same engine-core call with no pause: it runs between two engine steps and
also drops the prefix-cache hashes and taints running requests. Nothing is preempted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ...checksums import Sums
from ...errors import (
    DeltaError,
    PatchFailedError,
    RollbackFailedError,
    error_type,
)
from ...format import VersionHeader
from ...server_api import PAUSE_MODES, UpdateRequest, UpdateResult
from ..shared import rpc
from ..shared.messages import PatchedAll, StageSummary, WorkerStatus
from ..shared.plan import UpdatePlan
from ..shared.two_phase import AllPatched, AllRolledBack, PatchOptions, Staged, TwoPhaseUpdate, Update, patch_all
from .api_process import RPC_TIMEOUT_S, ApiProcess

if TYPE_CHECKING:
    from ...store import DeltaStore, VersionRecord

log = logging.getLogger(__name__)

POLL_S = 0.005  # first staging poll interval (each poll is one cheap RPC between forward passes) ...
POLL_MAX_S = 0.04  # ... growing to this: a long staging is not polled 200 times a second


@dataclass(frozen=True)
class Applied:
    """A written update, as the API process sees it."""

    staged: Staged
    pause_ms: float  # pause to resume; in flight: the engine loop's stall
    apply_ms: float  # the in-place writes, slowest rank
    inflight: PatchedAll | None = None  # mode "inflight": what the engine core did


class WorkerUpdate(TwoPhaseUpdate[Applied]):
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
        # A backward plan's target comes last: the header the undone versions lead back to.
        files = self.plan.files
        for rec in files:
            self.target_header = await api.deadline.in_thread(functools.partial(_header_of, self.store, rec))
        if not self.served.probed:
            refused(await api.workers.probe(api.spec, update.target)).all()
        args = rpc.StageArgs(
            ticket=update.ticket,
            store=api.spec,
            versions=[r.version for r in files],
            method=update.method,
            records=[r.to_json() for r in files],
            fault=update.fault,
            undo=self.plan.undo_to is not None,
        )
        self._sent.add(update.ticket)
        refused(await api.workers.stage_start(args)).all()
        return await self._wait_staged(update.ticket)

    async def _wait_staged(self, ticket: str) -> rpc.Replies[StageSummary]:
        """Poll every rank until its staging is done (or failed): its summary."""
        give_up = time.monotonic() + RPC_TIMEOUT_S
        interval = POLL_S
        while True:
            await asyncio.sleep(interval)
            replies = await self.api.workers.stage_poll(ticket)
            polls = replies.all()
            if all(p.summary is not None for p in polls):
                return rpc.Replies([p.summary for p in polls], [], replies.where)
            self.api.deadline.left("the workers staged")
            if time.monotonic() > give_up:
                raise DeltaError(f"staging did not finish within {RPC_TIMEOUT_S:.0f} s")
            interval = min(interval * 1.5, POLL_MAX_S)

    async def verification_basis(self, update: Update) -> tuple[Sums, VersionHeader]:
        assert self.target_header is not None
        return await self._served_sums(self.served), self.target_header

    async def patch_ranks(self, staged: Staged, options: PatchOptions) -> Applied:
        return await patch_through_engine_core(self.api, staged, options)

    async def release(self, ticket: str) -> None:
        if ticket in self._sent:  # best effort: errors are the workers' to log
            self._sent.discard(ticket)
            await self.api.workers.release(ticket)

    async def drop_cached(self, versions: list[int]) -> None:
        await self.api.deadline.in_thread(functools.partial(self.store.cache.prune, versions=versions))


def _header_of(store: DeltaStore, rec: VersionRecord) -> VersionHeader:
    """Download (or find in the cache) a version's files, checked against `rec`; its header."""
    vf = store.open(rec.version, record=rec)
    try:
        return vf.header
    finally:
        vf.close()


async def patch_through_engine_core(api: ApiProcess, staged: Staged, options: PatchOptions) -> Applied:
    """Write a staged, verified update on every rank of every engine core: one engine-core call per engine
    (rpc.PATCH_ALL), inside a pause (mode keep | wait | abort: every engine paused), or between two engine
    steps with no pause (mode "inflight"; InflightRefusedError, 409, where an engine cannot take it
    safely). An engine with EPLB refuses in every mode (EplbRefusedError, 409: shared/eplb.py). A rank
    that fails rolls back every rank of its engine, and then every other engine is rolled back too
    (rpc.ROLLBACK_ALL; PatchFailedError, 500): nothing has changed anywhere then."""
    api.deadline.clear()  # the pause is not cut short: the writes and a rollback run to the end
    update = staged.update
    args = rpc.PatchAllArgs(update.ticket, update.target, update.method, options.fault, options.mode)
    if options.mode not in PAUSE_MODES:
        engines = await _patch_every_engine(api, args)
        inflight = inflight_of(engines)
        return Applied(staged, inflight.engine_ms, inflight.apply_ms, inflight)
    t0 = time.perf_counter()
    # Caches are reset after successful writes only: a failed update leaves them valid.
    await api.engine.pause_generation(mode=options.mode, clear_cache=False)  # every engine (vLLM's client)
    resume = True
    try:
        engines = await _patch_every_engine(api, args)
        await _reset_prefix_cache(api.engine)
    except RollbackFailedError:
        resume = False  # an engine core stopped scheduling: the ranks may disagree
        raise
    finally:
        if resume:
            await api.engine.resume_generation()
    return Applied(staged, (time.perf_counter() - t0) * 1e3, max(e.apply_ms for e in engines))


async def _patch_every_engine(api: ApiProcess, args: rpc.PatchAllArgs) -> list[PatchedAll]:
    """two_phase.patch_all over the engine cores: every engine writes all its ranks; if one failed, every
    engine is rolled back. Raises what the first failure was (a refusal, rpc.REFUSALS: nothing written, 409),
    PatchFailedError (500) or RollbackFailedError (500: every engine stops scheduling)."""
    engines = rpc.EnginePatches(api.engine_core, args)
    outcome = await patch_all(engines, args.ticket, method=args.method, fault=args.fault, after_patch=list)
    if isinstance(outcome, AllPatched):
        return outcome.after
    many = " on every engine" if api.engines > 1 else ""
    if isinstance(outcome, AllRolledBack):
        first = outcome.error
        refusal = rpc.REFUSALS.get(first.type) if first is not None else None
        if not many and first is not None and (refusal is not None or first.type == error_type(PatchFailedError)):
            raise (refusal or PatchFailedError)(first.message)  # one engine: as it was
        if refusal is not None:  # 409 (in flight, the follower falls back to keep): what another engine wrote is undone
            raise refusal(f"{outcome.failure} (no engine keeps any writes of this update)")
        raise PatchFailedError(f"update to version {args.version} failed and was rolled back{many}: {outcome.failure}")
    if args.mode not in PAUSE_MODES:  # the engines not stopped by their own failure keep stepping: stop them
        with contextlib.suppress(Exception):
            await api.engine.pause_generation(mode="keep", clear_cache=False)
    raise RollbackFailedError(
        f"update to version {args.version} failed ({outcome.failure}) and could not be rolled back"
        f"{many}: {outcome.rollback_failure}; scheduling is stopped: restart the server"
    )


R = TypeVar("R")


def refused(replies: rpc.Replies[R]) -> rpc.Replies[R]:
    """`replies`, unless a callee refused the call before doing anything (rpc.REFUSALS: the engine sleeps, ...):
    then that refusal, with its class (409 naming it)."""
    for _, error in replies.errors:
        refusal = rpc.REFUSALS.get(error.type)
        if refusal is not None:
            raise refusal(error.message)
    return replies


def inflight_of(engines: list[PatchedAll]) -> PatchedAll:
    """One in-flight answer for every engine: engine 0's label and step, the slowest engine's times,
    the counts summed over engines (each engine switched between two of its own steps)."""
    first = engines[0]
    if len(engines) == 1:
        return first
    return dataclasses.replace(
        first,
        engine_ms=max(e.engine_ms for e in engines),
        apply_ms=max(e.apply_ms for e in engines),
        dropped_blocks=sum(e.dropped_blocks for e in engines),
        dropped_blocks_in_use=sum(e.dropped_blocks_in_use for e in engines),
        tainted=sum(e.tainted for e in engines),
        batches_in_flight=sum(e.batches_in_flight for e in engines),
        switch={k: v for e in engines for k, v in e.switch.items()},
    )


async def _reset_prefix_cache(engine: Any) -> None:
    for _ in range(50):
        if await engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            return
        await asyncio.sleep(0.01)
    log.warning("vllm-delta: the prefix cache could not be reset after an update")


def update_result(
    plan: UpdatePlan, previous: int | None, request: UpdateRequest, applied: Applied, prefetched: bool
) -> UpdateResult:
    """The answer to an update that wrote `plan` from `previous`."""
    summaries = applied.staged.summaries
    return UpdateResult(
        version=plan.target,
        previous_version=previous,
        pause_ms=applied.pause_ms,
        apply_ms=applied.apply_ms,
        stage_ms=applied.staged.stage_ms,
        nnz=plan.nnz,
        bytes=plan.bytes,
        applied=[] if plan.undo_to is not None else plan.versions,
        mode=request.mode,
        method=request.method,
        undone=plan.undone or None,
        reanchored=plan.reanchor,
        prefetched=prefetched,
        elements_written=sum(s.nnz for s in summaries),
        staged_bytes=sum(s.bytes for s in summaries),
        decoded_per_rank=[s.decoded for s in summaries],
        timings=summaries[0].timings,
        inflight=applied.inflight.answer() if applied.inflight is not None else None,
    )


def unchanged_result(target: int, previous: int | None, request: UpdateRequest) -> UpdateResult:
    """The answer to an update to the version already served (`target`): no pause, nothing applied."""
    return UpdateResult(
        version=target,
        previous_version=previous,
        pause_ms=0.0,
        apply_ms=0.0,
        stage_ms=0.0,
        nnz=0,
        bytes=0,
        applied=[],
        mode=request.mode,
        method=request.method,
    )
