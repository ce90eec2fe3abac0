"""In-place scatter of bit patterns into many target tensors: the only work inside the pause.

`build_plan` (before the pause) groups the changed elements by target; `scatter_` writes them
in place; `gather` reads the current values at the same places (the rollback buffer). Targets are
written through their own storage, never rebound (CUDA graphs hold their addresses).

This module holds the torch path (CPU, and the reference for the GPU kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checksum import bit_view


@dataclass
class ScatterPlan:
    targets: list[torch.Tensor | None]  # flat integer views of the live tensors (None: unused here)
    bounds: list[tuple[int, int, int]]  # (target index, start, end) into offsets/values
    offsets: torch.Tensor  # int64 target-local flat element offsets, grouped by target
    order: torch.Tensor | None = None  # permutation that grouped the caller's elements (None: kept)

    @property
    def nnz(self) -> int:
        return int(self.offsets.numel())

    @property
    def dtype(self) -> torch.dtype:
        used = [t for t in self.targets if t is not None]
        return used[0].dtype if used else torch.int16


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a live tensor's whole storage region (no copy, same address)."""
    if not t.is_contiguous():
        raise ValueError("scatter targets must be contiguous")
    return bit_view(t.detach()).view(-1)


def build_plan(targets: list[torch.Tensor], target_ids: torch.Tensor, offsets: torch.Tensor) -> ScatterPlan:
    """Group (target id, offset) pairs by target; all referenced targets share one element width.

    Elements are stably reordered by target id; `plan.order` says how (apply it to the values).
    """
    device = offsets.device
    ids = target_ids.to(device=device, dtype=torch.int64)
    offs = offsets.to(dtype=torch.int64)
    order = None
    if ids.numel() and bool((ids[1:] < ids[:-1]).any()):
        order = torch.sort(ids, stable=True).indices
        ids, offs = ids[order], offs[order]
    counts = torch.bincount(ids, minlength=len(targets)).tolist() if ids.numel() else [0] * len(targets)
    flats: list[torch.Tensor | None] = [None] * len(targets)
    bounds, start = [], 0
    for i, n in enumerate(counts):
        if n:
            flats[i] = flat_bits(targets[i])
            seg = offs[start : start + n]
            if int(seg.max()) >= flats[i].numel() or int(seg.min()) < 0:
                raise IndexError(f"scatter offset out of range for target {i} ({flats[i].numel()} elements)")
            bounds.append((i, start, start + n))
        start += n
    widths = {flats[i].element_size() for i, _, _ in bounds}
    if len(widths) > 1:
        raise ValueError("one scatter plan covers targets of one element width")
    return ScatterPlan(flats, bounds, offs, order)


def gather(plan: ScatterPlan) -> torch.Tensor:
    """Current bit patterns at the plan's places, in plan order."""
    out = torch.empty(plan.nnz, dtype=plan.dtype, device=plan.offsets.device)
    for i, s, e in plan.bounds:
        out[s:e] = plan.targets[i][plan.offsets[s:e]]
    return out


def scatter_(plan: ScatterPlan, bits: torch.Tensor) -> None:
    """Write `bits` (plan order) into the targets, in place."""
    for i, s, e in plan.bounds:
        plan.targets[i].index_copy_(0, plan.offsets[s:e], bits[s:e].to(plan.targets[i].dtype))
