"""The same staged update, written through vLLM's own sparse path instead of our scatter.

For comparison (benchmarks/pause_latency.py) and as a cross-check: inside the pause, the staged
changes go to `load_checkpoint_weight_patches` as absolute bf16 values at Hugging Face positions
(what vLLM's sparse_nccl backend receives). Staging, verification and rollback stay ours: the
elements written are the same, so our rollback buffer restores them (replica.py writes and rolls back).

Plain functions of the layout and the staged update: this module knows nothing of the replica.
"""

from __future__ import annotations

from typing import Any

import torch

from ...apply.emit import StagedUpdate
from ...apply.layout import Layout


def checkpoint_patches(layout: Layout, staged: StagedUpdate) -> list[Any]:
    """Per HF tensor: the staged positions this rank holds and their new values, in HF coordinates
    (vLLM `CheckpointWeightPatch` objects)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    # (target -> sorted offsets, their new bits) from the staged plans (either plan form).
    parts: dict[int, tuple[list, list]] = {}
    for plan, bits in zip(staged.plans, staged.new_bits):
        for target, offs, idx in plan.local_elements():
            o, b = parts.setdefault(target, ([], []))
            o.append(offs.cpu())
            b.append(bits[idx].cpu())
    by_target: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for target, (o, b) in parts.items():
        offs, order = torch.sort(torch.cat(o))
        by_target[target] = (offs, torch.cat(b)[order])
    patches = []
    for name, segs in layout.segments.items():
        pos_parts, val_parts = [], []
        for seg in segs:
            if seg.target not in by_target:
                continue
            offs, bits = by_target[seg.target]
            pos, dst = layout.segment_elements(name, seg)
            hit = torch.isin(dst, offs)
            if bool(hit.any()):
                pos_parts.append(pos[hit])
                val_parts.append(bits[torch.searchsorted(offs, dst[hit])])
        if pos_parts:
            pos = torch.cat(pos_parts)
            vals = torch.cat(val_parts)
            pos, first = _unique_first(pos)
            values = vals[first].to(torch.int16).view(torch.bfloat16)
            patches.append(CheckpointWeightPatch(name, tuple(layout.hf_shapes[name]), torch.bfloat16, values, pos))
    return patches


def _unique_first(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique positions and, for each, the index of its first occurrence (tied copies repeat)."""
    order = torch.sort(pos, stable=True).indices
    sp = pos[order]
    keep = torch.ones_like(sp, dtype=torch.bool)
    keep[1:] = sp[1:] != sp[:-1]
    return sp[keep], order[keep]


def load_patches(model: torch.nn.Module, patches: list[Any]) -> None:
    """Write patches through vLLM's own `load_checkpoint_weight_patches` (the model's weight loaders)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    load_checkpoint_weight_patches(model, patches)
