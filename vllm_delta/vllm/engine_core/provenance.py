"""Prompt provenance: which weights computed the KV of each prompt position (`prefill_weight_versions`,
SGLang's key and sense), in the engine core.

vLLM labels each step's outputs with the weight version (`EngineCore._weight_version`), which gives the
output spans; nothing says which weights computed the KV a request reads. With prefix caching a
prompt is served from blocks computed by earlier requests, possibly under an older version: vLLM's own
RL routes leave the prefix cache as it is (cache invalidation is the caller's business), a request
that rode through an in-flight update holds KV of two versions, and one recomputed after a keep-mode
update holds only the new one. Here:

* each KV block of the tracked group carries a stamp: where in the block each label's writes begin,
  `[(offset, label), ...]`. A step's scheduled positions are stamped when the scheduler hands the step
  out (`Scheduler.schedule`, patched): the label at that moment is the one the step's forward runs
  under, because commits run between engine steps and a batch dispatched before a commit runs on the
  weights before it (the held labels of a batch queue, reserved.py, say the same for its outputs);
  copies of blocks (vLLM's copy-on-write, `kv_cache_block_copies`) copy the stamp. A block reached
  through a prefix-cache hit keeps the stamp of the step that computed it;
* when a step completes a request's prompt, its prompt spans are read off its blocks' stamps and kept
  (bounded, by the id the API process knows); a recomputed prompt (preemption, keep-mode reset)
  replaces them;
* the reserved call PROMPT_VERSIONS answers them to the API process (api_server/spans.py).

Costs: per scheduled request and step, a few attribute reads and one dict lookup; a stamp changes only
where a block starts or the label changed. Not tracked (no `prefill_weight_versions`): a KV connector
(KV loaded from outside this engine was computed under versions nobody recorded), KV-cache groups that
are not plain full attention (sliding windows, Mamba state, fine-grained hash blocks).
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

TRACKER_ATTR = "_vllm_delta_provenance"  # on the Scheduler: its Tracker, or False where not tracked
CORE_ATTR = "_vllm_delta_core"  # on the Scheduler: the EngineCore whose label its steps run under
PATCHED_ATTR = "_vllm_delta_patched"
PROMPTS_LIMIT = 4096  # prompts whose provenance is kept (a response asks right after it finished)

Stamp = list[tuple[int, str]]  # (offset in the block where this label's writes begin, label), in order


@dataclass
class Tracker:
    """The stamps of one scheduler's tracked KV-cache group, and the prompt spans kept."""

    manager: Any  # vLLM's FullAttentionManager of the tracked group (req_to_blocks)
    block_size: int
    stamps: dict[int, Stamp] = field(default_factory=dict)  # block id -> stamp
    prompts: OrderedDict[str, list[WeightSpan]] = field(default_factory=OrderedDict)

    def copy(self, src: int, dst: int) -> None:
        self.stamps[dst] = list(self.stamps.get(src, ()))

    def stamp(self, blocks: list[Any], start: int, end: int, label: str) -> None:
        """Positions [start, end) of a request whose blocks are `blocks` run under `label`."""
        bs = self.block_size
        i, offset = divmod(start, bs)
        last = min((end - 1) // bs, len(blocks) - 1)
        stamps = self.stamps
        while i <= last:
            block_id = blocks[i].block_id
            if offset == 0:
                stamps[block_id] = [(0, label)]
            else:
                old = stamps.get(block_id)
                if old is None:  # written from mid-block on, its start unseen (not expected): say so
                    stamps[block_id] = [(0, UNKNOWN_LABEL), (offset, label)]
                elif old[-1][1] != label or old[-1][0] >= offset:
                    kept = [t for t in old if t[0] < offset]
                    if not kept or kept[-1][1] != label:
                        kept.append((offset, label))
                    stamps[block_id] = kept
            i += 1
            offset = 0

    def prompt_spans(self, blocks: list[Any], num_prompt: int) -> list[WeightSpan]:
        """The prompt's spans, read off its blocks' stamps (adjacent equal labels merged)."""
        bs = self.block_size
        spans: list[WeightSpan] = []
        for i in range(min(-(-num_prompt // bs), len(blocks))):
            stamp = self.stamps.get(blocks[i].block_id) or [(0, UNKNOWN_LABEL)]
            for j, (offset, label) in enumerate(stamp):
                begin = i * bs + offset
                end = min(i * bs + (stamp[j + 1][0] if j + 1 < len(stamp) else bs), num_prompt)
                if begin >= end:
                    continue
                if spans and spans[-1].version == label and spans[-1].end == begin:
                    spans[-1] = WeightSpan(label, spans[-1].start, end)
                else:
                    spans.append(WeightSpan(label, begin, end))
        return spans

    def keep(self, request_id: str, spans: list[WeightSpan]) -> None:
        self.prompts[request_id] = spans
        self.prompts.move_to_end(request_id)
        while len(self.prompts) > PROMPTS_LIMIT:
            self.prompts.popitem(last=False)


def _new_tracker(scheduler: Any) -> Tracker | None:
    """A tracker for the scheduler's first plain full-attention KV-cache group; None where prompt
    provenance cannot be told (module docstring)."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if getattr(scheduler, "connector", None) is not None:
        log.info("vllm-delta: a KV connector is configured: no prompt provenance (prefill_weight_versions)")
        return None
    managers = getattr(
        getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None), "single_type_managers", ()
    )
    for manager in managers:
        if type(manager) is FullAttentionManager:
            pool = manager.block_pool
            if getattr(pool, "hash_block_size", manager.block_size) != manager.block_size:
                break  # fine-grained prefix hits end inside blocks shared with other requests
            return Tracker(manager, manager.block_size)
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


def external_id(engine_request_id: str) -> str:
    """The id the API process passed to generate(): vLLM appends "-<8 random chars>" (input_processor)."""
    head, sep, tail = engine_request_id.rpartition("-")
    return head if sep and len(tail) == 8 else engine_request_id


def after_schedule(scheduler: Any, scheduler_output: Any) -> None:
    """Stamp the positions a step computes with the label it runs under; keep the spans of every prompt
    the step completes."""
    tracker = tracker_of(scheduler)
    if tracker is None:
        return
    for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
        tracker.copy(copy.src_block_id, copy.dst_block_id)
    core = getattr(scheduler, CORE_ATTR, None)
    label = core._weight_version if core is not None else "default"
    requests = scheduler.requests
    req_to_blocks = tracker.manager.req_to_blocks
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        request = requests.get(req_id)
        blocks = req_to_blocks.get(req_id)
        if request is None or not blocks or n <= 0:
            continue
        end = request.num_computed_tokens  # advanced by the step being handed out
        start = end - n
        tracker.stamp(blocks, start, end, label)
        num_prompt = request.num_prompt_tokens
        if start < num_prompt <= end:
            tracker.keep(external_id(req_id), tracker.prompt_spans(blocks, num_prompt))


def patch_scheduler(scheduler_cls: Any) -> None:
    """Run after_schedule after every `schedule()`; a failure turns provenance off for that scheduler
    (logged once) and never reaches the engine. Idempotent."""
    orig = scheduler_cls.schedule
    if getattr(orig, PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if getattr(self, TRACKER_ATTR, None) is not False:
            try:
                after_schedule(self, out)
            except Exception as exc:  # noqa: BLE001 - attribution never stops the engine
                setattr(self, TRACKER_ATTR, False)
                log.warning("vllm-delta: prompt provenance turned off after an error: %s", exc, exc_info=exc)
        return out

    setattr(schedule, PATCHED_ATTR, True)
    scheduler_cls.schedule = schedule


def patch_set_weight_version(engine_core_cls: Any) -> None:
    """vLLM's own label setter (its /update_weight_version and /finish_weight_update) attaches the core to
    its scheduler before the label changes. With the reserved calls and every labelled step
    (reserved.patch_engine_core), the scheduler knows its core before any label but the initial
    "default" is set: the plugin is loaded inside EngineCore.__init__, too late to wrap it. Idempotent."""
    orig = engine_core_cls.set_weight_version
    if getattr(orig, PATCHED_ATTR, False):
        return

    @functools.wraps(orig)
    def set_weight_version(self, *args, **kwargs):
        attach(self)
        return orig(self, *args, **kwargs)

    setattr(set_weight_version, PATCHED_ATTR, True)
    engine_core_cls.set_weight_version = set_weight_version


def lookup(core: Any, args: rpc.PromptIdsArgs) -> PromptVersions:
    """The reserved call PROMPT_VERSIONS: the kept prompt spans of these requests (ids unknown or not
    kept are left out)."""
    tracker = tracker_of(core.scheduler)
    if tracker is None:
        return PromptVersions({})
    return PromptVersions({i: tracker.prompts[i] for i in args.ids if i in tracker.prompts})


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    patch_scheduler(Scheduler)
    patch_set_weight_version(EngineCore)
