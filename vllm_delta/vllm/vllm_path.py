"""The same staged update, written through vLLM's own sparse path instead of our scatter.

For comparison (benchmarks/pause_latency.py) and as a cross-check: inside the pause, the staged
changes go to `load_checkpoint_weight_patches` as absolute bf16 values at Hugging Face positions
(what vLLM's sparse_nccl backend receives). Staging, verification and rollback stay ours: the
elements written are the same, so our rollback buffer restores them.
"""

from __future__ import annotations

import time

import torch

from .replica import DeltaReplica, Served, Ticket


def checkpoint_patches(replica: DeltaReplica, t: Ticket) -> list:
    """Per HF tensor: the staged positions this rank holds and their new values, in HF coordinates."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    engine = replica.engine
    assert engine is not None and t.staged is not None
    # (target -> sorted offsets, their new bits) from the staged plans (either plan form).
    parts: dict[int, tuple[list, list]] = {}
    for plan, bits in zip(t.staged.plans, t.staged.new_bits):
        for target, offs, idx in plan.local_elements():
            o, b = parts.setdefault(target, ([], []))
            o.append(offs.cpu())
            b.append(bits[idx].cpu())
    staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for target, (o, b) in parts.items():
        offs, order = torch.sort(torch.cat(o))
        staged[target] = (offs, torch.cat(b)[order])
    layout = engine.layout
    patches = []
    for name, segs in layout.segments.items():
        pos_parts, val_parts = [], []
        for seg in segs:
            if seg.target not in staged:
                continue
            offs, bits = staged[seg.target]
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


def commit_through_vllm(replica: DeltaReplica, ticket: str) -> float:
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    t = replica.tickets[ticket]
    patches = t.vllm_patches
    if patches is None:
        raise ValueError(f"ticket {ticket} was not staged for vLLM's sparse path")
    assert t.staged is not None and t.fallback is not None and replica.fallback is not None
    t0 = time.perf_counter()
    try:
        load_checkpoint_weight_patches(replica.model, patches)
        replica.fallback.commit(t.fallback)
        replica.recompute_derived()  # handlers' derived tensors (handlers.py)
    except BaseException:
        replica.engine.rollback(t.staged)  # same elements: our rollback buffer restores them
        replica.recompute_derived()
        raise
    t.staged.committed = True
    t.previous, replica.served = replica.served, Served.from_header(t.staged.header)
    return (time.perf_counter() - t0) * 1e3
