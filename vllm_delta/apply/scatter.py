"""In-place scatter of bit patterns into many target tensors: the only work inside the pause.

A plan (plans.py, built before the pause) says where each changed element goes; `scatter_` writes
bits there in place; `gather` reads the current bits at the same places (the rollback buffer).
Targets are written through their own storage, never rebound (CUDA graphs hold their addresses).
Grouped plans run on the torch path (one `index_copy_` per target: CPU, and the reference for the
kernels); fused plans run one kernel launch per element width. `FusedAddressing` holds how fused
plans of one width address a device's targets (every target's offset from the base).

Backends for fused plans: "triton" (the `_*_kernel` functions below), "cuda" (csrc/, built on
demand, see `_cuda.py`) and "torch" (per-target `index_copy_`, for checking). `default_backend`
picks one per device; VLLM_DELTA_SCATTER_BACKEND overrides it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .plans import BLOCK, FusedPlan, GroupedPlan, ScatterPlan, address_base, fused_plan

if TYPE_CHECKING:
    from .layout import TargetRuns

try:  # Triton is optional: CPU installs work without it (the torch path).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

# Fastest first, as measured by benchmarks/apply_gpu.py (docs/PERFORMANCE.md, "GPU apply").
GPU_BACKENDS = ("cuda", "triton")
# Triton launch configuration of the fused kernels: plan blocks per program, warps per program.
TRITON_ROWS = 2
TRITON_WARPS = 8


@dataclass
class FusedAddressing:
    """How fused plans of one element width address a device's targets: every target's element
    offset from the lowest-addressed one (the base), as a host list and a device tensor."""

    flats: list[torch.Tensor | None]  # flat views of the targets of this width (None: other widths)
    base: torch.Tensor  # the flat view of the lowest-addressed target
    offsets: list[int]  # element offset of each target from `base` (0 for targets of other widths)
    offsets_t: torch.Tensor  # the same, on the device

    @classmethod
    def of(cls, flats: list[torch.Tensor], width: int, device: torch.device) -> FusedAddressing | None:
        """The addressing of `flats`' targets of `width` bytes on `device` (None if there are none)."""
        ids = [i for i, f in enumerate(flats) if f.element_size() == width and f.device == device]
        if not ids:
            return None
        b, deltas = address_base([flats[i] for i in ids])
        offsets = [0] * len(flats)
        for i, d in zip(ids, deltas):
            offsets[i] = d
        keep = set(ids)
        return cls(
            flats=[f if i in keep else None for i, f in enumerate(flats)],
            base=flats[ids[b]],
            offsets=offsets,
            offsets_t=torch.tensor(offsets, dtype=torch.int64, device=device),
        )

    def plan(
        self, target_ids: torch.Tensor, offsets: torch.Tensor, *, block: int = BLOCK, runs: TargetRuns | None = None
    ) -> FusedPlan:
        return fused_plan(
            self.flats, self.base, self.offsets, self.offsets_t, target_ids, offsets, block=block, runs=runs
        )

    def gather(self, target_ids: torch.Tensor, offsets: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        """Live bits at (target, offset) pairs."""
        return gather_at(self.base, self.offsets_t[target_ids] + offsets, backend)


# -- backends --------------------------------------------------------------------------------------
def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run fused plans on `device` ("torch" always)."""
    device = torch.device(device)
    out = []
    if device.type == "cuda":
        from . import _cuda

        if _cuda.available():
            out.append("cuda")
        if triton is not None:
            out.append("triton")
        out = [b for b in GPU_BACKENDS if b in out]
    elif triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
        out.append("triton")
    return out + ["torch"]


def backend_available(backend: str, device: torch.device | str) -> bool:
    """Whether `backend` can run fused plans on `device` (builds the CUDA extension only if asked)."""
    device = torch.device(device)
    if backend == "torch":
        return True
    if backend == "triton":
        return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    if backend == "cuda":
        from . import _cuda

        return device.type == "cuda" and _cuda.available()
    return False


def default_backend(device: torch.device | str) -> str:
    """VLLM_DELTA_SCATTER_BACKEND if set, else the fastest available for the device (torch on CPU)."""
    forced = os.environ.get("VLLM_DELTA_SCATTER_BACKEND")
    if forced:
        if forced not in ("torch", "triton", "cuda"):
            raise ValueError(f"VLLM_DELTA_SCATTER_BACKEND={forced!r}: use torch, triton or cuda")
        return forced
    device = torch.device(device)
    if device.type != "cuda":
        return "torch"
    return available_backends(device)[0]


def _resolve(backend: str | None, device: torch.device) -> str:
    return backend or default_backend(device)


# -- Triton kernels --------------------------------------------------------------------------------
if triton is not None:
    # n_blocks / n are not specialized on: the warm-up launch (one block) compiles what a patch runs.
    @triton.jit(do_not_specialize=["n_blocks"])
    def _scatter_blocks_kernel(
        base_ptr, block_base_ptr, rel_ptr, src_ptr, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = rows < n_blocks
        bb = tl.load(block_base_ptr + rows, mask=live, other=0)
        slot = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        m = live[:, None]
        rel = tl.load(rel_ptr + slot, mask=m, other=-1)
        val = tl.load(src_ptr + slot, mask=m, other=0)
        tl.store(base_ptr + (bb[:, None] + rel.to(tl.int64)), val, mask=rel >= 0)

    @triton.jit(do_not_specialize=["n_blocks"])
    def _gather_blocks_kernel(
        base_ptr, block_base_ptr, rel_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = rows < n_blocks
        bb = tl.load(block_base_ptr + rows, mask=live, other=0)
        slot = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        m = live[:, None]
        rel = tl.load(rel_ptr + slot, mask=m, other=-1)
        ok = rel >= 0
        val = tl.load(base_ptr + (bb[:, None] + rel.to(tl.int64)), mask=ok, other=0)
        tl.store(out_ptr + slot, val, mask=m)

    @triton.jit(do_not_specialize=["n"])
    def _gather_addr_kernel(base_ptr, addr_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        addr = tl.load(addr_ptr + i, mask=m, other=0)
        tl.store(out_ptr + i, tl.load(base_ptr + addr, mask=m, other=0), mask=m)


def _triton_blocks(kernel, plan: FusedPlan, bits: torch.Tensor, rows: int, warps: int) -> None:
    n_blocks = plan.block_base.numel()
    if n_blocks:
        kernel[(triton.cdiv(n_blocks, rows),)](
            plan.base, plan.block_base, plan.rel, bits, n_blocks, BLOCK=plan.block, ROWS=rows, num_warps=warps
        )


# -- torch path for fused plans (CPU, and the reference for the kernels) ---------------------------
def _fused_runs(plan: FusedPlan) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(target flat view, target-local offsets, slot indices) of each run of a fused plan."""
    for t, local, slots in plan.local_elements():
        yield _target(plan, t), local, slots


def _target(plan: ScatterPlan, i: int) -> torch.Tensor:
    target = plan.targets[i]
    if target is None:  # a plan's bounds only name the targets it holds
        raise ValueError(f"plan does not hold target {i}")
    return target


# -- public entry points ---------------------------------------------------------------------------
def gather(plan: ScatterPlan, backend: str | None = None) -> torch.Tensor:
    """Current bit patterns at the plan's places, in plan order (padding slots: 0)."""
    out = torch.zeros(plan.size, dtype=plan.dtype, device=plan.device)
    if isinstance(plan, GroupedPlan):
        for i, s, e in plan.bounds:
            out[s:e] = _target(plan, i)[plan.offsets[s:e]]
        return out
    be = _resolve(backend, plan.device)
    if be == "triton":
        _triton_blocks(_gather_blocks_kernel, plan, out, TRITON_ROWS, TRITON_WARPS)
    elif be == "cuda":
        from . import _cuda

        _cuda.gather_blocks(plan, out)
    elif be == "torch":
        for flat, local, slots in _fused_runs(plan):
            out[slots] = flat[local]
    else:
        raise ValueError(f"unknown scatter backend {be!r}")
    return out


def scatter_(plan: ScatterPlan, bits: torch.Tensor, backend: str | None = None) -> None:
    """Write `bits` (plan order) into the targets, in place."""
    if isinstance(plan, GroupedPlan):
        for i, s, e in plan.bounds:
            target = _target(plan, i)
            target.index_copy_(0, plan.offsets[s:e], bits[s:e].to(target.dtype))
        return
    if bits.numel() != plan.size or bits.dtype != plan.dtype or bits.device != plan.device:
        raise ValueError(f"bits must be {plan.size} {plan.dtype} on {plan.device}, plan order")
    be = _resolve(backend, plan.device)
    if be == "triton":
        _triton_blocks(_scatter_blocks_kernel, plan, bits, TRITON_ROWS, TRITON_WARPS)
    elif be == "cuda":
        from . import _cuda

        _cuda.scatter_blocks(plan, bits)
    elif be == "torch":
        for flat, local, slots in _fused_runs(plan):
            flat.index_copy_(0, local, bits[slots])
    else:
        raise ValueError(f"unknown scatter backend {be!r}")


def gather_at(base: torch.Tensor, addresses: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """Bits at int64 element offsets from `base`'s address (any target of the same device and width).

    Kernel backends only: the torch path can't address outside one tensor."""
    out = torch.empty(addresses.numel(), dtype=base.dtype, device=addresses.device)
    n = addresses.numel()
    if not n:
        return out
    be = _resolve(backend, addresses.device)
    if be == "triton":
        _gather_addr_kernel[(triton.cdiv(n, 1024),)](base, addresses, out, n, BLOCK=1024, num_warps=4)
    elif be == "cuda":
        from . import _cuda

        _cuda.gather_addr(base, addresses, out)
    else:
        raise ValueError(f"gather_at needs a kernel backend, not {be!r}")
    return out
