"""The engine-core side of in-flight updates (`"mode": "inflight"`), installed by the general plugin.

An in-flight commit is ONE call on the engine-core thread, so it runs strictly between two engine
steps (vLLM dispatches utilities from its busy loop between `step_fn()` calls). The API process
reaches it through the public `EngineClient.collective_rpc(INFLIGHT_COMMIT, kwargs=...)`: the
plugin wraps `EngineCore.collective_rpc` and answers the reserved names below itself instead of
forwarding them to the workers. In that one call:

    preflight   refuse what cannot be made safe (409 + reason): KV / encoder-cache / aux-output
                connectors, multimodal encoder caches, data parallelism, an unknown scheduler
    commit      `delta_commit` on every worker rank (one broadcast: every rank writes after the
                same forward step; worker.py methods never raise)
    rollback    if any rank failed: `delta_rollback` on every rank in the same call, so no forward
                ever sees mixed weights; if the rollback fails too, scheduling stops (PAUSED_ALL)
                and every later in-flight commit answers 500
    invalidate  on success only: drop every cached prefix hash (blocks in use stay valid for the
                requests holding them) and taint every request that holds KV, so it never inserts
                hashes later (its blocks mix old and new weights)
    label       set vLLM's weight-version label (stamped on each step's outputs; under a batch
                queue the batches already in flight keep the old label) and record the commit in
                a bounded history (engine step, time, each running request's switch index)

Worker ordering: `MultiprocExecutor` sends one message on a broadcast queue read by every rank, and
each worker runs its queue in order, so the commit runs after the forward steps already dispatched
and before any later one, on every rank. On GPU the writes are issued on the worker's current stream
(the forward's) and synchronized before the reply (apply/engine.py).

Nothing here imports vLLM at module level: the plugin patches vLLM's classes in `install()`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..attribution import version_label
from ..errors import DeltaError, InflightRefusedError
from .messages import ErrorPayload, InflightCommitted, Json, LabelSet, error_reply, reply_error

log = logging.getLogger(__name__)

# Reserved collective_rpc names answered by the engine core itself (never sent to the workers).
INFLIGHT_COMMIT = "delta_inflight_commit"
SET_LABEL = "delta_set_label"
ENGINE_TIMELINE = "delta_engine_timeline"
PREFIX_STATE = "delta_prefix_state"  # diagnostics and tests

TAINT_ATTR = "_vllm_delta_tainted"  # on vLLM Request objects: never insert prefix-cache hashes
STATE_ATTR = "_vllm_delta_inflight"  # on the EngineCore: its EngineState
HISTORY_LIMIT = 256  # label changes kept by the engine core
PATCHED_ATTR = "_vllm_delta_patched"


class CommitFailed(DeltaError):
    """A commit failed on some rank and every rank was rolled back (500)."""


class Inconsistent(DeltaError):
    """Ranks may hold different weights: a rollback failed (500); the engine stopped scheduling."""


@dataclass
class EngineState:
    """What the engine core keeps between in-flight commits."""

    history: deque[Json] = field(default_factory=lambda: deque(maxlen=HISTORY_LIMIT))
    steps: int = 0  # labelled engine steps so far (one per step that produced outputs)
    # Labels of the batches that were already dispatched at a commit (batch queue: async scheduling,
    # pipeline parallelism), oldest first: they ran on the weights before it and keep that label.
    held: deque[str] = field(default_factory=deque)
    inconsistent: str | None = None  # set when a rollback failed: the ranks may disagree


def state_of(core: Any) -> EngineState:
    st = getattr(core, STATE_ATTR, None)
    if st is None:
        st = EngineState()
        setattr(core, STATE_ATTR, st)
    return st


# -- preflight -------------------------------------------------------------------------------------
def preflight(core: Any) -> list[str]:
    """Why an in-flight commit cannot be made safe on this engine ([] when it can)."""
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
        reasons.append(
            "data parallelism: each engine core steps on its own, so the ranks of an expert-parallel "
            "forward could mix versions; use mode keep"
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


def drop_prefix_hashes(scheduler: Any) -> Json:
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
    return {"hash_keys": keys, "blocks": blocks, "blocks_in_use": in_use}


def holding_kv(scheduler: Any) -> list[Any]:
    """Requests whose KV (some of it computed now) would outlive the commit."""
    return [r for r in scheduler.requests.values() if r.num_computed_tokens > 0]


def external_id(engine_request_id: str) -> str:
    """The id the API process passed to generate(): vLLM appends "-<8 random chars>" (input_processor)."""
    head, sep, tail = engine_request_id.rpartition("-")
    return head if sep and len(tail) == 8 else engine_request_id


# -- the commit ------------------------------------------------------------------------------------
def _rank_errors(replies: Iterable[Any]) -> list[tuple[int, Any]]:
    return [(rank, e) for rank, e in enumerate(map(reply_error, replies)) if e is not None]


def _workers(core: Any, _rpc: str, **kwargs: Any) -> list[Any]:
    """Every worker rank's reply to a worker method (worker.py), in rank order."""
    return core.model_executor.collective_rpc(_rpc, kwargs=kwargs)


def _rollback_all(core: Any, ticket: str) -> str | None:
    """Roll every rank back; None when all ranks are consistent again, else what went wrong."""
    try:
        replies = _workers(core, "delta_rollback", ticket=ticket)
    except Exception as exc:  # noqa: BLE001 - becomes the inconsistent state below
        return f"{type(exc).__name__}: {exc}"
    failed = _rank_errors(replies)
    if failed:
        return "; ".join(f"rank {rank}: {e.type}: {e.message}" for rank, e in failed)
    return None


def _stop_scheduling(core: Any, st: EngineState, why: str) -> None:
    from vllm.v1.core.sched.interface import PauseState

    st.inconsistent = why
    try:
        core.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    finally:
        log.error("vllm-delta: %s; scheduling stopped (PAUSED_ALL): restart the server", why)


def inflight_commit(
    core: Any, ticket: str, version: int, method: str = "delta", fault: str | None = None, mode: str = "inflight"
) -> Json:
    """The reserved utility INFLIGHT_COMMIT (engine-core thread, between two steps). Never raises:
    returns InflightCommitted's wire form or an error reply (409 refused, 500 rolled back / inconsistent)."""
    t0 = time.perf_counter()
    st = state_of(core)
    if st.inconsistent is not None:
        return {"error": _payload(Inconsistent(f"a rollback failed earlier, ranks may disagree: {st.inconsistent}"))}
    try:
        reasons = preflight(core)
    except Exception as exc:  # noqa: BLE001 - an engine we don't understand: refuse
        reasons = [f"preflight failed: {type(exc).__name__}: {exc}"]
    if reasons:
        return {"error": _payload(InflightRefusedError("in-flight update refused: " + "; ".join(reasons)))}
    scheduler = core.scheduler
    # Everything that can fail is computed before the writes.
    holding = holding_kv(scheduler)
    switch = {external_id(r.request_id): r.num_output_tokens + r.num_output_placeholders for r in holding}
    in_flight = len(core.batch_queue) if getattr(core, "batch_queue", None) is not None else 0
    previous = core._weight_version
    label = version_label(version)
    try:
        replies = _workers(core, "delta_commit", ticket=ticket, method=method, fault=fault)
        failed = _rank_errors(replies)
        first = f"rank {failed[0][0]}: {failed[0][1].type}: {failed[0][1].message}" if failed else ""
    except Exception as exc:  # noqa: BLE001 - e.g. a worker died: roll back what we can
        replies, failed, first = [], [(-1, None)], f"{type(exc).__name__}: {exc}"
    if not failed:
        try:
            dropped = drop_prefix_hashes(scheduler)
            for r in holding:
                setattr(r, TAINT_ATTR, True)
            _set_label(core, st, label, in_flight)
            committed = InflightCommitted(
                version=version,
                label=label,
                previous_label=previous,
                engine_step=st.steps,
                engine_ms=(time.perf_counter() - t0) * 1e3,
                apply_ms=max((float(r["apply_ms"]) for r in replies), default=0.0),
                dropped_blocks=dropped["blocks"],
                dropped_blocks_in_use=dropped["blocks_in_use"],
                tainted=len(holding),
                batches_in_flight=in_flight,
                switch=switch,
                time=time.time(),
            )
            st.history.append({"mode": mode, **committed.to_wire()})
            return committed.to_wire()
        except Exception as exc:  # noqa: BLE001 - after the writes: undo them, the caller sees an error
            first = f"after the writes: {type(exc).__name__}: {exc}"
            log.exception("vllm-delta: in-flight commit failed after the writes")
    # Some rank failed (it restored itself): every rank rolls back before the next forward step.
    why = _rollback_all(core, ticket)
    if why is not None:
        _stop_scheduling(core, st, f"update to version {version} failed ({first}) and its rollback failed ({why})")
        why = f"update to version {version} failed and could not be rolled back: {why}"
        return {"error": _payload(Inconsistent(why))}
    return {
        "error": _payload(
            CommitFailed(
                f"update to version {version} failed and was rolled back on every rank before the next "
                f"forward step: {first}"
            )
        )
    }


def _payload(exc: BaseException) -> Json:
    return ErrorPayload.from_exception(exc).to_wire()


def _set_label(core: Any, st: EngineState, label: str, in_flight: int = 0) -> None:
    """`in_flight` batches were dispatched before this point: they keep the labels they ran under."""
    earlier = list(st.held)[:in_flight]
    st.held = deque(earlier + [core._weight_version] * (in_flight - len(earlier)))
    core._weight_version = label


def set_label(core: Any, version: int | None = None, label: str | None = None, mode: str = "pause") -> Json:
    """The reserved utility SET_LABEL: the label for an update applied inside a pause (or at
    start-up), recorded in the history. Nothing runs meanwhile, so no batch keeps the old label."""
    st = state_of(core)
    new = label if label is not None else version_label(version)
    out = LabelSet(label=new, previous_label=core._weight_version, engine_step=st.steps, time=time.time())
    _set_label(core, st, new)
    st.history.append({"mode": mode, "version": version, **out.to_wire()})
    return out.to_wire()


def engine_timeline(core: Any) -> Json:
    st = state_of(core)
    return {
        "label": core._weight_version,
        "engine_step": st.steps,
        "inconsistent": st.inconsistent,
        "history": list(st.history),
        "history_limit": HISTORY_LIMIT,
    }


def prefix_state(core: Any) -> Json:
    """How many blocks carry a prefix hash, and which requests are tainted (tests, diagnostics)."""
    scheduler = core.scheduler
    pools = _block_pools(scheduler)
    return {
        "hash_keys": sum(len(p.cached_block_hash_to_block) for p in pools),
        "hashed_blocks": sum(len(_hashed_blocks(p)) for p in pools),
        "tainted": sorted(
            external_id(r.request_id) for r in scheduler.requests.values() if getattr(r, TAINT_ATTR, False)
        ),
        "async_scheduling": bool(getattr(core, "async_scheduling", False)),
        "batch_queue": None if getattr(core, "batch_queue", None) is None else len(core.batch_queue),
    }


RESERVED: dict[str, Callable[..., Json]] = {
    INFLIGHT_COMMIT: inflight_commit,
    SET_LABEL: set_label,
    ENGINE_TIMELINE: engine_timeline,
    PREFIX_STATE: prefix_state,
}


# -- patches ---------------------------------------------------------------------------------------
def _answer_reserved(core: Any, method: str, args: tuple, kwargs: dict[str, Any] | None) -> list[Json]:
    try:
        return [RESERVED[method](core, *args, **(kwargs or {}))]
    except Exception as exc:  # noqa: BLE001 - never raise across the utility boundary
        log.exception("vllm-delta: %s failed", method)
        return [error_reply(exc)]


def patch_engine_core(engine_core_cls: Any) -> None:
    """Answer the reserved names on the engine core; count labelled steps and hold the old label for
    batches that were already in flight at a commit. Idempotent."""
    orig_rpc = engine_core_cls.collective_rpc
    if getattr(orig_rpc, PATCHED_ATTR, False):
        return

    @functools.wraps(orig_rpc)
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if isinstance(method, str) and method in RESERVED:
            return _answer_reserved(self, method, tuple(args or ()), kwargs)
        return orig_rpc(self, method, timeout, args, kwargs)

    orig_attach = engine_core_cls._attach_weight_version

    @functools.wraps(orig_attach)
    def _attach_weight_version(self, outputs):
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
    """A tainted request (it held KV at an in-flight commit) never inserts prefix-cache hashes: its
    blocks mix KV of two weight versions, and lookups follow token-only hash chains. Idempotent."""
    orig_full = block_pool_cls.cache_full_blocks
    if getattr(orig_full, PATCHED_ATTR, False):
        return
    orig_partial = block_pool_cls.cache_partial_block

    @functools.wraps(orig_full)
    def cache_full_blocks(self, request, *args, **kwargs):
        if getattr(request, TAINT_ATTR, False):
            return None
        return orig_full(self, request, *args, **kwargs)

    @functools.wraps(orig_partial)
    def cache_partial_block(self, request, *args, **kwargs):
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
