"""The chunked codec's encoder halves: changes -> planes on the device (`encode_planes`: the fused
Triton kernel, or the torch reference), planes -> zstd frames and the index on the host
(`compress_cpu`; the GPU's is `gpu.compress_chunks`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
import torch
import zstandard

from ...bits import int_view, wrap_diff
from ...checksums import chunk_hash_np
from ..base import Batch, HostCopy
from . import kernels
from .planes import (
    CHUNK_ELEMS,
    FRAME_ALIGN,
    GAP_ESCAPE,
    INDEX_WIDTH,
    KERNEL_FAILED,
    MAG_BIAS,
    MAG_ESCAPE,
    MAX_CHUNK_ELEMS,
    N_PLANES,
    PLANES_BACKENDS,
    SLICE_ELEMS,
    ZSTD_LEVEL,
    PlaneLayout,
    Planes,
    PlanesBackend,
    chunk_counts,
    chunk_ranks,
    default_backend,
    pack_bits,
)

log = logging.getLogger(__name__)


def encode_planes(
    batch: Batch,
    chunk_elems: int = CHUNK_ELEMS,
    slice_elems: int = SLICE_ELEMS,
    context: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: PlanesBackend | None = None,
) -> Planes:
    """Device work of the encoder: the planes of a batch's changes, in the batch's element order.

    `context`: (position, tensor index) of the element before the batch's first (1-element
    tensors), when the batch continues an earlier one (`StreamEncoder`). `backend`: "triton" (the
    fused kernel of kernels.py, one launch and one host wait for the whole batch), "torch" (slices
    of `slice_elems` elements, ~70 small kernels and one host wait each: the reference), or None:
    Triton on CUDA where it runs (a kernel failure is logged once and the torch path used)."""
    if chunk_elems % 128 or not 0 < chunk_elems <= MAX_CHUNK_ELEMS:
        raise ValueError(f"chunk_elems must be a multiple of 128 in (0, {MAX_CHUNK_ELEMS}]")
    slice_elems = max(chunk_elems, slice_elems // chunk_elems * chunk_elems)
    dev = batch.positions.device
    chosen = backend or default_backend(dev)
    planes: Planes | None = None
    if chosen == "triton":
        if not kernels.available(dev):
            raise ValueError(f"the Triton encoder does not run on {dev}")
        try:
            planes = _encode_triton(batch, chunk_elems, slice_elems, context)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: the torch path
            if backend is not None:
                raise
            KERNEL_FAILED.add(str(dev))
            log.warning("vllm-delta: the Triton encoder failed on %s, encoding with torch: %s", dev, exc)
    elif chosen != "torch":
        raise ValueError(f"planes backend must be one of {PLANES_BACKENDS}, not {chosen!r}")
    if planes is None:
        planes = _encode_torch(batch, chunk_elems, slice_elems, context)
    # each chunk's first position (the payload's `first`): what lets a reader start a tensor's gap
    # chain at any chunk, so a rank skips the chunks that hold none of its rows
    planes.first = batch.positions[::chunk_elems].to(torch.int64).clone()
    return planes


def _slice_terms(
    batch: Batch, a: int, b: int, starts_t: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gaps, differences) of the batch's elements [a, b), int64: the gap from the previous element
    of the same tensor (or from the tensor's start), and new - old mod 2^bits read signed."""
    pos_all, seg_all = batch.positions, batch.seg
    pos, seg = pos_all[a:b], seg_all[a:b]
    prev = torch.empty_like(pos)
    prev_seg = torch.empty_like(seg)
    prev[1:] = pos[:-1]
    prev_seg[1:] = seg[:-1]
    if a:
        prev[:1] = pos_all[a - 1 : a]
        prev_seg[:1] = seg_all[a - 1 : a]
    elif context is not None:
        prev[:1] = context[0]
        prev_seg[:1] = context[1]
    else:
        prev[:1] = -1
        prev_seg[:1] = -1  # no element before: the first starts its tensor's chain
    gaps = pos - torch.where(seg != prev_seg, starts_t[seg] - 1, prev) - 1
    del prev, prev_seg
    width = int_view(batch.new).element_size()
    return gaps, wrap_diff(int_view(batch.new[a:b]), int_view(batch.old[a:b]), width)


def _encode_triton(
    batch: Batch, chunk_elems: int, slice_elems: int, context: tuple[torch.Tensor, torch.Tensor] | None
) -> Planes:
    """`encode_planes` by the fused kernel: the planes and counts, then (only when there are any) the
    escapes' values, in a second launch."""
    pos, dev, n = batch.positions, batch.positions.device, batch.positions.numel()
    layout = PlaneLayout(n, chunk_elems)
    buf = torch.empty(layout.size, dtype=torch.uint8, device=dev)
    starts_t = torch.from_numpy(np.asarray(batch.starts, dtype=np.int64)).to(dev, non_blocking=dev.type == "cuda")
    if context is not None:
        ctx = torch.cat([context[0].reshape(1), context[1].reshape(1)]).to(torch.int64)
    else:
        ctx = torch.full((2,), -1, dtype=torch.int64, device=dev)
    counts, gap_esc, mag_esc = kernels.encode_chunks(
        pos,
        batch.seg,
        int_view(batch.new),
        int_view(batch.old),
        starts_t,
        buf,
        ctx,
        chunk_elems=chunk_elems,
        plane_starts=layout.starts,
        width=int_view(batch.new).element_size(),
        gap_escape=GAP_ESCAPE,
        mag_bias=MAG_BIAS,
        mag_escape=MAG_ESCAPE,
    )
    return Planes.of(layout, buf, counts, gap_esc, mag_esc)


def _encode_torch(
    batch: Batch, chunk_elems: int, slice_elems: int, context: tuple[torch.Tensor, torch.Tensor] | None
) -> Planes:
    """`encode_planes` in slices of `slice_elems` elements (a multiple of `chunk_elems`), so its
    temporaries stay at ~40 B x slice_elems whatever the number of changes; one host
    synchronization per slice (the escapes, which are rare)."""
    pos_all = batch.positions
    dev, n = pos_all.device, pos_all.numel()
    layout = PlaneLayout(n, chunk_elems)
    lo0, hi0, sign0, big0, mag0 = layout.starts
    buf = torch.empty(layout.size, dtype=torch.uint8, device=dev)
    mag = buf[mag0:].view(layout.chunks, chunk_elems)
    counts = torch.zeros(3, layout.chunks, dtype=torch.int64, device=dev)  # big, gap escapes, mag escapes
    gap_esc: list[torch.Tensor] = []
    mag_esc: list[torch.Tensor] = []
    starts_t = torch.from_numpy(np.asarray(batch.starts, dtype=np.int64)).to(dev, non_blocking=True)
    for a in range(0, n, slice_elems):
        b = min(n, a + slice_elems)
        k0 = a // chunk_elems
        gaps, d = _slice_terms(batch, a, b, starts_t, context)
        neg = d < 0
        m = d.abs_()
        g_esc, m_esc = gaps >= GAP_ESCAPE, m >= MAG_BIAS + MAG_ESCAPE
        at = (g_esc | m_esc).nonzero().reshape(-1)  # the slice's one synchronization: escapes are rare
        if at.numel():
            gap_esc.append(gaps[at][g_esc[at]])
            mag_esc.append(m[at][m_esc[at]])
        gaps.clamp_(max=GAP_ESCAPE)
        buf[lo0 + a : lo0 + b] = gaps.bitwise_and(0xFF).to(torch.uint8)
        buf[hi0 + a : hi0 + b] = gaps.bitwise_right_shift(8).to(torch.uint8)
        del gaps
        big = m > 1
        buf[sign0 + a // 8 : sign0 + -(-b // 8)] = pack_bits(neg)
        buf[big0 + a // 8 : big0 + -(-b // 8)] = pack_bits(big)
        codes = m.sub_(MAG_BIAS).clamp_(0, MAG_ESCAPE).to(torch.uint8)
        # mag codes strided by chunk: the r-th big element of chunk k at mag[k, r]; every other element
        # writes its (unused) code to the chunk's last column, which no big element occupies unless
        # all of the chunk's elements are big (no sync, unlike a masked copy)
        n_big, rank = chunk_ranks(big, chunk_elems)
        kk = n_big.numel()
        counts[0, k0 : k0 + kk] = n_big
        col = torch.where(big, rank, chunk_elems - 1)
        col += torch.arange(a, b, device=dev, dtype=torch.int64).div_(chunk_elems, rounding_mode="floor") * chunk_elems
        mag.view(-1)[col] = codes
        del col, rank
        counts[1, k0 : k0 + kk] = chunk_counts(g_esc, chunk_elems)
        counts[2, k0 : k0 + kk] = chunk_counts(m_esc, chunk_elems)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    gaps, mags = (torch.cat(esc) if esc else empty for esc in (gap_esc, mag_esc))
    return Planes.of(layout, buf, counts, gaps, mags)


def planes_to_host(planes: Planes, host: HostCopy) -> Planes:
    """A device Planes' copy in (pinned) host memory, through `host` (waited for by its event)."""
    return Planes(
        layout=planes.layout,
        buf=host.add(planes.buf),
        n_big=host.add(planes.n_big),
        n_gap_esc=host.add(planes.n_gap_esc),
        n_mag_esc=host.add(planes.n_mag_esc),
        gap_esc=host.add(planes.gap_esc),
        mag_esc=host.add(planes.mag_esc),
        first=host.add(planes.first) if planes.first is not None else None,
    )


# -- frames on the host (zstandard) ---------------------------------------------------------------

_TLS = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_TLS, "cctx", None)
    if cache is None:
        cache = _TLS.cctx = {}
    if level not in cache:
        # Standard frames with their content size and no zstd checksum (the chunk hash covers them):
        # what nvCOMP's zstd writes and reads too.
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return cache[level]


def index_row(sizes: Sequence[int], counts: Sequence[int], chunk_bytes: np.ndarray) -> list[int]:
    """One row of the index: the frames' compressed sizes, (big, gap escapes, mag escapes), hash."""
    return [*map(int, sizes), *map(int, counts), chunk_hash_np(chunk_bytes)]


def compress_cpu(
    planes: Planes, level: int = ZSTD_LEVEL, pool: Executor | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Host planes -> (blob uint8, index int64 [chunks, INDEX_WIDTH]): every frame with zstandard,
    chunks in parallel on `pool` (zstd and numpy release the GIL)."""
    buf = planes.buf.numpy()
    counts = np.stack([planes.n_big.numpy(), planes.n_gap_esc.numpy(), planes.n_mag_esc.numpy()], axis=1)
    offsets, sizes = planes.layout.frames(counts[:, 0])

    def chunk(k: int) -> tuple[bytes, list[int]]:
        cctx = _cctx(level)
        parts, out = [], []
        for f in range(N_PLANES):
            size = int(sizes[k, f])
            if not size:
                out.append(0)
                continue
            frame = cctx.compress(buf[offsets[k, f] : offsets[k, f] + size].data)
            parts.append(frame + bytes(-len(frame) % FRAME_ALIGN))
            out.append(len(frame))
        data = b"".join(parts)
        return data, index_row(out, counts[k], np.frombuffer(data, dtype=np.uint8))

    ks = range(planes.layout.chunks)
    done = list(pool.map(chunk, ks)) if pool is not None else [chunk(k) for k in ks]
    blob = np.frombuffer(b"".join(d for d, _ in done), dtype=np.uint8)
    index = np.array([row for _, row in done], dtype=np.int64).reshape(-1, INDEX_WIDTH)
    return blob, index
