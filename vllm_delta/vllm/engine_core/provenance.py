"""Prompt provenance: which weights computed the KV of each prompt position (`prefill_weight_versions`,
SGLang's key and sense), in the engine core.

vLLM labels each step's outputs with the weight version (`EngineCore._weight_version`), which gives the
output spans; nothing says which weights computed the KV a request reads. With prefix caching a
prompt is served from blocks computed by earlier requests, possibly under an older version: vLLM's own
RL routes leave the prefix cache as it is (cache invalidation is the caller's business), a request
that rode through an in-flight update holds KV of two versions, and one recomputed after a keep-mode
update holds only the new one. Every request carries its *segments*, `[(first position, label), ...]`
over the positions it holds KV for, kept by events only (nothing runs per engine step):

    lookup      a request's prefix-cache lookup (`KVCacheManager.get_computed_blocks`, before each
                (re)start: a new request, one preempted and resumed): its segments begin with the
                stamps of the cached blocks it hits, then the current label from the first position it
                computes itself
    label       every label change (our writes and rollbacks, engine_core/calls.py; vLLM's own
                `set_weight_version`): each request holding KV gets a new segment from its
                `num_computed_tokens`, the first position the scheduler hands out after the change. A
                batch already dispatched under a batch queue ran on the old weights, and the scheduler
                counted its positions when it handed it out, so the boundary holds there too
    insertion   a full block entering the prefix cache (`BlockPool.cache_full_blocks`, wrapped for the
                taint rule) is stamped with its request's segments over the block's positions; a
                tainted request never inserts, so no mixed block of an in-flight patch is ever hit

A request's segments are kept (bounded, by the id the API process knows) from its lookup on and
answered by the reserved call PROMPT_VERSIONS, clipped to the prompt (api_server/spans.py). Costs:
O(hit blocks) per lookup (vLLM hashes as many), O(requests) per label change, O(segments) per full
block cached, nothing per step.

Not tracked (no `prefill_weight_versions`): a KV connector (KV loaded from outside this engine was
computed under versions nobody recorded), a model without a plain full-attention KV-cache group, or
fine-grained prefix hits (hash blocks smaller than KV blocks). Known limit: with speculative decoding,
draft tokens rejected after a label change and recomputed keep the label before it (output positions
only; prompt positions are never speculative). A hit on a block inserted by no tracked request says
"unknown".
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ...server_api import UNKNOWN_LABEL, WeightSpan
from ..shared import rpc
from ..shared.messages import PromptVersions

log = logging.getLogger(__name__)

TRACKER_ATTR = "_vllm_delta_provenance"  # on the Scheduler (its Tracker, or False), its KVCacheManager and BlockPool
CORE_ATTR = "_vllm_delta_core"  # on the Scheduler: the EngineCore whose label its steps run under
SEGMENTS_ATTR = "_vllm_delta_segments"  # on vLLM Requests: their Segments
PATCHED_ATTR = "_vllm_delta_patched"
PROMPTS_LIMIT = 4096  # requests whose provenance is kept (a response asks right after it finished)

Segments = list[tuple[int, str]]  # (first position, label), in order: positions up to the next entry


@dataclass
class Kept:
    """One request's provenance as kept for the API process: its prompt length and its live segments."""

    num_prompt: int
    segments: Segments


@dataclass
class Tracker:
    """The provenance of one scheduler's requests and of its tracked group's cached blocks."""

    scheduler: Any
    group_id: int  # the tracked KV-cache group (plain full attention)
    block_size: int
    stamps: dict[int, Segments] = field(default_factory=dict)  # cached block id -> segments, block offsets
    kept: OrderedDict[str, Kept] = field(default_factory=OrderedDict)

    def label(self) -> str:
        core = getattr(self.scheduler, CORE_ATTR, None)
        return core._weight_version if core is not None else "default"

    def looked_up(self, request: Any, hit_blocks: Any, hits: int) -> None:
        """A prefix-cache lookup before the request (re)starts: the hit positions' segments from the
        blocks' stamps, the current label from the first position it computes."""
        bs = self.block_size
        segments: Segments = []
        for i in range(-(-hits // bs) if hits else 0):
            stamp = self.stamps.get(hit_blocks[i].block_id) or [(0, UNKNOWN_LABEL)]
            for offset, label in stamp:
                at = i * bs + offset
                if at < hits and (not segments or segments[-1][1] != label):
                    segments.append((at, label))
        label = self.label()
        if not segments or segments[-1][1] != label:
            segments.append((hits, label))
        setattr(request, SEGMENTS_ATTR, segments)
        self.kept[external_id(request.request_id)] = Kept(request.num_prompt_tokens, segments)
        self.kept.move_to_end(external_id(request.request_id))
        while len(self.kept) > PROMPTS_LIMIT:
            self.kept.popitem(last=False)

    def cached(self, request: Any, blocks: list[Any], first: int, last: int) -> None:
        """Full blocks [first, last) of the request enter the prefix cache: stamp each with the request's
        segments over its positions."""
        segments: Segments | None = getattr(request, SEGMENTS_ATTR, None)
        bs = self.block_size
        for i in range(first, min(last, len(blocks))):
            begin, end = i * bs, (i + 1) * bs
            if segments is None:
                self.stamps[blocks[i].block_id] = [(0, UNKNOWN_LABEL)]
                continue
            stamp = [
                (max(at, begin) - begin, label)
                for j, (at, label) in enumerate(segments)
                if at < end and (j + 1 == len(segments) or segments[j + 1][0] > begin)
            ]
            self.stamps[blocks[i].block_id] = stamp or [(0, UNKNOWN_LABEL)]


def label_changed(scheduler: Any, label: str) -> None:
    """The label becomes `label` between two steps: every request holding KV computes its next positions
    under it."""
    for request in scheduler.requests.values():
        computed = request.num_computed_tokens
        segments: Segments | None = getattr(request, SEGMENTS_ATTR, None)
        if computed <= 0 or segments is None:
            continue
        while len(segments) > 1 and segments[-1][0] >= computed:
            segments.pop()  # not computed under that label after all
        if segments[-1][0] >= computed:
            segments[-1] = (segments[-1][0], label)
        elif segments[-1][1] != label:
            segments.append((computed, label))


def prompt_spans(kept: Kept) -> list[WeightSpan]:
    """A request's segments clipped to its prompt, as spans."""
    spans: list[WeightSpan] = []
    for j, (at, label) in enumerate(kept.segments):
        end = min(kept.segments[j + 1][0] if j + 1 < len(kept.segments) else kept.num_prompt, kept.num_prompt)
        if at < end:
            spans.append(WeightSpan(label, at, end))
    return spans


def _new_tracker(scheduler: Any) -> Tracker | None:
    """A tracker for the scheduler's first plain full-attention KV-cache group, hooked into its
    KVCacheManager and BlockPool; None where prompt provenance cannot be told (module docstring)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if getattr(scheduler, "connector", None) is not None:
        log.info("vllm-delta: a KV connector is configured: no prompt provenance (prefill_weight_versions)")
        return None
    kv_cache_manager = getattr(scheduler, "kv_cache_manager", None)
    managers = getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers", ())
    for manager in managers:
        if type(manager) is FullAttentionManager:
            pool = manager.block_pool
            if getattr(pool, "hash_block_size", manager.block_size) != manager.block_size:
                break  # fine-grained prefix hits end inside blocks shared with other requests
            tracker = Tracker(scheduler, manager.kv_cache_group_id, manager.block_size)
            setattr(kv_cache_manager, TRACKER_ATTR, tracker)
            setattr(pool, TRACKER_ATTR, tracker)
            return tracker
    log.info("vllm-delta: no plain full-attention KV-cache group: no prompt provenance (prefill_weight_versions)")
    return None


def tracker_of(scheduler: Any) -> Tracker | None:
    """The scheduler's tracker, made on first use (None where prompt provenance is not tracked)."""
    tracker = getattr(scheduler, TRACKER_ATTR, None)
    if tracker is None:
        tracker = _new_tracker(scheduler)
        setattr(scheduler, TRACKER_ATTR, tracker if tracker is not None else False)
    return tracker if isinstance(tracker, Tracker) else None


def attach(core: Any) -> None:
    """Tie the core's scheduler to the core, whose `_weight_version` labels its steps (until then they
    run under "default", the label every engine core starts with)."""
    scheduler = getattr(core, "scheduler", None)
    if scheduler is not None and getattr(scheduler, CORE_ATTR, None) is not core:
        setattr(scheduler, CORE_ATTR, core)


def set_label(core: Any, label: str) -> None:
    """The engine core's label becomes `label` (between two steps); the caller then sets it."""
    attach(core)
    if isinstance(getattr(core.scheduler, TRACKER_ATTR, None), Tracker) and label != core._weight_version:
        _guarded(core.scheduler, label_changed, core.scheduler, label)


def external_id(engine_request_id: str) -> str:
    """The id the API process passed to generate(): vLLM appends "-<8 random chars>" (input_processor)."""
    head, sep, tail = engine_request_id.rpartition("-")
    return head if sep and len(tail) == 8 else engine_request_id


def _guarded(scheduler: Any, fn: Any, *args: Any) -> None:
    """Run a provenance step; a failure turns provenance off for this scheduler (logged once) and never
    reaches the engine."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - attribution never stops the engine
        for owner in (scheduler, getattr(scheduler, "kv_cache_manager", None)):
            if owner is not None:
                setattr(owner, TRACKER_ATTR, False)
        log.warning("vllm-delta: prompt provenance turned off after an error: %s", exc, exc_info=exc)


# -- patches ---------------------------------------------------------------------------------------
def patch_scheduler(scheduler_cls: Any) -> None:
    """Make the scheduler's tracker before its first step (one attribute read per step). Idempotent."""
    orig = scheduler_cls.schedule
    if getattr(orig, PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def schedule(self, *args, **kwargs):
        if getattr(self, TRACKER_ATTR, None) is None:
            _guarded(self, tracker_of, self)
        return orig(self, *args, **kwargs)

    setattr(schedule, PATCHED_ATTR, True)
    scheduler_cls.schedule = schedule


def patch_kv_cache_manager(manager_cls: Any) -> None:
    """Every prefix-cache lookup starts the request's segments. Idempotent."""
    orig = manager_cls.get_computed_blocks
    if getattr(orig, PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def get_computed_blocks(self, request, *args, **kwargs):
        out = orig(self, request, *args, **kwargs)
        tracker = getattr(self, TRACKER_ATTR, None)
        if isinstance(tracker, Tracker):
            blocks, hits = out[0], out[1]
            hit_blocks = blocks.blocks[tracker.group_id] if hits else ()
            _guarded(tracker.scheduler, tracker.looked_up, request, hit_blocks, hits)
        return out

    setattr(get_computed_blocks, PATCHED_ATTR, True)
    manager_cls.get_computed_blocks = get_computed_blocks


def blocks_cached(pool: Any, request: Any, args: tuple, kwargs: dict) -> None:
    """After `BlockPool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
    kv_cache_group_id, ...)` inserted blocks (calls.patch_block_pool calls it): stamp them."""
    tracker = getattr(pool, TRACKER_ATTR, None)
    if not isinstance(tracker, Tracker):
        return
    names = ("blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id")
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    if bound.get("kv_cache_group_id") != tracker.group_id:
        return
    _guarded(
        tracker.scheduler,
        tracker.cached,
        request,
        bound["blocks"],
        bound["num_cached_blocks"],
        bound["num_full_blocks"],
    )


def patch_set_weight_version(engine_core_cls: Any) -> None:
    """vLLM's own label setter (its /update_weight_version and /finish_weight_update): the label change
    reaches the requests' segments. Idempotent."""
    orig = engine_core_cls.set_weight_version
    if getattr(orig, PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def set_weight_version(self, weight_version, *args, **kwargs):
        set_label(self, weight_version)
        return orig(self, weight_version, *args, **kwargs)

    setattr(set_weight_version, PATCHED_ATTR, True)
    engine_core_cls.set_weight_version = set_weight_version


def lookup(core: Any, args: rpc.PromptIdsArgs) -> PromptVersions:
    """The reserved call PROMPT_VERSIONS: the prompt spans of these requests (ids unknown or no longer
    kept are left out)."""
    tracker = tracker_of(core.scheduler)
    if tracker is None:
        return PromptVersions({})
    return PromptVersions({i: prompt_spans(tracker.kept[i]) for i in args.ids if i in tracker.kept})


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    patch_scheduler(Scheduler)
    patch_kv_cache_manager(KVCacheManager)
    patch_set_weight_version(EngineCore)
