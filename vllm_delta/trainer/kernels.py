"""Triton kernels of change detection: compare the bf16 image of many source tensors with the
snapshot without writing the image (detect.FlatSnapshot's "triton" backend; bf16 images only).

The torch path writes a chunk's image (dtype conversion: read 4 B, write 2 B per fp32 element), then
compares it with the snapshot (read 2 + 2 B, write a 1 B mask): 11 B per element before the
compaction. `mask_` converts and compares in registers (read 4 + 2 B, write 1 B): 7 B. The new
bits of the (few) changed elements are converted again by `gather_image`.

Sources of one launch share one dtype (fp32, fp16 or bf16) and are addressed as element offsets from
the lowest-addressed of them (as the apply engine's fused scatter does). The conversion is integer
arithmetic on the float32 bits, round to nearest even as torch does (Triton's own float conversion
truncates in the interpreter); NaNs become the NaN pattern torch's conversion gives on the device
for that source dtype (measured once), so both backends give the same bits.
"""

from __future__ import annotations

import os

import numpy as np
import torch

try:  # Triton is optional: CPU installs work without it (the torch path).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

BLOCK = 2048  # elements per program
SOURCES = (torch.float32, torch.bfloat16, torch.float16)  # source dtypes the kernels read


def available(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernels can make `dtype` images on `device`: bf16 images, on CUDA with Triton
    (on CPU only under TRITON_INTERPRET=1)."""
    if triton is None or dtype != torch.bfloat16:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


_NAN: dict[tuple[str, torch.dtype], int] = {}


def canonical_nan(device: torch.device, source: torch.dtype) -> int:
    """The int16 bits torch's `source` -> bf16 conversion gives every NaN on `device` (it differs by
    source dtype: e.g. 0xFFFF from float32 and 0x7FC0 from float16 on CPU)."""
    key = (str(device), source)
    if key not in _NAN:
        nan = torch.full((64,), float("nan"), dtype=source, device=device).to(torch.bfloat16).view(torch.int16)
        values = set(nan.tolist())
        if len(values) != 1:  # pragma: no cover - torch would disagree with itself
            raise RuntimeError(f"torch converts NaN to several bf16 patterns on {device}: {values}")
        _NAN[key] = values.pop()
    return _NAN[key]


if triton is not None:

    @triton.jit
    def _convert(x, NAN):
        """The bf16 image of `x` (fp32, fp16 or bf16) as int16 bits: round to nearest even on the float32
        bits (torch's rounding, exact on every backend, the interpreter included); NaN -> `NAN`."""
        if x.dtype == tl.bfloat16:
            bits = x.to(tl.int16, bitcast=True)
        else:
            u = x.to(tl.float32).to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            bits = r.to(tl.uint16).to(tl.int16, bitcast=True)
            bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, NAN.to(tl.int16), bits)  # NaN: integer test
        return bits

    @triton.jit
    def _mask_kernel(src_ptr, snap_ptr, mask_ptr, blk_src_ptr, blk_dst_ptr, blk_len_ptr, NAN, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        s = tl.load(blk_src_ptr + b)
        d = tl.load(blk_dst_ptr + b)
        n = tl.load(blk_len_ptr + b)
        i = tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(src_ptr + (s + i), mask=m, other=0)
        old = tl.load(snap_ptr + (d + i), mask=m, other=0)
        tl.store(mask_ptr + (d + i), (_convert(x, NAN) != old).to(tl.int8), mask=m)

    @triton.jit(do_not_specialize=["n"])
    def _gather_kernel(src_ptr, addr_ptr, out_ptr, n, NAN, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        addr = tl.load(addr_ptr + i, mask=m, other=0)
        x = tl.load(src_ptr + addr, mask=m, other=0)
        tl.store(out_ptr + i, _convert(x, NAN), mask=m)


class ChunkAddressing:
    """Where a chunk's elements come from: its segments' sources as element offsets from one base
    tensor, and a block table (source offset, chunk offset, length per BLOCK elements) on the device.

    `segments`: (source flat tensor, first source element, count, chunk offset) in chunk order. `ok`
    is False when the kernels can't address them (mixed or unsupported dtypes, misaligned views)."""

    def __init__(self, segments: list[tuple[torch.Tensor, int, int, int]], device: torch.device):
        srcs = [s[0] for s in segments]
        self.dtype = srcs[0].dtype
        width = srcs[0].element_size()
        ptrs = [s.data_ptr() for s in srcs]
        b = min(range(len(ptrs)), key=ptrs.__getitem__)
        self.base = srcs[b]
        deltas = [p - ptrs[b] for p in ptrs]
        self.ok = (
            self.dtype in SOURCES
            and all(s.dtype == self.dtype and s.device == device for s in srcs)
            and not any(d % width for d in deltas)
        )
        src0 = np.array([d // width + a for d, (_, a, _, _) in zip(deltas, segments)], dtype=np.int64)
        dst0 = np.array([dst for _, _, _, dst in segments], dtype=np.int64)
        count = np.array([n for _, _, n, _ in segments], dtype=np.int64)
        nblk = -(-count // BLOCK)
        seg = np.repeat(np.arange(len(segments)), nblk)
        first = np.cumsum(nblk) - nblk
        within = (np.arange(int(nblk.sum())) - first[seg]) * BLOCK
        table = np.stack([src0[seg] + within, dst0[seg] + within, np.minimum(count[seg] - within, BLOCK)])
        small = torch.from_numpy(np.concatenate([table.reshape(-1), src0, dst0])).to(device)
        k = table.shape[1]
        self.blk_src, self.blk_dst, self.blk_len = small[:k], small[k : 2 * k], small[2 * k : 3 * k]
        self.seg_src, self.seg_dst = small[3 * k : 3 * k + len(segments)], small[3 * k + len(segments) :]
        self.n_blocks = k


def mask_(addr: ChunkAddressing, snap: torch.Tensor, mask: torch.Tensor) -> None:
    """mask[i] = 1 where the bf16 image of chunk element i differs from snap[i] (int8)."""
    assert triton is not None
    if addr.n_blocks:
        nan = canonical_nan(snap.device, addr.dtype)
        _mask_kernel[(addr.n_blocks,)](
            addr.base, snap, mask, addr.blk_src, addr.blk_dst, addr.blk_len, nan, BLOCK=BLOCK
        )


def gather_image(addr: ChunkAddressing, idx: torch.Tensor) -> torch.Tensor:
    """The bf16 image bits (int16) of chunk elements `idx`."""
    assert triton is not None
    out = torch.empty(idx.numel(), dtype=torch.int16, device=idx.device)
    if idx.numel():
        seg = torch.searchsorted(addr.seg_dst, idx, right=True).sub_(1)
        src = addr.seg_src[seg].add_(idx).sub_(addr.seg_dst[seg])
        nan = canonical_nan(idx.device, addr.dtype)
        _gather_kernel[(triton.cdiv(idx.numel(), BLOCK),)](addr.base, src, out, idx.numel(), nan, BLOCK=BLOCK)
    return out


__all__ = ["BLOCK", "ChunkAddressing", "available", "canonical_nan", "gather_image", "mask_"]
