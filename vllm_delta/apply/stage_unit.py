"""One decoded unit staged in one kernel launch: translate, live bits, new bits, fused plan, arranged
bits and checksum partials.

The common case of staging (`emit.StageRun.emit`): a decoded chunk (differences or values) of whole
tensors whose elements go, each, to target offset p + shift of its tensor, with one owner for the chunk
(`DeviceLayout.whole_runs`: TP=1 dense tensors, or a rank's row runs it is known to hold). The host
knows the chunk's runs: HF tensor runs r (elements [s_r, e_r) of the chunk, tensor t_r) and target runs
j (elements [S_j, E_j), target T_j; several HF tensors of a fused target merge into one). Then, for
element i of HF run r in target run j, with the plan's runs padded to whole blocks of B slots
(P_j: run j's first slot):

    addr_i  = p_i + A_r                    A_r = target_base[T_j] + shift[t_r]  (offset from `base`)
    slot_i  = i + (P_j - S_j)
    old_i   = base[addr_i]                 (the live bits)
    new_i   = old_i + d_i | old_i - d_i (undo) | v_i   (mod 2^(8·width))
    block_base[b] = min addr_i over the block's elements
    rel[slot_i]   = addr_i - block_base[b]  (int32; -1 in padding slots)
    sums[t_r]    += Σ (p_i + 1) · WEIGHT · (u(new_i) - u(old_i))  mod 2^64   (when the chunk is owned)

with u() the unsigned value of a bit pattern. Exactly what `translate` + `LiveBits.gather` + `step_bits` +
`_add_partials` + `plans.fused_plan` + `FusedPlan.arrange` compute (the plan, the arranged new and old
bits with 0 in padding slots, the sums), in one launch: one program per plan block, reading the
block's elements once. The host sends the block and run tables in one pinned copy; nothing is read
back. Per changed bf16 element the kernel reads p (8 B), the difference (2 B) and the live bits (2 B),
and writes the new and old bits (2 + 2 B), rel (4 B) and the slot (8 B).

`stage_unit` runs the Triton kernel where Triton runs on the device (CUDA; the CPU under
TRITON_INTERPRET=1), else `stage_unit_torch`, the torch reference. `stage_chunk` is the engine's entry:
it decides, on the host, whether a chunk takes this path (False: the engine's general path runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..bits import UNSIGNED_MASK
from ..checksums import WEIGHT_INT64
from ..codec.decoding import Runs
from .layout import TargetRuns
from .plans import INT32_MAX, FusedPlan
from .scatter import FusedAddressing

if TYPE_CHECKING:
    from ..codec.decoding import Chunk
    from .layout import DeviceLayout

try:  # Triton is optional: CPU installs work without it (the torch reference).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

ENV = "VLLM_DELTA_STAGE_UNIT"  # "0": the engine's general path for every chunk (A/B measurements)
WARPS = 4
_BLK = 4  # int64 columns of the block table: first element, elements, first and end HF run
_RUN = 4  # ... of the HF run table: first element, end element, address shift, tensor index
_MAX64 = (1 << 63) - 1


def available(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: CUDA with Triton, or the CPU under TRITON_INTERPRET=1."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def enabled(unit_kernel: bool | None, device: torch.device) -> bool:
    """The engine's switch: `unit_kernel` if given, else on where the kernel runs, unless VLLM_DELTA_STAGE_UNIT=0."""
    if unit_kernel is not None:
        return unit_kernel
    return os.environ.get(ENV, "1") != "0" and available(device)


@dataclass
class UnitTables:
    """One chunk's host tables (numpy) and their device copy (`blocks`, `runs`: views of one tensor)."""

    bounds: np.ndarray  # int64 [target runs, 3]: the plan's bounds
    lengths: np.ndarray  # int64 per target run: elements
    n: int  # elements
    n_blocks: int
    block: int
    run_tensors: np.ndarray  # int64 per HF run: tensor index (layout order)
    run_counts: np.ndarray  # int64 per HF run: elements
    host: np.ndarray  # int64: the block table [n_blocks, _BLK] then the HF run table [runs, _RUN]
    blocks: torch.Tensor  # int64 [n_blocks, _BLK] on the device
    runs: torch.Tensor  # int64 [HF runs, _RUN] on the device


def unit_tables(runs: Runs, truns: TargetRuns, shifts: np.ndarray, block: int, device: torch.device) -> UnitTables:
    """The tables of a chunk: `runs` its nonempty HF tensor runs, `truns` its target runs, `shifts` the
    address shift A_r of each HF run (target base + the tensor's shift)."""
    counts = np.asarray(runs.counts, dtype=np.int64)
    hf_end = np.cumsum(counts)
    hf_start = hf_end - counts
    lengths = truns.lengths
    t_end = np.cumsum(lengths)
    t_start = t_end - lengths
    padded = -(-lengths // block) * block
    pad_start = np.cumsum(padded) - padded
    per = padded // block
    n_blocks = int(per.sum())
    j = np.repeat(np.arange(lengths.size), per)
    e0 = t_start[j] + np.arange(n_blocks, dtype=np.int64) * block - pad_start[j]
    ln = np.minimum(block, t_end[j] - e0)
    host_np = np.concatenate(
        [
            np.stack([e0, ln, np.searchsorted(hf_end, e0, "right"), np.searchsorted(hf_start, e0 + ln)], 1).ravel(),
            np.stack([hf_start, hf_end, shifts, np.asarray(runs.tensors, dtype=np.int64)], 1).ravel(),
        ]
    ).astype(np.int64)
    if device.type == "cuda":  # pinned: the caching host allocator keeps it until the copy is done
        host = torch.empty(host_np.size, dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = host_np
    else:
        host = torch.from_numpy(host_np)
    dev = host.to(device, non_blocking=True)
    bounds = np.stack([truns.targets, pad_start, pad_start + padded], 1).astype(np.int64)
    split = n_blocks * _BLK
    return UnitTables(
        bounds,
        lengths,
        int(lengths.sum()),
        n_blocks,
        block,
        np.asarray(runs.tensors, dtype=np.int64),
        counts,
        host_np,
        dev[:split].view(-1, _BLK),
        dev[split:].view(-1, _RUN),
    )


if triton is not None:

    @triton.jit(do_not_specialize=["undo"])
    def _unit_kernel(
        p_ptr,
        src_ptr,
        base_ptr,
        blk_ptr,
        run_ptr,
        sums_ptr,
        block_base_ptr,
        rel_ptr,
        slots_ptr,
        new_ptr,
        old_ptr,
        undo,
        WEIGHT: tl.constexpr,
        MASK: tl.constexpr,
        VALUES: tl.constexpr,
        OWNED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        e0 = tl.load(blk_ptr + b * 4)
        ln = tl.load(blk_ptr + b * 4 + 1)
        r_lo = tl.load(blk_ptr + b * 4 + 2)
        r_hi = tl.load(blk_ptr + b * 4 + 3)
        lane = tl.arange(0, BLOCK)
        ok = lane < ln
        i = e0 + lane
        p = tl.load(p_ptr + i, mask=ok, other=0)
        shift = tl.zeros([BLOCK], dtype=tl.int64)
        for r in range(r_lo, r_hi):  # the HF runs of this block: one, or a few in a fused target
            s = tl.load(run_ptr + r * 4)
            e = tl.load(run_ptr + r * 4 + 1)
            shift = tl.where((i >= s) & (i < e), tl.load(run_ptr + r * 4 + 2), shift)
        addr = p + shift
        bb = tl.min(tl.where(ok, addr, 9223372036854775807), axis=0)
        old = tl.load(base_ptr + addr, mask=ok, other=0)
        src = tl.load(src_ptr + i, mask=ok, other=0)
        if VALUES:
            new = src.to(old.dtype)
        else:
            wide = old.to(tl.int64)
            d = src.to(tl.int64)
            new = tl.where(undo != 0, wide - d, wide + d).to(old.dtype)  # wraps: the low bits kept
        slot = b * BLOCK + lane
        tl.store(new_ptr + slot, tl.where(ok, new, tl.zeros_like(new)))
        tl.store(old_ptr + slot, tl.where(ok, old, tl.zeros_like(old)))
        tl.store(rel_ptr + slot, tl.where(ok, addr - bb, -1).to(tl.int32))
        tl.store(slots_ptr + i, slot, mask=ok)
        tl.store(block_base_ptr + b, bb)
        if OWNED:
            delta = (new.to(tl.int64) & MASK) - (old.to(tl.int64) & MASK)
            term = (p + 1) * WEIGHT * delta  # int64, wrapping: mod 2^64
            for r in range(r_lo, r_hi):
                s = tl.load(run_ptr + r * 4)
                e = tl.load(run_ptr + r * 4 + 1)
                part = tl.sum(tl.where(ok & (i >= s) & (i < e), term, 0), axis=0)
                tl.atomic_add(sums_ptr + tl.load(run_ptr + r * 4 + 3), part)


Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def stage_unit(
    addressing: FusedAddressing,
    tables: UnitTables,
    p: torch.Tensor,
    src: torch.Tensor,
    *,
    values: bool,
    undo: bool = False,
    sums: torch.Tensor | None = None,
) -> Outputs:
    """(block_base, rel, slots, new, old) of a chunk (see the module docstring); adds its checksum terms
    to `sums` (int64 per HF tensor, in place) unless None. `p`: int64 positions; `src`: the chunk's
    differences or (`values`) new bits, of the targets' width. The Triton kernel where it runs, else the
    reference."""
    device = p.device
    p, src = p.contiguous(), src.contiguous()
    if not available(device):
        return stage_unit_torch(addressing, tables, p, src, values=values, undo=undo, sums=sums)
    base = addressing.base
    block_base = torch.empty(tables.n_blocks, dtype=torch.int64, device=device)
    rel = torch.empty(tables.n_blocks * tables.block, dtype=torch.int32, device=device)
    slots = torch.empty(tables.n, dtype=torch.int64, device=device)
    new = torch.empty(rel.numel(), dtype=base.dtype, device=device)
    old = torch.empty(rel.numel(), dtype=base.dtype, device=device)
    if not tables.n_blocks:
        return block_base, rel, slots, new, old
    _unit_kernel[(tables.n_blocks,)](
        p,
        src,
        base,
        tables.blocks,
        tables.runs,
        sums if sums is not None else block_base,
        block_base,
        rel,
        slots,
        new,
        old,
        int(undo),
        WEIGHT=WEIGHT_INT64,
        MASK=UNSIGNED_MASK[base.element_size()],
        VALUES=values,
        OWNED=sums is not None,
        BLOCK=tables.block,
        num_warps=WARPS,
    )
    return block_base, rel, slots, new, old


def stage_unit_torch(
    addressing: FusedAddressing,
    tables: UnitTables,
    p: torch.Tensor,
    src: torch.Tensor,
    *,
    values: bool,
    undo: bool = False,
    sums: torch.Tensor | None = None,
) -> Outputs:
    """`stage_unit` in torch (the reference; the path where Triton does not run): the live bits of each
    target run through the target's own flat view."""
    device, block = p.device, tables.block
    n_slots = tables.n_blocks * block
    shifts = tables.host[tables.n_blocks * _BLK :].reshape(-1, _RUN)[:, 2].copy()
    counts = torch.from_numpy(tables.run_counts)
    addr = p + torch.repeat_interleave(torch.from_numpy(shifts), counts).to(device)
    lengths = tables.lengths
    t_start = np.cumsum(lengths) - lengths
    moved = torch.from_numpy(tables.bounds[:, 1] - t_start)
    slots = torch.arange(tables.n, dtype=torch.int64, device=device)
    slots += torch.repeat_interleave(moved, torch.from_numpy(lengths)).to(device)
    old = torch.empty(tables.n, dtype=addressing.base.dtype, device=device)
    for t, s, n in zip(tables.bounds[:, 0].tolist(), t_start.tolist(), lengths.tolist()):
        flat = addressing.flats[t]
        assert flat is not None
        old[s : s + n] = flat[addr[s : s + n] - addressing.offsets[t]]
    wide = torch.int32 if old.element_size() == 2 else torch.int64
    if values:
        new = src.to(old.dtype)
    else:
        new = ((old.to(wide) - src.to(wide)) if undo else (old.to(wide) + src.to(wide))).to(old.dtype)
    at = torch.full((n_slots,), _MAX64, dtype=torch.int64, device=device)
    at[slots] = addr
    block_base = at.view(-1, block).amin(dim=1)
    rel = (at.view(-1, block) - block_base[:, None]).view(-1).masked_fill_(at == _MAX64, -1).to(torch.int32)
    arranged = []
    for bits in (new, old):
        out = torch.zeros(n_slots, dtype=bits.dtype, device=device)
        out[slots] = bits
        arranged.append(out)
    if sums is not None:
        mask = UNSIGNED_MASK[old.element_size()]
        term = (p + 1).mul_(WEIGHT_INT64).mul_((new.to(torch.int64) & mask) - (old.to(torch.int64) & mask))
        sums.index_add_(0, torch.repeat_interleave(torch.from_numpy(tables.run_tensors), counts).to(device), term)
    return block_base, rel, slots, arranged[0], arranged[1]


def stage_chunk(
    dlayout: DeviceLayout,
    addressing: FusedAddressing | None,
    p: torch.Tensor,
    runs: Runs,
    chunk: Chunk,
    sums: torch.Tensor,
    *,
    undo: bool,
    block: int,
) -> tuple[FusedPlan, torch.Tensor, torch.Tensor] | None:
    """The engine's fast path for one decoded chunk (`runs`: its nonempty runs): (fused plan, arranged new
    and old bits), its checksum terms added to `sums` where the chunk is owned. None, having done nothing,
    where the path does not apply (`DeviceLayout.whole_runs`; targets of 2^31 elements or more)."""
    src = chunk.values if chunk.values is not None else chunk.diffs
    if src is None or addressing is None or not runs.tensors.size:
        return None
    whole = dlayout.whole_runs(runs.tensors, runs.counts, runs.held)
    if whole is None:
        return None
    tab, truns, owner = whole
    used = [addressing.flats[t] for t in np.unique(truns.targets).tolist()]
    if any(f is None for f in used) or max(f.numel() for f in used if f is not None) - 1 > INT32_MAX:
        return None  # int64 offsets (the general path decides)
    tensors = np.asarray(runs.tensors, dtype=np.int64)
    shifts = np.asarray(addressing.offsets, dtype=np.int64)[tab.target_h[tensors]] + tab.shift_h[tensors]
    tables = unit_tables(runs, truns, shifts, block, p.device)
    if tables.n != p.numel():
        raise ValueError(f"the chunk's runs hold {tables.n} elements, its positions {p.numel()}")
    block_base, rel, slots, new, old = stage_unit(
        addressing, tables, p, src, values=chunk.values is not None, undo=undo, sums=sums if owner else None
    )
    plan = FusedPlan(
        targets=addressing.flats,
        bounds=tables.bounds,
        base=addressing.base,
        block=block,
        block_base=block_base,
        rel=rel,
        slots=slots,
        target_base=addressing.offsets,
        count=tables.n,
    )
    return plan, new, old
