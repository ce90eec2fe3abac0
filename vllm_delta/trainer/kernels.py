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

The whole-model path (`DetectTable`, `bitmask_`, `compact_`; what `FlatSnapshot.changes` runs when
the snapshot lives on the parameters' device) needs no per-chunk host wait and no int8 mask:

1. `bitmask_`: per block of DETECT_BLOCK elements of one tensor, convert and compare (6 B/elem read),
   write one bit per element (32 per int32 word: 1/8 B/elem) and the block's count of changes.
2. an inclusive cumsum of the block counts on the device, and one host wait for the total (to size
   the outputs).
3. `compact_`: per block, its words' set bits in order (a loop over the set bits of all words at
   once: as many rounds as the fullest word has bits, ~3 at 1%) give each changed element's rank;
   its local index is written to the positions buffer, then (after a barrier, `FUSED`; or in a second
   launch) each changed element is finished from that list: global position, tensor index, new bits
   (the source converted again: only the changed elements' sectors are read), old bits, the snapshot
   updated in place, and the block's checksum partial Σ w(p)(new - old) (int64, wrapping).
   Per-tensor counts and sums are differences of cumsums over the block counts and partials.

Blocks are in tensor order and ranks in element order, so positions come out sorted, as the torch
path gives them. When every tensor starts at a 16-element multiple in the source address space and
in the snapshot (the base tensor 16-byte aligned), full blocks load 16 bytes per access (`ALIGNED`).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..checksums import WEIGHT_INT64

try:  # Triton is optional: CPU installs work without it (the torch path).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

BLOCK = 2048  # elements per program (mask_, gather_image)
DETECT_BLOCK = 8192  # elements per block of the whole-model path (a multiple of 32)
DETECT_WARPS = 8  # warps per program of `bitmask_`
COMPACT_WARPS = 4  # warps per program of `compact_`
FINISH_LANES = 128  # changed elements finished per round of `compact_`
ALIGN = 16  # elements: where every block starts when the table is `aligned`
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

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def _popcount(w):
        """Set bits of each uint32 (SWAR)."""
        x = w - ((w >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24).to(tl.int32)

    @triton.jit
    def _bitmask_kernel(
        src_ptr,
        snap_ptr,
        words_ptr,
        count_ptr,
        blk_src_ptr,
        blk_dst_ptr,
        blk_len_ptr,
        NAN,
        BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        """Block `pid`: bit j of word k = whether element 32k + j's image differs from the snapshot."""
        pid = tl.program_id(0)
        s = tl.load(blk_src_ptr + pid)
        d = tl.load(blk_dst_ptr + pid)
        n = tl.load(blk_len_ptr + pid)
        if ALIGNED:  # checked on the host for every block (DetectTable.aligned): 16-byte loads
            s = tl.multiple_of(s, 16)
            d = tl.multiple_of(d, 16)
        col = tl.arange(0, 32)[None, :]
        i = tl.arange(0, BLOCK // 32)[:, None] * 32 + col
        if n == BLOCK:  # full blocks: no mask, so that the loads can be vectorized
            x = tl.load(src_ptr + (s + i))
            old = tl.load(snap_ptr + (d + i))
        else:
            m = i < n
            x = tl.load(src_ptr + (s + i), mask=m, other=0)
            old = tl.load(snap_ptr + (d + i), mask=m, other=0)  # masked lanes: 0 vs 0, no change
        flag = _convert(x, NAN) != old
        bits = flag.to(tl.uint32) << col.to(tl.uint32)
        words = tl.reduce(bits, 1, _or)
        tl.store(words_ptr + pid * (BLOCK // 32) + tl.arange(0, BLOCK // 32), words.to(tl.int32, bitcast=True))
        tl.store(count_ptr + pid, tl.sum(flag.to(tl.int32), axis=None))

    @triton.jit
    def _compact_kernel(
        src_ptr,
        snap_ptr,
        words_ptr,
        count_ptr,
        incl_ptr,
        blk_src_ptr,
        blk_dst_ptr,
        blk_pos_ptr,
        blk_seg_ptr,
        pos_ptr,
        seg_ptr,
        new_ptr,
        old_ptr,
        bsum_ptr,
        NAN,
        WEIGHT,
        BLOCK: tl.constexpr,
        LANES: tl.constexpr,
        COMPACT: tl.constexpr,
        FINISH: tl.constexpr,
    ):
        """Block `pid`'s changed elements, written at [incl - count, incl) of the outputs.

        COMPACT: the local index of each set bit, in order, into the positions buffer. FINISH: each
        listed element's position, tensor, new and old bits, the snapshot update and the block's
        checksum partial. Both (one launch) need the barrier between them."""
        pid = tl.program_id(0)
        cnt = tl.load(count_ptr + pid)
        base = tl.load(incl_ptr + pid) - cnt
        if COMPACT:
            wi = tl.arange(0, BLOCK // 32)
            w = tl.load(words_ptr + pid * (BLOCK // 32) + wi).to(tl.uint32, bitcast=True)
            pc = _popcount(w)
            at = base + (tl.cumsum(pc, 0) - pc)  # output index of each word's first set bit
            rounds = tl.max(pc, 0)
            for _ in range(0, rounds):  # round r writes every word's r-th set bit
                low = w & (~w + 1)  # the lowest set bit (0 for an empty word)
                j = (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # its index (exact)
                tl.store(pos_ptr + at, (wi * 32 + j).to(tl.int64), mask=w != 0)
                at += 1
                w = w & (w - 1)
        if COMPACT and FINISH:
            tl.debug_barrier()  # the list was written by other threads of this program
        if FINISH:
            s = tl.load(blk_src_ptr + pid)
            d = tl.load(blk_dst_ptr + pid)
            p0 = tl.load(blk_pos_ptr + pid)
            seg = tl.load(blk_seg_ptr + pid)
            acc = tl.zeros([LANES], dtype=tl.int64)
            for k0 in range(0, cnt, LANES):
                k = base + k0 + tl.arange(0, LANES)
                m = k < base + cnt
                loc = tl.load(pos_ptr + k, mask=m, other=0, volatile=True)
                new = _convert(tl.load(src_ptr + (s + loc), mask=m, other=0), NAN)
                old = tl.load(snap_ptr + (d + loc), mask=m, other=0)
                tl.store(snap_ptr + (d + loc), new, mask=m)
                p = p0 + loc
                tl.store(pos_ptr + k, p, mask=m)
                tl.store(seg_ptr + k, tl.zeros([LANES], dtype=tl.int64) + seg, mask=m)
                tl.store(new_ptr + k, new, mask=m)
                tl.store(old_ptr + k, old, mask=m)
                delta = (new.to(tl.int64) & 0xFFFF) - (old.to(tl.int64) & 0xFFFF)
                acc += tl.where(m, (p + 1) * WEIGHT * delta, 0)
            tl.store(bsum_ptr + pid, tl.sum(acc, axis=0))


def _resolve(device: torch.device | str) -> torch.device:
    """`cuda` names the current CUDA device: tensors say `cuda:0`, and torch.device("cuda") != that."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ChunkAddressing:
    """Where a chunk's elements come from: its segments' sources as element offsets from one base
    tensor, and a block table (source offset, chunk offset, length per BLOCK elements) on the device.

    `segments`: (source flat tensor, first source element, count, chunk offset) in chunk order. `ok`
    is False when the kernels can't address them (mixed or unsupported dtypes, misaligned views)."""

    def __init__(self, segments: list[tuple[torch.Tensor, int, int, int]], device: torch.device):
        device = _resolve(device)
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


class DetectTable:
    """The whole-model block table: where each block of `block` elements of one tensor comes from
    (source offset from the base tensor), where its snapshot is (flat offset), the global position of
    its first element and its tensor's index; and each tensor's first block.

    `segments`: per owned tensor, (source flat tensor, flat snapshot offset, count, global position of
    the first element). `ok` is False when the kernels can't address them (mixed or unsupported dtypes,
    misaligned views, another device). `aligned`: every block starts at an ALIGN multiple in the
    source address space and in the snapshot, and the base is 16-byte aligned (full blocks then load
    16 bytes per access)."""

    def __init__(
        self, segments: list[tuple[torch.Tensor, int, int, int]], device: torch.device, block: int | None = None
    ):
        device = _resolve(device)
        block = block or DETECT_BLOCK
        if block < 32 or block & (block - 1):
            raise ValueError(f"the detection block is a power of two >= 32 (not {block})")
        self.block = block
        srcs = [s[0] for s in segments if s[2]]  # empty tensors are not read (any address, any dtype)
        self.dtype = srcs[0].dtype if srcs else torch.float32
        width = torch.empty((), dtype=self.dtype).element_size()
        low = min((t.data_ptr() for t in srcs), default=0)
        self.base = next((t for t in srcs if t.data_ptr() == low), torch.empty(0, device=device))
        deltas = [s[0].data_ptr() - low if s[2] else 0 for s in segments]
        self.ok = (
            self.dtype in SOURCES
            and all(t.dtype == self.dtype and t.device == device and (t.numel() < 2 or t.stride(0) == 1) for t in srcs)
            and not any(d % width for d in deltas)
        )
        src0 = np.array([d // width for d in deltas], dtype=np.int64)
        dst0 = np.array([s[1] for s in segments], dtype=np.int64)
        count = np.array([s[2] for s in segments], dtype=np.int64)
        pos0 = np.array([s[3] for s in segments], dtype=np.int64)
        self.aligned = bool(
            self.ok
            and self.base.data_ptr() % 16 == 0
            and not (src0[count > 0] % ALIGN).any()
            and not (dst0[count > 0] % ALIGN).any()
        )
        nblk = -(-count // block)
        seg = np.repeat(np.arange(len(segments), dtype=np.int64), nblk)
        first = np.concatenate([[0], np.cumsum(nblk)]).astype(np.int64)
        within = (np.arange(int(first[-1]), dtype=np.int64) - first[seg]) * block
        rows = [src0[seg] + within, dst0[seg] + within, pos0[seg] + within, seg, np.minimum(count[seg] - within, block)]
        k = len(within)
        small = torch.from_numpy(np.concatenate([*rows, first])).to(device)
        self.blk_src, self.blk_dst, self.blk_pos, self.blk_seg, self.blk_len = (
            small[i * k : (i + 1) * k] for i in range(5)
        )
        self.first = small[5 * k :]  # per tensor, its first block; then the number of blocks
        self.n_blocks = k
        self.words_per_block = block // 32

    def passes(self, max_elems: int) -> list[tuple[int, int]]:
        """Block ranges [b0, b1) of at most `max_elems` elements each (at least one block)."""
        step = max(1, max_elems // self.block)
        return [(b0, min(b0 + step, self.n_blocks)) for b0 in range(0, self.n_blocks, step)]


def bitmask_(
    table: DetectTable,
    b0: int,
    b1: int,
    snap: torch.Tensor,
    words: torch.Tensor,
    counts: torch.Tensor,
    *,
    num_warps: int = DETECT_WARPS,
) -> None:
    """Blocks [b0, b1): words[(b - b0) * block/32 + k] bit j = whether element 32k + j of block b
    differs from the snapshot (int32 words); counts[b - b0] = its changes (int32)."""
    assert triton is not None
    if b1 > b0:
        nan = canonical_nan(snap.device, table.dtype)
        _bitmask_kernel[(b1 - b0,)](
            table.base,
            snap,
            words,
            counts,
            table.blk_src[b0:b1],
            table.blk_dst[b0:b1],
            table.blk_len[b0:b1],
            nan,
            BLOCK=table.block,
            ALIGNED=table.aligned,
            num_warps=num_warps,
        )


def compact_(
    table: DetectTable,
    b0: int,
    b1: int,
    snap: torch.Tensor,
    words: torch.Tensor,
    counts: torch.Tensor,
    incl: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    bsums: torch.Tensor,
    *,
    fused: bool = True,
    num_warps: int = COMPACT_WARPS,
    lanes: int = FINISH_LANES,
) -> None:
    """Blocks [b0, b1) after `bitmask_`: their changed elements at [incl - count, incl) of `out`
    (positions, tensor index: int64; new, old bits: int16), the snapshot updated to the new bits,
    and bsums[b - b0] = Σ w(p)(new - old) over block b (int64, wrapping). `fused`: one launch (a
    barrier orders the two halves); else the compaction and the finishing are two launches."""
    assert triton is not None
    if lanes % (32 * num_warps):  # one thread per listed element: each reads its entry, then overwrites it
        raise ValueError(f"lanes ({lanes}) must be a multiple of the threads of a program ({32 * num_warps})")
    if b1 <= b0:
        return
    positions, seg, new, old = out
    nan = canonical_nan(snap.device, table.dtype)
    args = (
        table.base,
        snap,
        words,
        counts,
        incl,
        table.blk_src[b0:b1],
        table.blk_dst[b0:b1],
        table.blk_pos[b0:b1],
        table.blk_seg[b0:b1],
        positions,
        seg,
        new,
        old,
        bsums,
        nan,
        WEIGHT_INT64,
    )
    steps = [(True, True)] if fused else [(True, False), (False, True)]
    for compact, finish in steps:
        _compact_kernel[(b1 - b0,)](
            *args, BLOCK=table.block, LANES=lanes, COMPACT=compact, FINISH=finish, num_warps=num_warps
        )


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


__all__ = [
    "BLOCK",
    "DETECT_BLOCK",
    "ChunkAddressing",
    "DetectTable",
    "available",
    "bitmask_",
    "canonical_nan",
    "compact_",
    "gather_image",
    "mask_",
]
