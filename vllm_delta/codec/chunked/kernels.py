"""Triton kernels of the chunked codec: the device halves of encode and decode, fused.

The torch code in encode.py and decode.py is the reference (and the path on machines without Triton); these
kernels compute the same bytes, bit for bit (tests/codec/test_codec_kernels.py runs both under
TRITON_INTERPRET=1 on the CPU, and on the GPU):

* `encode_chunks`: one program per chunk of E elements turns a batch's changes (positions, tensor
  index, new and old bits) into the chunk's planes: gap low/high bytes, sign and big bits, the big
  elements' magnitude codes at their rank in the chunk, and the chunk's counts (big elements, gap
  and value escapes). The torch encoder runs ~70 small kernels and a host wait per 4M-element
  slice; this is one launch per pass of detection. The escapes' values (rare) are gathered
  afterwards, by torch, from the chunks that have any (`encode.encode_planes`).
* `decode_chunks`: one program per chunk turns planes back into gaps (escapes patched) and
  differences, and flags a chunk whose counts disagree with the index; the positions (a prefix sum
  over the run) and the range checks stay in torch (`decode._decode`).
* `chunk_hashes`: the positional hash of each chunk's bytes (checksums.chunk_hashes), one program
  per chunk, no index tensors.
* `compact_frames`: frames compressed by nvCOMP into fixed-size slots -> one blob, each frame
  padded with zeros to FRAME_ALIGN (what a boolean-mask gather did with ~16 B of indices per byte).

Triton is optional: `available(device)` says whether the kernels can run (CUDA with Triton; the CPU
only under TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ...checksums import WEIGHT_INT64

try:  # Triton is optional: CPU installs work without it (the torch path).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

ENCODE_ROWS = 128  # rows of 8 elements per step of a program (1024 elements)
ENCODE_WARPS = 4
HASH_BLOCK = 1024  # words per step of `chunk_hashes`
COPY_BLOCK = 4096  # bytes per step of `compact_frames`


def available(device: torch.device) -> bool:
    """Whether the kernels run on `device`: CUDA with Triton, or the CPU under TRITON_INTERPRET=1."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    # Sizes and offsets are not specialized on (divisibility, == 1): every version has other values, and a
    # specialization is a compile (~1 s) inside an update.
    @triton.jit(do_not_specialize=["n", "chunks", "lo0", "hi0", "sign0", "big0", "mag0"])
    def _encode_kernel(  # type: ignore[no-untyped-def]  # Triton reads the annotations itself
        pos_ptr,
        seg_ptr,
        new_ptr,
        old_ptr,
        starts_ptr,
        buf_ptr,
        counts_ptr,
        ctx_ptr,
        gesc_ptr,
        mesc_ptr,
        n,
        chunks,
        lo0,
        hi0,
        sign0,
        big0,
        mag0,
        E: tl.constexpr,
        ROWS: tl.constexpr,
        MASK: tl.constexpr,
        HALF: tl.constexpr,
        FULL: tl.constexpr,
        GAP_ESCAPE: tl.constexpr,
        MAG_BIAS: tl.constexpr,
        MAG_ESCAPE: tl.constexpr,
        ESCAPES: tl.constexpr,
    ):
        """ESCAPES=False: the planes and each chunk's counts. ESCAPES=True (a second launch, once the
        counts' prefix sums are in `counts_ptr` rows 3 and 4): only the escapes' values, each at its
        chunk's offset plus its rank in the chunk."""
        k = tl.program_id(0).to(tl.int64)
        c0 = k * E
        r = tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, 8)[None, :]
        weight = (tl.zeros([1, 8], dtype=tl.int32) + 1) << c
        ctx_pos = tl.load(ctx_ptr)  # the element before the batch: position, tensor index (-1: none)
        ctx_seg = tl.load(ctx_ptr + 1)
        n_big = tl.sum(tl.zeros([ROWS], dtype=tl.int32), axis=0)
        n_gap = n_big
        n_mag = n_big
        g_at = 0
        m_at = 0
        if ESCAPES:
            g_at = tl.load(counts_ptr + 3 * chunks + k)
            m_at = tl.load(counts_ptr + 4 * chunks + k)
        for b0 in range(0, E, ROWS * 8):
            i = c0 + b0 + r * 8 + c  # [ROWS, 8] element indices
            m = i < n
            pos = tl.load(pos_ptr + i, mask=m, other=0)
            seg = tl.load(seg_ptr + i, mask=m, other=0)
            has_prev = m & (i > 0)
            prev_pos = tl.load(pos_ptr + i - 1, mask=has_prev, other=0)
            prev_seg = tl.load(seg_ptr + i - 1, mask=has_prev, other=0)
            prev_pos = tl.where(i == 0, ctx_pos, prev_pos)
            prev_seg = tl.where(i == 0, ctx_seg, prev_seg)
            start = tl.load(starts_ptr + seg, mask=m, other=0)
            gap = pos - tl.where(seg != prev_seg, start - 1, prev_pos) - 1
            d = tl.load(new_ptr + i, mask=m, other=0).to(tl.int64) - tl.load(old_ptr + i, mask=m, other=0).to(tl.int64)
            d = d & MASK
            d = tl.where(d >= HALF, d - FULL, d)
            mag = tl.abs(d)
            g_esc = m & (gap >= GAP_ESCAPE)
            m_esc = m & (mag >= MAG_BIAS + MAG_ESCAPE)
            if ESCAPES:
                gi = g_esc.to(tl.int32)
                row = tl.sum(gi, axis=1)
                at = g_at + n_gap + (tl.cumsum(row, axis=0) - row)[:, None] + (tl.cumsum(gi, axis=1) - gi)
                tl.store(gesc_ptr + at, gap, mask=g_esc)
                n_gap += tl.sum(row, axis=0)
                mi = m_esc.to(tl.int32)
                row = tl.sum(mi, axis=1)
                at = m_at + n_mag + (tl.cumsum(row, axis=0) - row)[:, None] + (tl.cumsum(mi, axis=1) - mi)
                tl.store(mesc_ptr + at, mag, mask=m_esc)
                n_mag += tl.sum(row, axis=0)
            else:
                big = m & (mag > 1)
                n_gap += tl.sum(g_esc.to(tl.int32), axis=None)
                n_mag += tl.sum(m_esc.to(tl.int32), axis=None)
                g = tl.minimum(gap, GAP_ESCAPE)
                tl.store(buf_ptr + lo0 + i, (g & 0xFF).to(tl.uint8), mask=m)
                tl.store(buf_ptr + hi0 + i, ((g >> 8) & 0xFF).to(tl.uint8), mask=m)
                byte = (c0 + b0) // 8 + tl.arange(0, ROWS)
                on = byte * 8 < n
                sign = tl.sum(tl.where(m & (d < 0), weight, 0), axis=1)
                tl.store(buf_ptr + sign0 + byte, sign.to(tl.uint8), mask=on)
                bigs = big.to(tl.int32)
                tl.store(buf_ptr + big0 + byte, tl.sum(bigs * weight, axis=1).to(tl.uint8), mask=on)
                row = tl.sum(bigs, axis=1)
                rank = n_big + (tl.cumsum(row, axis=0) - row)[:, None] + (tl.cumsum(bigs, axis=1) - bigs)
                code = tl.minimum(tl.maximum(mag - MAG_BIAS, 0), MAG_ESCAPE).to(tl.uint8)
                tl.store(buf_ptr + mag0 + c0 + rank, code, mask=big)
                n_big += tl.sum(row, axis=0)
        if not ESCAPES:
            tl.store(counts_ptr + k, n_big.to(tl.int64))
            tl.store(counts_ptr + chunks + k, n_gap.to(tl.int64))
            tl.store(counts_ptr + 2 * chunks + k, n_mag.to(tl.int64))

    @triton.jit
    def _hash_kernel(  # type: ignore[no-untyped-def]
        words_ptr, start_ptr, count_ptr, out_ptr, WEIGHT: tl.constexpr, BLOCK: tl.constexpr
    ):
        k = tl.program_id(0)
        start = tl.load(start_ptr + k)
        cnt = tl.load(count_ptr + k)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for j0 in range(0, cnt, BLOCK):
            j = j0 + tl.arange(0, BLOCK).to(tl.int64)
            m = j < cnt
            w = tl.load(words_ptr + start + j, mask=m, other=0)
            acc += tl.where(m, (j + 1) * WEIGHT * w, 0)
        tl.store(out_ptr + k, tl.sum(acc, axis=0))

    @triton.jit(do_not_specialize=["cap"])
    def _compact_kernel(  # type: ignore[no-untyped-def]
        src_ptr, got_ptr, dst_ptr, pad_ptr, out_ptr, cap, BLOCK: tl.constexpr
    ):
        f = tl.program_id(0).to(tl.int64)
        got = tl.load(got_ptr + f)
        dst = tl.load(dst_ptr + f)
        pad = tl.load(pad_ptr + f)
        for b0 in range(0, pad, BLOCK):
            i = b0 + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(src_ptr + f * cap + i, mask=i < got, other=0)
            tl.store(out_ptr + dst + i, x, mask=i < pad)

    @triton.jit(do_not_specialize=["n", "chunks", "n_gesc", "n_mesc"])
    def _decode_kernel(  # type: ignore[no-untyped-def]
        lo_ptr,
        hi_ptr,
        sign_ptr,
        big_ptr,
        mag_ptr,
        want_ptr,
        gesc_ptr,
        mesc_ptr,
        inc_ptr,
        diff_ptr,
        bad_ptr,
        n,
        chunks,
        n_gesc,
        n_mesc,
        E: tl.constexpr,
        ROWS: tl.constexpr,
        GAP_ESCAPE: tl.constexpr,
        MAG_BIAS: tl.constexpr,
        MAG_ESCAPE: tl.constexpr,
    ):
        k = tl.program_id(0).to(tl.int64)
        c0 = k * E
        r = tl.arange(0, ROWS)[:, None]
        c = tl.arange(0, 8)[None, :]
        g_at = tl.load(want_ptr + 3 * chunks + k)  # where the chunk's escapes start in the tables
        m_at = tl.load(want_ptr + 4 * chunks + k)
        n_big = tl.sum(tl.zeros([ROWS], dtype=tl.int32), axis=0)
        n_gap = n_big
        n_mag = n_big
        for b0 in range(0, E, ROWS * 8):
            i = c0 + b0 + r * 8 + c
            m = i < n
            gap = tl.load(lo_ptr + i, mask=m, other=0).to(tl.int64)
            gap = gap | (tl.load(hi_ptr + i, mask=m, other=0).to(tl.int64) << 8)
            g_esc = m & (gap == GAP_ESCAPE)
            gi = g_esc.to(tl.int32)
            row = tl.sum(gi, axis=1)
            g_idx = g_at + n_gap + (tl.cumsum(row, axis=0) - row)[:, None] + (tl.cumsum(gi, axis=1) - gi)
            g_val = tl.load(gesc_ptr + g_idx, mask=g_esc & (g_idx < n_gesc), other=GAP_ESCAPE)
            gap = tl.where(g_esc, g_val, gap)
            n_gap += tl.sum(row, axis=0)
            byte = (c0 + b0) // 8 + tl.arange(0, ROWS)
            on = byte * 8 < n
            neg = m & (((tl.load(sign_ptr + byte, mask=on, other=0).to(tl.int32)[:, None] >> c) & 1) != 0)
            big = m & (((tl.load(big_ptr + byte, mask=on, other=0).to(tl.int32)[:, None] >> c) & 1) != 0)
            bi = big.to(tl.int32)
            row = tl.sum(bi, axis=1)
            rank = n_big + (tl.cumsum(row, axis=0) - row)[:, None] + (tl.cumsum(bi, axis=1) - bi)
            code = tl.load(mag_ptr + c0 + rank, mask=big & (rank < E), other=0).to(tl.int64)
            n_big += tl.sum(row, axis=0)
            m_esc = big & (code == MAG_ESCAPE)
            mi = m_esc.to(tl.int32)
            row = tl.sum(mi, axis=1)
            m_idx = m_at + n_mag + (tl.cumsum(row, axis=0) - row)[:, None] + (tl.cumsum(mi, axis=1) - mi)
            mag = tl.where(big, code + MAG_BIAS, 1)
            ok = m_esc & (m_idx < n_mesc)
            mag = tl.where(ok, tl.load(mesc_ptr + m_idx, mask=ok, other=0), mag)
            n_mag += tl.sum(row, axis=0)
            tl.store(inc_ptr + i, gap + 1, mask=m)
            tl.store(diff_ptr + i, tl.where(neg, -mag, mag), mask=m)
        bad = (n_big.to(tl.int64) != tl.load(want_ptr + k)) | (n_gap.to(tl.int64) != tl.load(want_ptr + chunks + k))
        bad = bad | (n_mag.to(tl.int64) != tl.load(want_ptr + 2 * chunks + k))
        tl.store(bad_ptr + k, bad.to(tl.int32))


def encode_chunks(
    positions: torch.Tensor,
    seg: torch.Tensor,
    new: torch.Tensor,
    old: torch.Tensor,
    starts: torch.Tensor,
    buf: torch.Tensor,
    context: torch.Tensor,
    *,
    chunk_elems: int,
    plane_starts: tuple[int, int, int, int, int],
    width: int,
    gap_escape: int,
    mag_bias: int,
    mag_escape: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The planes of `positions.numel()` changes into `buf` (laid out from `plane_starts`: gap low,
    gap high, sign bits, big bits, magnitude codes strided by chunk); returns each chunk's counts
    (int64 [3, chunks]: big elements, gap escapes, value escapes) and the escapes' values (int64, in
    element order: gaps >= `gap_escape`, |differences| >= `mag_bias + mag_escape`). One host wait
    (the escapes' total), then a second launch only when there are escapes. `context`: int64 [2] on
    the device, (position, tensor index) of the element before the first ((-1, -1): none); `starts`:
    int64 per tensor index, where its gap chain starts."""
    n = positions.numel()
    dev = positions.device
    chunks = -(-n // chunk_elems)
    table = torch.zeros(5, chunks, dtype=torch.int64, device=dev)  # counts, then the escapes' offsets
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    if not n:
        return table[:3], empty, empty
    bits = 8 * width
    lo0, hi0, sign0, big0, mag0 = plane_starts
    args = (positions, seg, new, old, starts, buf, table, context)
    consts = dict(
        E=chunk_elems,
        ROWS=min(ENCODE_ROWS, chunk_elems // 8),
        MASK=(1 << bits) - 1,
        HALF=1 << (bits - 1),
        FULL=1 << bits,
        GAP_ESCAPE=gap_escape,
        MAG_BIAS=mag_bias,
        MAG_ESCAPE=mag_escape,
        num_warps=ENCODE_WARPS,
    )
    sizes = (n, chunks, lo0, hi0, sign0, big0, mag0)
    _encode_kernel[(chunks,)](*args, empty, empty, *sizes, ESCAPES=False, **consts)
    totals = table[1:3].sum(1).tolist()  # the one host wait
    if not any(totals):
        return table[:3], empty, empty
    table[3:5] = torch.cumsum(table[1:3], 1) - table[1:3]
    gap_esc = torch.empty(int(totals[0]), dtype=torch.int64, device=dev)
    mag_esc = torch.empty(int(totals[1]), dtype=torch.int64, device=dev)
    _encode_kernel[(chunks,)](
        *args, gap_esc if totals[0] else empty, mag_esc if totals[1] else empty, *sizes, ESCAPES=True, **consts
    )
    return table[:3], gap_esc, mag_esc


def decode_chunks(
    planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    counts: torch.Tensor,
    gap_esc: torch.Tensor,
    mag_esc: torch.Tensor,
    *,
    chunk_elems: int,
    gap_escape: int,
    mag_bias: int,
    mag_escape: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A run of whole chunks' planes (gap low, gap high, sign bits, big bits, magnitude codes
    [chunks, E]; one device) -> (gap + 1 per element, int64, escapes patched; the difference per
    element, int64; per chunk whether its big elements, gap escapes or value escapes disagree with
    `counts`, int32). `counts`: int64 [3, chunks] on the device, the index's (big, gap escapes,
    value escapes); the escape tables hold the run's escapes in order."""
    lo, hi, sign, big, mag = planes
    n, chunks = lo.numel(), counts.shape[1]
    dev = lo.device
    inc = torch.empty(n, dtype=torch.int64, device=dev)
    diffs = torch.empty(n, dtype=torch.int64, device=dev)
    bad = torch.zeros(chunks, dtype=torch.int32, device=dev)
    if not n:
        return inc, diffs, bad
    # the index's counts, then where each chunk's escapes start (exclusive prefix sums)
    want = torch.cat([counts.reshape(-1), torch.cumsum(counts[1:], 1).sub_(counts[1:]).reshape(-1)])
    empty = torch.zeros(1, dtype=torch.int64, device=dev)
    _decode_kernel[(chunks,)](
        lo,
        hi,
        sign,
        big,
        mag,
        want,
        gap_esc.clone() if gap_esc.numel() else empty,  # own (aligned) copies: a pointer's alignment is
        mag_esc.clone() if mag_esc.numel() else empty,  # specialized on, and slices of the tables vary
        inc,
        diffs,
        bad,
        n,
        chunks,
        gap_esc.numel(),
        mag_esc.numel(),
        E=chunk_elems,
        ROWS=min(ENCODE_ROWS, chunk_elems // 8),
        GAP_ESCAPE=gap_escape,
        MAG_BIAS=mag_bias,
        MAG_ESCAPE=mag_escape,
        num_warps=ENCODE_WARPS,
    )
    return inc, diffs, bad


def chunk_hashes(blob: torch.Tensor, chunk_bytes: np.ndarray) -> torch.Tensor:
    """`checksums.chunk_hashes` by one program per chunk: `blob` uint8 on the device (chunks laid
    end to end, `chunk_bytes` each, multiples of 8) -> int64 [chunks] on its device."""
    counts = np.asarray(chunk_bytes, dtype=np.int64) // 8
    out = torch.zeros(counts.size, dtype=torch.int64, device=blob.device)
    if not counts.size:
        return out
    table = torch.from_numpy(np.stack([np.cumsum(counts) - counts, counts]))
    table = table.to(blob.device, non_blocking=blob.device.type == "cuda")
    words = blob.view(torch.int64) if blob.numel() else torch.zeros(1, dtype=torch.int64, device=blob.device)
    _hash_kernel[(counts.size,)](words, table[0], table[1], out, WEIGHT=WEIGHT_INT64, BLOCK=HASH_BLOCK)
    return out


def compact_frames(
    slots: torch.Tensor, cap: int, sizes: np.ndarray, padded: np.ndarray, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Frames in fixed slots (frame i in slots[i * cap : i * cap + sizes[i]]) -> one buffer of the
    frames end to end, each taking padded[i] >= sizes[i] bytes, zeros after its own (uint8, on the
    slots' device; `out` if given, at least padded.sum() bytes)."""
    dev = slots.device
    ends = np.cumsum(padded)
    total = int(ends[-1]) if ends.size else 0
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=dev)
    if not total:
        return out
    table = torch.from_numpy(np.stack([np.asarray(sizes, dtype=np.int64), ends - padded, np.asarray(padded)]))
    table = table.to(torch.int64).to(dev, non_blocking=dev.type == "cuda")
    _compact_kernel[(int(np.asarray(sizes).size),)](slots, table[0], table[1], table[2], out, cap, BLOCK=COPY_BLOCK)
    return out


__all__ = ["available", "chunk_hashes", "compact_frames", "decode_chunks", "encode_chunks"]
