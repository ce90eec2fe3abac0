"""Scatter plans: where each changed element of a staged update goes (built before the pause).

Two forms (the kernels that execute them: scatter.py):

* grouped (`build_plan`): elements grouped by target, int64 target-local offsets. Executed by the
  torch path (one `index_copy_` per target): CPU, and the reference for the kernels.
* fused (`build_fused_plan`, `fused_plan`): one kernel launch for all targets of one element width.
  An element's address is its element offset from one *base* tensor (the target at the lowest
  address; every target of a device lives in one flat address space, so `base + offset` reaches any
  of them). Slots come in blocks of `block`; a block never straddles two targets. Each block has an
  int64 base; each slot an int32 offset relative to it (int64 when a block spans 2^31 elements or
  more), -1 in padding slots. 6 bytes per changed bf16 element are read inside the pause, addresses
  are int64-safe for any target size, and any position order is correct.

`cat_plans` joins fused plans built chunk by chunk; `flat_bits` is the integer view every plan
addresses a target through (no copy, same address: targets are written in place, never rebound).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from ..bits import bit_view
from ..codec import segment_ids

if TYPE_CHECKING:
    from .layout import TargetRuns

BLOCK = 1024  # slots per fused-plan block (a power of two)
INT32_MAX = (1 << 31) - 1
_PAD = -1


@dataclass
class GroupedPlan:
    """Elements grouped by target, with int64 target-local offsets: the torch path (one
    `index_copy_` per target; CPU, and the reference for the kernels)."""

    fused: ClassVar[bool] = False
    targets: list[torch.Tensor | None]  # flat integer views of the live tensors (None: unused here)
    bounds: list[tuple[int, int, int]]  # (target index, start, end) into `offsets`
    offsets: torch.Tensor  # int64 target-local element offsets, grouped by target
    order: torch.Tensor | None = None  # permutation that grouped the caller's elements (None: kept)

    @property
    def nnz(self) -> int:
        return int(self.offsets.numel())

    @property
    def size(self) -> int:
        """Length of the bit arrays `scatter_` takes and `gather` returns."""
        return int(self.offsets.numel())

    @property
    def dtype(self) -> torch.dtype:
        used = [t for t in self.targets if t is not None]
        return used[0].dtype if used else torch.int16

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @property
    def nbytes(self) -> int:
        return self.offsets.numel() * 8

    def local_elements(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per target: (target index, target-local offsets, indices into the plan-ordered bit arrays)."""
        for t, s, e in self.bounds:
            yield t, self.offsets[s:e], torch.arange(s, e, device=self.offsets.device)

    def arrange(self, values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """Caller-ordered per-element values -> plan order (what `scatter_` takes)."""
        return values[self.order] if self.order is not None else values


@dataclass
class FusedPlan:
    """One kernel launch for all targets of one element width (see the module docstring)."""

    fused: ClassVar[bool] = True
    targets: list[torch.Tensor | None]  # flat integer views of the live tensors (None: unused here)
    bounds: np.ndarray  # int64 [runs, 3]: (target index, first slot, end slot) of each run
    base: torch.Tensor  # flat integer view of the target at the lowest address
    block: int
    block_base: torch.Tensor  # int64 per block: element offset from `base`
    rel: torch.Tensor  # int32/int64 per slot, relative to its block's base; -1: padding
    slots: torch.Tensor  # int64: the slot of each caller element
    target_base: list[int]  # element offset of each target from `base`
    count: int  # caller elements

    @property
    def nnz(self) -> int:
        return self.count

    @property
    def size(self) -> int:
        """Length of the bit arrays `scatter_` takes and `gather` returns (slots, padding included)."""
        return int(self.rel.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.rel.device

    @property
    def nbytes(self) -> int:
        return self.rel.numel() * self.rel.element_size() + self.block_base.numel() * 8

    def local_elements(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per run: (target index, target-local offsets, indices into the plan-ordered bit arrays).
        The same view as GroupedPlan's."""
        for t, s, e in self.bounds.tolist():
            rel = self.rel[s:e].to(torch.int64)
            bb = torch.repeat_interleave(self.block_base[s // self.block : e // self.block], self.block)
            ok = rel >= 0
            yield t, (bb + rel)[ok] - self.target_base[t], ok.nonzero().reshape(-1) + s

    def arrange(self, values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """Caller-ordered per-element values -> plan order (what `scatter_` takes)."""
        out = torch.full((self.size,), fill, dtype=values.dtype, device=values.device)
        out[self.slots] = values
        return out

    def first_block(self) -> FusedPlan:
        """The plan's first block alone (a kernel warm-up that writes back what the block reads)."""
        rel, slots = self.rel[: self.block], self.slots[:0]
        return replace(self, bounds=_NO_RUNS, block_base=self.block_base[:1], rel=rel, slots=slots, count=0)


ScatterPlan = GroupedPlan | FusedPlan


_NO_RUNS = np.zeros((0, 3), dtype=np.int64)


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a live tensor's whole storage region (no copy, same address)."""
    if not t.is_contiguous():
        raise ValueError("scatter targets must be contiguous")
    return bit_view(t.detach()).view(-1)


def build_plan(targets: list[torch.Tensor], target_ids: torch.Tensor, offsets: torch.Tensor) -> GroupedPlan:
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
    bounds, start, widths = [], 0, set()
    for i, n in enumerate(counts):
        if n:
            flat = flats[i] = flat_bits(targets[i])
            seg = offs[start : start + n]
            if int(seg.max()) >= flat.numel() or int(seg.min()) < 0:
                raise IndexError(f"scatter offset out of range for target {i} ({flat.numel()} elements)")
            bounds.append((i, start, start + n))
            widths.add(flat.element_size())
        start += n
    if len(widths) > 1:
        raise ValueError("one scatter plan covers targets of one element width")
    return GroupedPlan(flats, bounds, offs, order)


def address_base(flats: list[torch.Tensor]) -> tuple[int, list[int]]:
    """(index of the lowest-addressed tensor, each tensor's element offset from it). One width, one device."""
    if not flats:
        return -1, []
    width = flats[0].element_size()
    if any(f.element_size() != width for f in flats):
        raise ValueError("one fused plan covers targets of one element width")
    if len({f.device for f in flats}) > 1:
        raise ValueError("one fused plan covers targets on one device")
    ptrs = [f.data_ptr() for f in flats]
    b = min(range(len(ptrs)), key=ptrs.__getitem__)
    deltas = [p - ptrs[b] for p in ptrs]
    if any(d % width for d in deltas):
        raise ValueError("targets are not aligned to their element width")
    return b, [d // width for d in deltas]


def build_fused_plan(
    targets: list[torch.Tensor],
    target_ids: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block: int = BLOCK,
    base_index: int | None = None,
    rel_dtype: torch.dtype | None = None,
    check: bool = True,
) -> FusedPlan:
    """A fused plan over (target id, target-local offset) pairs, in the caller's order.

    Runs of equal target ids become runs of blocks (padded to `block` slots). `base_index` names the
    tensor whose address is the base (default: the lowest-addressed referenced target; pass one for
    plans that are concatenated later). `rel_dtype` forces int32 or int64 offsets (default: int32
    where it fits). Values go into plan order with `plan.arrange`.
    """
    if block <= 0 or block & (block - 1):
        raise ValueError("block must be a power of two")
    device = offsets.device
    ids = target_ids.to(device=device, dtype=torch.int64).reshape(-1)
    offs = offsets.to(device=device, dtype=torch.int64).reshape(-1)
    flats = [flat_bits(t) for t in targets]
    used = sorted(set(torch.unique(ids).tolist())) if ids.numel() else []
    if used and (used[0] < 0 or used[-1] >= len(targets)):
        raise IndexError(f"target id out of range for {len(targets)} targets")
    if base_index is None:
        base_index = min(used, key=lambda i: flats[i].data_ptr()) if used else 0
    tbase = [0] * len(targets)
    if used:
        _, deltas = address_base([flats[base_index]] + [flats[i] for i in used])
        for i, d in zip(used, deltas[1:]):
            tbase[i] = d - deltas[0]
    if check and ids.numel():
        numel = torch.tensor([f.numel() for f in flats], dtype=torch.int64, device=device)
        bad = (offs < 0) | (offs >= numel[ids])
        if bool(bad.any()):
            t = int(ids[bad][0])
            raise IndexError(f"scatter offset out of range for target {t} ({flats[t].numel()} elements)")
    used_set = set(used)
    return fused_plan(
        [f if i in used_set else None for i, f in enumerate(flats)],
        flats[base_index] if flats else torch.zeros(0, dtype=torch.int16, device=device),
        tbase,
        torch.tensor(tbase, dtype=torch.int64, device=device),
        ids,
        offs,
        block=block,
        rel_dtype=rel_dtype,
    )


def fused_plan(
    flats: list[torch.Tensor | None],
    base: torch.Tensor,
    tbase: list[int],
    tbase_t: torch.Tensor,
    ids: torch.Tensor,
    offs: torch.Tensor,
    *,
    block: int = BLOCK,
    rel_dtype: torch.dtype | None = None,
    runs: TargetRuns | None = None,
) -> FusedPlan:
    """`build_fused_plan` without the argument checks, from precomputed tables (the engine's path):
    flat views, the base view, each target's element offset from the base (list and device tensor),
    int64 target ids and in-range int64 target-local offsets. The runs of equal ids are found on the
    device (one host synchronization), or given on the host (`runs`, which must describe `ids`: the
    engine knows them from the decoded chunk's tensors) with none."""
    device = offs.device
    n = offs.numel()
    if not n:
        return FusedPlan(
            targets=flats,
            bounds=_NO_RUNS,
            base=base,
            block=block,
            block_base=offs.new_zeros(0),
            rel=torch.zeros(0, dtype=torch.int32, device=device),
            slots=offs.new_zeros(0),
            target_base=tbase,
            count=0,
        )
    if runs is not None:
        ids_h, lengths_h = runs.targets, runs.lengths
        if int(lengths_h.sum()) != n:
            raise ValueError(f"the runs given hold {int(lengths_h.sum())} elements, the ids {n}")
        k = ids_h.size
        starts_h = np.cumsum(lengths_h) - lengths_h
    else:
        runs_at = torch.ones(n, dtype=torch.bool, device=device)
        torch.ne(ids[1:], ids[:-1], out=runs_at[1:])
        starts = runs_at.nonzero().reshape(-1)
        host = torch.cat([starts, ids[starts]]).cpu().numpy()
        k = host.size // 2
        starts_h, ids_h = host[:k], host[k:]
        lengths_h = np.diff(np.append(starts_h, n))
    padded_h = -(-lengths_h // block) * block  # runs in whole blocks (arrays: a MoE has ~2 runs per expert)
    pad_starts_h = np.cumsum(padded_h) - padded_h
    n_slots = int(padded_h.sum())
    bounds = np.stack([ids_h, pad_starts_h, pad_starts_h + padded_h], axis=1).astype(np.int64)
    small = torch.from_numpy(np.concatenate([pad_starts_h - starts_h, lengths_h]))
    small = small.to(device, non_blocking=True)
    slots = torch.arange(n, dtype=torch.int64, device=device)
    slots += small[:k][segment_ids(small[k:], n)]
    addr = torch.full((n_slots,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=device)
    addr[slots] = tbase_t[ids] + offs
    block_base = addr.view(-1, block).amin(dim=1)
    pad = addr == torch.iinfo(torch.int64).max
    rel = addr.view(-1, block).sub_(block_base[:, None]).view(-1)  # in place: addr becomes rel
    rel.masked_fill_(pad, _PAD)
    del pad
    # A block holds one run, so one target: its offsets from the block's base are below that target's
    # size, known on the host (no wait for the device) when every target used is in `flats`.
    used = [flats[t] for t in np.unique(ids_h).tolist()]
    fits = None not in used and max(f.numel() for f in used if f is not None) - 1 <= INT32_MAX
    if rel_dtype is None:
        rel_dtype = torch.int32 if fits or int(rel.max()) <= INT32_MAX else torch.int64
    elif rel_dtype == torch.int32 and not fits and int(rel.max()) > INT32_MAX:
        raise ValueError("a block spans 2^31 elements or more: use int64 offsets")
    return FusedPlan(
        targets=flats,
        bounds=bounds,
        base=base,
        block=block,
        block_base=block_base,
        rel=rel.to(rel_dtype),
        slots=slots,
        target_base=tbase,
        count=n,
    )


def cat_plans(plans: list[FusedPlan]) -> FusedPlan:
    """One fused plan from several over the same targets and base (e.g. built chunk by chunk)."""
    plans = [p for p in plans if p.size]
    if not plans:
        raise ValueError("nothing to concatenate")
    if len(plans) == 1:
        return plans[0]
    first = plans[0]
    if any(p.block != first.block or p.base.data_ptr() != first.base.data_ptr() for p in plans):
        raise ValueError("fused plans differ in block size or base")
    wide = any(p.rel.dtype == torch.int64 for p in plans)
    rel = torch.cat([p.rel.to(torch.int64) if wide else p.rel for p in plans])
    block_base = torch.cat([p.block_base for p in plans])
    bounds, slots, at = [], [], 0
    targets = list(first.targets)
    for p in plans:
        bounds.append(p.bounds + np.array([0, at, at], dtype=np.int64))
        slots.append(p.slots + at)
        at += p.size
        targets = [a if a is not None else b for a, b in zip(targets, p.targets)]
    tbase = [max(vals) for vals in zip(*(p.target_base for p in plans))]
    return FusedPlan(
        targets=targets,
        bounds=np.concatenate(bounds),
        base=first.base,
        block=first.block,
        block_base=block_base,
        rel=rel,
        slots=torch.cat(slots),
        target_base=tbase,
        count=sum(p.count for p in plans),
    )
