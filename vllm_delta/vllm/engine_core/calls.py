"""The engine-core calls: the in-place writes of every update, in a pause or in flight (`"mode": "inflight"`),
the weight-version label and its history, the prefix-cache state.

The writes are ONE call on the engine-core thread (rpc.PATCH_ALL), so it runs strictly between two
engine steps (vLLM dispatches utilities from its busy loop between `step_fn()` calls). The API
process reaches it through the public `EngineClient.collective_rpc`: the plugin wraps
`EngineCore.collective_rpc` and answers the reserved names (rpc.ENGINE_CORE_CALLS) itself instead of
forwarding them to the workers. In that one call (`write_between_steps`, around two_phase.patch_all):

    refuse      every mode: no write on a server with EPLB (shared/eplb.py), none while the engine sleeps
                (sleep.py), none after a failed rollback
    preflight   mode "inflight" only: refuse what cannot be made safe (409 + reason): KV /
                encoder-cache / aux-output connectors, multimodal encoder caches, data parallelism,
                an unknown scheduler
    write       rpc.PATCH on every worker rank (one broadcast: every rank writes after the same
                forward step; worker methods never raise)
    rollback    if any rank failed: rpc.ROLLBACK on every rank in the same call, so no forward ever
                sees mixed weights; if the rollback fails too, scheduling stops (PAUSED_ALL) and
                every later write answers 500
    invalidate  mode "inflight", on success only: drop every cached prefix hash (blocks in use stay
                valid for the requests holding them) and taint every request that holds KV, so it
                never inserts hashes later (its blocks mix old and new weights). In a pause mode the
                API process resets the prefix cache itself (vLLM's reset, once the writes are done)
    label       set vLLM's weight-version label (stamped on each step's outputs; under a batch
                queue the batches already in flight keep the old label) and record the update in
                a bounded history (engine step, time; in flight, each running request's switch index)

Data parallelism: the API process makes this call on every engine core and, if one failed, calls
rpc.ROLLBACK_ALL on every engine (`rollback_between_steps`): an engine whose writes landed rolls
every rank back, and its label goes back to the one before (recorded as a "rollback" in the history;
in flight, with the same prefix-cache invalidation and taint as the writes, since the engine may
have stepped on the new weights meanwhile). A failed rollback stops scheduling, as above.

Worker ordering: `MultiprocExecutor` sends one message on a broadcast queue read by every rank, and
each worker runs its queue in order, so the writes run after the forward steps already dispatched
and before any later one, on every rank. On GPU the writes are issued on the worker's current stream
(the forward's) and synchronized before the reply (apply/engine.py).

Nothing here imports vLLM at module level: the plugin patches vLLM's classes in `install()`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...attribution import parse_label, version_label
from ...errors import InflightRefusedError, PatchFailedError, RollbackFailedError
from ...server_api import PAUSE_MODES, HistoryEntry, Timeline
from ..shared import rpc
from ..shared.eplb import refuse_eplb
from ..shared.messages import LabelSet, Patched, PatchedAll, PrefixCleared, PrefixState, RolledBackAll
from ..shared.two_phase import AllPatched, AllRolledBack, patch_all, run_sync
from . import provenance, sleep
from .provenance import external_id

log = logging.getLogger(__name__)

TAINT_ATTR = "_vllm_delta_tainted"  # on vLLM Request objects: never insert prefix-cache hashes
STATE_ATTR = "_vllm_delta_inflight"  # on the EngineCore: its EngineState
HISTORY_LIMIT = 256  # label changes kept by the engine core
PATCHED_ATTR = "_vllm_delta_patched"


@dataclass
class EngineState:
    """What the engine core keeps between updates."""

    history: deque[HistoryEntry] = field(default_factory=lambda: deque(maxlen=HISTORY_LIMIT))
    steps: int = 0  # labelled engine steps so far (one per step that produced outputs)
    # Labels of the batches that were already dispatched at an update (batch queue: async scheduling,
    # pipeline parallelism), oldest first: they ran on the weights before it and keep that label.
    held: deque[str] = field(default_factory=deque)
    inconsistent: str | None = None  # set when a rollback failed: the ranks may disagree
    landed: Landed | None = None  # the last PATCH_ALL whose writes landed (ROLLBACK_ALL may undo them)


@dataclass(frozen=True)
class Landed:
    """A PATCH_ALL whose writes landed: what ROLLBACK_ALL needs to undo it (the label before it)."""

    ticket: str
    previous_label: str
    inflight: bool


def state_of(core: Any) -> EngineState:
    st = getattr(core, STATE_ATTR, None)
    if st is None:
        st = EngineState()
        setattr(core, STATE_ATTR, st)
    return st


# -- preflight -------------------------------------------------------------------------------------
def preflight(core: Any) -> list[str]:
    """Why an in-flight update cannot be made safe on this engine ([] when it can)."""
    reasons: list[str] = []
    config = core.vllm_config
    scheduler = core.scheduler
    if getattr(scheduler, "connector", None) is not None:
        reasons.append(
            "a KV connector is configured (--kv-transfer-config / KV offloading): KV held outside this "
            "engine was computed with the old weights under the same prefix hashes, and it cannot be "
            "invalidated between two steps"
        )
    if getattr(scheduler, "ec_connector", None) is not None:
        reasons.append("an encoder-cache connector is configured: it holds encoder outputs of the old weights")
    if getattr(scheduler, "aux_output_connector", None) is not None:
        reasons.append("auxiliary outputs (--aux-output-config) are keyed by prefix hashes of running requests")
    if getattr(config.model_config, "is_multimodal_model", False):
        reasons.append(
            "a multimodal model: encoder outputs of the old weights stay cached for running and new requests"
        )
    if getattr(config.parallel_config, "data_parallel_size", 1) > 1:
        # vLLM runs dense models' data-parallel engines as independent engines of size 1 (they pass
        # here, each switching between two of its own steps); MoE engines keep the size: they step in
        # lockstep and split the experts among them, and each engine would switch at its own step.
        reasons.append(
            "data parallelism with a mixture-of-experts model: the engines split the experts and step "
            "together, but each would switch weights between two of its own steps, so one forward could "
            "mix versions across engines; use mode keep"
        )
    if not _block_pools(scheduler):
        reasons.append(f"the scheduler {type(scheduler).__name__} has no prefix-cache block pool vllm-delta knows")
    elif not all(getattr(type(p).cache_full_blocks, PATCHED_ATTR, False) for p in _block_pools(scheduler)):
        reasons.append("the prefix-cache block pool is not the one vllm-delta's taint check patched")
    return reasons


# -- prefix cache ----------------------------------------------------------------------------------
def _block_pools(scheduler: Any) -> list[Any]:
    manager = getattr(scheduler, "kv_cache_manager", None)
    coordinator = getattr(manager, "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", None)
    if managers is None:
        return []
    pools: dict[int, Any] = {}
    for m in managers:
        pools.setdefault(id(m.block_pool), m.block_pool)
    return list(pools.values())


def _hashed_blocks(pool: Any) -> list[Any]:
    """Every block a prefix lookup can reach (O(#cached blocks)); KVCacheBlock is unhashable: by id."""
    found: dict[int, Any] = {}
    for value in pool.cached_block_hash_to_block._cache.values():
        for block in value.values() if isinstance(value, dict) else (value,):
            found[block.block_id] = block
    for block_id in pool.cached_block_hashes_by_block:
        found[block_id] = pool.blocks[block_id]
    return list(found.values())


def drop_prefix_hashes(scheduler: Any) -> PrefixCleared:
    """Forget every cached block hash, the way vLLM's BlockPool.reset_prefix_cache does, but without
    requiring every block to be free: blocks in use keep their ref counts and block-table slots, so
    they stay valid for the requests holding them; freed, they carry no hash and never hit again."""
    from vllm.v1.core.block_pool import BlockHashToBlockMap

    keys = blocks = in_use = 0
    for pool in _block_pools(scheduler):
        hashed = _hashed_blocks(pool)
        keys += len(pool.cached_block_hash_to_block)
        blocks += len(hashed)
        in_use += sum(1 for b in hashed if b.ref_cnt > 0)
        pool.cached_block_hash_to_block = BlockHashToBlockMap()
        pool.cached_block_hashes_by_block.clear()
        for b in hashed:
            b.reset_hash()
        if pool.metrics_collector is not None:
            pool.metrics_collector.reset()
        if pool.enable_kv_cache_events:
            from vllm.distributed.kv_events import AllBlocksCleared

            pool.kv_event_queue.append(AllBlocksCleared())
    manager = scheduler.kv_cache_manager
    if getattr(manager, "log_stats", False) and getattr(manager, "prefix_cache_stats", None) is not None:
        manager.prefix_cache_stats.reset = True
    return PrefixCleared(hash_keys=keys, blocks=blocks, blocks_in_use=in_use)


def holding_kv(scheduler: Any) -> list[Any]:
    """Requests whose KV (some of it computed now) would outlive the writes."""
    return [r for r in scheduler.requests.values() if r.num_computed_tokens > 0]


# -- the writes ------------------------------------------------------------------------------------
def _stop_scheduling(core: Any, st: EngineState, why: str) -> None:
    from vllm.v1.core.sched.interface import PauseState

    st.inconsistent = why
    try:
        core.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    finally:
        log.error("vllm-delta: %s; scheduling stopped (PAUSED_ALL): restart the server", why)


def _patch_all(core: Any, args: rpc.PatchAllArgs) -> PatchedAll:
    """The reserved call PATCH_ALL (engine-core thread, between two steps): two_phase.patch_all over the
    workers, then, as its after-writes step, the prefix-cache invalidation (mode "inflight") and the
    label. In a pause mode the API process paused first and resets the prefix cache itself.
    Raises InflightRefusedError or EplbRefusedError (409: nothing was written), PatchFailedError (500:
    every rank rolled back) or RollbackFailedError (500: scheduling stopped, later writes refused)."""
    t0 = time.perf_counter()
    st = state_of(core)
    inflight = args.mode not in PAUSE_MODES
    _refuse_unsafe(core, st, inflight)
    outcome = run_sync(
        patch_all(
            rpc.Workers(rpc.executor_transport(core.model_executor)),
            args.ticket,
            method=args.method,
            fault=args.fault,
            after_patch=_after_patch(core, st, args, inflight, t0),
        )
    )
    if isinstance(outcome, AllPatched):
        return outcome.after
    when = " before the next forward step" if inflight else ""
    if isinstance(outcome, AllRolledBack):
        raise PatchFailedError(
            f"update to version {args.version} failed and was rolled back on every rank{when}: {outcome.failure}"
        )
    why = f"({outcome.failure}) and its rollback failed ({outcome.rollback_failure})"
    _stop_scheduling(core, st, f"update to version {args.version} failed {why}")
    raise RollbackFailedError(
        f"update to version {args.version} failed and could not be rolled back: {outcome.rollback_failure}"
    )


def _refuse_unsafe(core: Any, st: EngineState, inflight: bool) -> None:
    """Before anything is written: no write after a failed rollback; none with EPLB on (shared/eplb.py);
    no in-flight update this engine cannot make safe (preflight)."""
    if st.inconsistent is not None:
        raise RollbackFailedError(f"a rollback failed earlier, ranks may disagree: {st.inconsistent}")
    refuse_eplb(getattr(core, "vllm_config", None), "weight updates")  # every mode: expert slots move under EPLB
    sleep.refuse_asleep(core)  # every mode: the weights are not in place
    if not inflight:
        return
    try:
        reasons = preflight(core)
    except Exception as exc:  # noqa: BLE001 - an engine we don't understand: refuse
        reasons = [f"preflight failed: {type(exc).__name__}: {exc}"]
    if reasons:
        raise InflightRefusedError("in-flight update refused: " + "; ".join(reasons))


@dataclass(frozen=True)
class _Switch:
    """What a label change does to the requests of this engine, computed before the writes (so nothing
    after them can fail): the requests holding KV, their switch indices, the batches in flight."""

    holding: list[Any]
    switch: dict[str, int]
    in_flight: int

    @classmethod
    def of(cls, core: Any, inflight: bool) -> _Switch:
        holding = holding_kv(core.scheduler) if inflight else []
        switch = {external_id(r.request_id): r.num_output_tokens + r.num_output_placeholders for r in holding}
        in_flight = len(core.batch_queue) if inflight and getattr(core, "batch_queue", None) is not None else 0
        return cls(holding, switch, in_flight)

    def apply(self, core: Any, st: EngineState, label: str, inflight: bool) -> PrefixCleared:
        """Between two steps, in flight: drop every prefix hash and taint the requests holding KV; then
        the label (batches already in flight keep theirs)."""
        dropped = drop_prefix_hashes(core.scheduler) if inflight else PrefixCleared(0, 0, 0)
        for r in self.holding:
            setattr(r, TAINT_ATTR, True)
        _set_label(core, st, label, self.in_flight)
        return dropped


def _after_patch(
    core: Any, st: EngineState, args: rpc.PatchAllArgs, inflight: bool, t0: float
) -> Callable[[list[Patched]], PatchedAll]:
    """The after-writes step. Everything that can fail is computed here, before the writes."""
    change = _Switch.of(core, inflight)
    previous = core._weight_version
    label = version_label(args.version)

    def invalidate_and_label(written_ranks: list[Patched]) -> PatchedAll:
        apply_ms = max((w.apply_ms for w in written_ranks), default=0.0)
        dropped = change.apply(core, st, label, inflight)
        written = PatchedAll(
            version=args.version,
            label=label,
            previous_label=previous,
            engine_step=st.steps,
            engine_ms=(time.perf_counter() - t0) * 1e3,
            apply_ms=apply_ms,
            dropped_blocks=dropped.blocks,
            dropped_blocks_in_use=dropped.blocks_in_use,
            tainted=len(change.holding),
            batches_in_flight=change.in_flight,
            switch=change.switch,
            time=time.time(),
        )
        st.history.append(_history_entry(args, written))
        st.landed = Landed(args.ticket, previous, inflight)
        return written

    return invalidate_and_label


def _rollback_all(core: Any, args: rpc.RollbackAllArgs) -> RolledBackAll:
    """The reserved call ROLLBACK_ALL (engine-core thread, between two steps): another engine failed its
    writes. If this engine's PATCH_ALL of the ticket landed, roll back every rank and put the label back
    to the one before (in flight: the engine may have stepped on the new weights since, so prefix hashes
    are dropped and requests holding KV tainted, as at the writes). If it did not land, there is nothing
    to undo: its own PATCH_ALL refused before writing or already rolled its ranks back (or, having failed
    to, stopped this engine: then this call refuses too). Raises RollbackFailedError (scheduling stopped)."""
    t0 = time.perf_counter()
    st = state_of(core)
    if st.inconsistent is not None:
        raise RollbackFailedError(f"a rollback failed earlier, ranks may disagree: {st.inconsistent}")
    landed = st.landed if st.landed is not None and st.landed.ticket == args.ticket else None
    if landed is None:
        return RolledBackAll(
            ranks_rolled_back=0,
            relabelled=False,
            label=core._weight_version,
            engine_ms=(time.perf_counter() - t0) * 1e3,
        )
    change = _Switch.of(core, landed.inflight)
    replies = run_sync(rpc.Workers(rpc.executor_transport(core.model_executor)).rollback(args.ticket))
    if not replies.ok:
        _stop_scheduling(core, st, f"rolling back version {args.version} failed: {replies.failures()}")
        raise RollbackFailedError(f"rolling back version {args.version} failed: {replies.failures()}")
    rolled = sum(1 for r in replies.all() if r.rolled_back)
    st.landed = None
    undone = core._weight_version
    change.apply(core, st, landed.previous_label, landed.inflight)
    st.history.append(
        HistoryEntry(
            mode="rollback",
            version=_version_of(landed.previous_label),
            label=landed.previous_label,
            previous_label=undone,
            engine_step=st.steps,
            switch=change.switch if landed.inflight else None,
            time=time.time(),
        )
    )
    return RolledBackAll(
        ranks_rolled_back=rolled,
        relabelled=True,
        label=landed.previous_label,
        engine_ms=(time.perf_counter() - t0) * 1e3,
    )


def _version_of(label: str) -> int | None:
    version = parse_label(label)
    return version if isinstance(version, int) else None


def _history_entry(args: rpc.PatchAllArgs, c: PatchedAll) -> HistoryEntry:
    """An update in a pause as a label change (as at start-up); an in-flight update with what it did."""
    entry = HistoryEntry(
        mode=args.mode,
        version=c.version,
        label=c.label,
        previous_label=c.previous_label,
        engine_step=c.engine_step,
        time=c.time,
    )
    if args.mode in PAUSE_MODES:
        return entry
    return dataclasses.replace(
        entry,
        engine_ms=c.engine_ms,
        apply_ms=c.apply_ms,
        dropped_blocks=c.dropped_blocks,
        dropped_blocks_in_use=c.dropped_blocks_in_use,
        tainted=c.tainted,
        batches_in_flight=c.batches_in_flight,
        switch=c.switch,
    )


def _set_label(core: Any, st: EngineState, label: str, in_flight: int = 0) -> None:
    """`in_flight` batches were dispatched before this point: they keep the labels they ran under."""
    earlier = list(st.held)[:in_flight]
    st.held = deque(earlier + [core._weight_version] * (in_flight - len(earlier)))
    provenance.set_label(core, label)  # the requests holding KV compute their next positions under it
    core._weight_version = label


def _set_label_by_hand(core: Any, args: rpc.LabelArgs) -> LabelSet:
    """The reserved call SET_LABEL: the label at start-up (or by hand), recorded in the history.
    Nothing runs meanwhile that could keep the old label."""
    st = state_of(core)
    new = args.label if args.label is not None else version_label(args.version)
    out = LabelSet(label=new, previous_label=core._weight_version, engine_step=st.steps, time=time.time())
    _set_label(core, st, new)
    st.history.append(
        HistoryEntry(
            mode=args.mode,
            version=args.version,
            label=out.label,
            previous_label=out.previous_label,
            engine_step=out.engine_step,
            time=out.time,
        )
    )
    return out


def _timeline(core: Any, args: rpc.NoArgs) -> Timeline:
    st = state_of(core)
    return Timeline(
        label=core._weight_version,
        engine_step=st.steps,
        inconsistent=st.inconsistent,
        history=list(st.history),
        history_limit=HISTORY_LIMIT,
    )


def _prefix_state(core: Any, args: rpc.NoArgs) -> PrefixState:
    """How many blocks carry a prefix hash, and which requests are tainted (tests, diagnostics)."""
    scheduler = core.scheduler
    pools = _block_pools(scheduler)
    return PrefixState(
        hash_keys=sum(len(p.cached_block_hash_to_block) for p in pools),
        hashed_blocks=sum(len(_hashed_blocks(p)) for p in pools),
        tainted=sorted(external_id(r.request_id) for r in scheduler.requests.values() if getattr(r, TAINT_ATTR, False)),
        async_scheduling=bool(getattr(core, "async_scheduling", False)),
        batch_queue=None if getattr(core, "batch_queue", None) is None else len(core.batch_queue),
    )


# The reserved names, served from their declarations: each answers the reply's plain form (or an
# error reply with the exception's HTTP status) and never raises across the utility boundary.
write_between_steps = rpc.serve(rpc.PATCH_ALL, _patch_all)
rollback_between_steps = rpc.serve(rpc.ROLLBACK_ALL, _rollback_all)
set_label = rpc.serve(rpc.SET_LABEL, _set_label_by_hand)
engine_timeline = rpc.serve(rpc.ENGINE_TIMELINE, _timeline)
prefix_state = rpc.serve(rpc.PREFIX_STATE, _prefix_state)
prompt_versions = rpc.serve(rpc.PROMPT_VERSIONS, provenance.lookup)
RESERVED: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (write_between_steps, rollback_between_steps, set_label, engine_timeline, prefix_state, prompt_versions)
}
assert set(RESERVED) == {c.name for c in rpc.ENGINE_CORE_CALLS}, "every engine-core call is served"


# -- patches ---------------------------------------------------------------------------------------
def patch_engine_core(engine_core_cls: Any) -> None:
    """Answer the reserved names on the engine core; count labelled steps and hold the old label for
    batches that were already in flight at an update. Idempotent."""
    orig_rpc = engine_core_cls.collective_rpc
    if getattr(orig_rpc, PATCHED_ATTR, False):
        return

    @functools.wraps(orig_rpc)
    def collective_rpc(
        self: Any, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        provenance.attach(self)  # the scheduler learns its core (its label) before any change
        if isinstance(method, str) and method in RESERVED:
            if args:
                return [rpc.error_reply(TypeError(f"{method} takes keyword arguments only"))]
            return [RESERVED[method](self, **(kwargs or {}))]
        asleep = sleep.guarded_call(self, method, kwargs) if isinstance(method, str) else None
        if asleep is not None:  # never reaches a worker: its weights are not in place (sleep.py)
            return [rpc.error_reply(asleep)]
        return orig_rpc(self, method, timeout, args, kwargs)

    orig_attach = engine_core_cls._attach_weight_version

    @functools.wraps(orig_attach)
    def _attach_weight_version(self: Any, outputs: Any) -> Any:
        provenance.attach(self)
        st = state_of(self)
        st.steps += 1
        if st.held:
            label = st.held.popleft()
            for eco in outputs.values():
                eco.weight_version = label
            return None
        return orig_attach(self, outputs)

    setattr(collective_rpc, PATCHED_ATTR, True)
    setattr(_attach_weight_version, PATCHED_ATTR, True)
    engine_core_cls.collective_rpc = collective_rpc
    engine_core_cls._attach_weight_version = _attach_weight_version


def patch_block_pool(block_pool_cls: Any) -> None:
    """A tainted request (it held KV at an in-flight update) never inserts prefix-cache hashes: its
    blocks mix KV of two weight versions, and lookups follow token-only hash chains. Idempotent."""
    orig_full = block_pool_cls.cache_full_blocks
    if getattr(orig_full, PATCHED_ATTR, False):
        return
    orig_partial = block_pool_cls.cache_partial_block

    @functools.wraps(orig_full)
    def cache_full_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(request, TAINT_ATTR, False):
            return None
        out = orig_full(self, request, *args, **kwargs)
        provenance.blocks_cached(self, request, args, kwargs)  # the inserted blocks' prompt provenance
        return out

    @functools.wraps(orig_partial)
    def cache_partial_block(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(request, TAINT_ATTR, False):
            return None
        return orig_partial(self, request, *args, **kwargs)

    setattr(cache_full_blocks, PATCHED_ATTR, True)
    setattr(cache_partial_block, PATCHED_ATTR, True)
    block_pool_cls.cache_full_blocks = cache_full_blocks
    block_pool_cls.cache_partial_block = cache_partial_block


def install() -> None:
    """Patch vLLM's EngineCore and BlockPool (general plugin, every process; the engine core loads
    general plugins before it builds its executor and scheduler, so the class patches apply)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.engine.core import EngineCore

    patch_engine_core(EngineCore)
    patch_block_pool(BlockPool)
    provenance.install()  # prompt provenance (lookups, label changes, insertions)
