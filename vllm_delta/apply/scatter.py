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
    targets: list[torch.Tensor]  # flat integer views of the live tensors (same storage)
    bounds: list[tuple[int, int, int]]  # (target index, start, end) into offsets/values
    offsets: torch.Tensor  # int64 target-local flat element offsets, grouped by target

    @property
    def nnz(self) -> int:
        return int(self.offsets.numel())


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a live tensor's whole storage region (no copy, same address)."""
    if not t.is_contiguous():
        raise ValueError("scatter targets must be contiguous")
    return bit_view(t.detach()).view(-1)


def build_plan(targets: list[torch.Tensor], target_ids: torch.Tensor, offsets: torch.Tensor) -> ScatterPlan:
    """Group (target id, offset) pairs by target. Offsets within a target keep their order."""
    flats = [flat_bits(t) for t in targets]
    device = flats[0].device if flats else torch.device("cpu")
    ids = target_ids.to(device=device, dtype=torch.int64)
    offs = offsets.to(device=device, dtype=torch.int64)
    if ids.numel() and bool((ids[1:] < ids[:-1]).any()):
        order = torch.sort(ids, stable=True).indices
        ids, offs = ids[order], offs[order]
    counts = torch.bincount(ids, minlength=len(flats)).tolist() if ids.numel() else [0] * len(flats)
    bounds, start = [], 0
    for i, n in enumerate(counts):
        if n:
            if int(offs[start : start + n].max()) >= flats[i].numel() or int(offs[start : start + n].min()) < 0:
                raise IndexError(f"scatter offset out of range for target {i} ({flats[i].numel()} elements)")
            bounds.append((i, start, start + n))
        start += n
    return ScatterPlan(flats, bounds, offs)


def gather(plan: ScatterPlan) -> torch.Tensor:
    """Current bit patterns at the plan's places, in plan order."""
    dtype = plan.targets[0].dtype if plan.targets else torch.int16
    out = torch.empty(plan.nnz, dtype=dtype, device=plan.offsets.device)
    for i, s, e in plan.bounds:
        out[s:e] = plan.targets[i][plan.offsets[s:e]]
    return out


def scatter_(plan: ScatterPlan, bits: torch.Tensor) -> None:
    """Write `bits` (plan order) into the targets, in place."""
    for i, s, e in plan.bounds:
        plan.targets[i].index_copy_(0, plan.offsets[s:e], bits[s:e].to(plan.targets[i].dtype))
