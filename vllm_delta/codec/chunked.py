"""Codec `chunked` (format 3, the default): one set of streams per file, cut into independent chunks.

Every changed element of a version file (all its tensors, one after the other: tensor t holds the
elements [at_t, at_t + nnz_t), `enc["at"]` in its header entry) is coded as

  gap_lo, gap_hi  u8   the gap (unchanged elements skipped since the previous changed element of the
                       tensor; the first counts from the piece's start, `enc["start"]`) as uint16
                       byte planes; 0xFFFF is a gap escape (the real gap in the int64 table `gap_esc`)
  sign            bit  the bit difference d = new - old (mod 2^bits, read signed) is negative
  big             bit  |d| > 1 (in RL updates ~89% of changed bf16 elements move by one ULP)
  mag             u8   big elements only: |d| - 2; 255 is a value escape (|d| in int64 `mag_esc`)

Chunk k covers elements [k·E, (k+1)·E) (E = `chunk_elems`, a multiple of 128). Each of its five
planes is one zstd frame (none when the plane is empty: only `mag` can be), each frame padded with
zeros to FRAME_ALIGN bytes; the chunks follow each other in the `blob`. Every frame is a standard
zstd frame: the CPU (zstandard) and the GPU (nvCOMP, `gpu.py`) write the same layout and read each
other's frames. The `index` table (int64, one row per chunk) gives the five frames' compressed sizes,
the chunk's big elements and escapes, and a positional hash of its padded bytes
(`checksums.chunk_hash`), checked before anything is decompressed: a corrupt chunk is a CodecError
naming its version, tensor and chunk, on either path. Measured on `benchmarks/payload.py`'s
AdamW deltas: 1.10 B per changed element, against 1.215 for `compact` (docs/PERFORMANCE.md).

Host and device work are split as for every codec: the device turns changes into planes
(`encode_planes`), the host (or nvCOMP) compresses them into frames (`compress_cpu`,
`gpu.compress_frames`); readers verify and decompress frames (`FileStreams`, on a thread pool or
nvCOMP) and turn planes back into positions and differences on the device (`decode_planes`), for
the whole file at once: no per-tensor work, which is what mixture-of-experts models need.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import torch
import zstandard

from ..bits import int_view, wrap_diff
from ..checksums import chunk_hash_np, chunk_hashes_np
from ..errors import CodecError, DeltaError, PositionError
from . import gpu, kernels
from .base import Batch, BatchSections, Changes, Ctx, HostCopy, MemorySink, PayloadSink, Sections, err, segment_ids

log = logging.getLogger(__name__)

CHUNK_ELEMS = 1 << 16  # elements per chunk: 64 KiB gap planes, the size nvCOMP parallelizes over
FRAME_ALIGN = 16  # every frame starts at a multiple of this in the blob (nvCOMP's input alignment)
ZSTD_LEVEL = 3
GAP_ESCAPE = 0xFFFF
MAG_ESCAPE = 255
MAG_BIAS = 2  # mag codes |d| - 2 (|d| >= 2 for big elements)
PLANES = ("gap_lo", "gap_hi", "sign", "big", "mag")
N_PLANES = len(PLANES)
COL_BIG, COL_GAP_ESC, COL_MAG_ESC, COL_HASH = N_PLANES, N_PLANES + 1, N_PLANES + 2, N_PLANES + 3
INDEX_WIDTH = N_PLANES + 4  # per chunk: 5 frame sizes, big elements, gap escapes, mag escapes, hash
SLICE_ELEMS = 1 << 22  # elements turned into planes at a time on the device (bounds temporaries)
MAX_CHUNK_ELEMS = 1 << 24
COPY_PIECE_BYTES = 8 << 20  # GPU path: compressed bytes copied to the host (and written) at a time
PAYLOAD_PARTS = ("blob", "index", "gap_esc", "mag_esc")  # file-level payload keys (`::<part>`)
PlanesBackend = Literal["torch", "triton"]  # planes on the device: the fused kernels, or the torch reference
PLANES_BACKENDS: tuple[PlanesBackend, ...] = get_args(PlanesBackend)
_KERNEL_FAILED: set[str] = set()  # devices where a Triton kernel failed (not tried again)


def align(n: int, to: int = FRAME_ALIGN) -> int:
    return -(-n // to) * to


# -- where the planes of a run of chunks sit in one flat buffer -----------------------------------


@dataclass(frozen=True)
class PlaneLayout:
    """The planes of `n` elements (chunks of `chunk_elems`) in one flat uint8 buffer, each region
    16-aligned: gap_lo [n], gap_hi [n], sign bits [ceil(n/8)], big bits [ceil(n/8)], and mag codes
    strided by chunk ([chunks, chunk_elems]: row k holds chunk k's codes first). Every frame of
    every chunk starts 16-aligned, so nvCOMP can read and write them in place."""

    n: int
    chunk_elems: int

    @property
    def chunks(self) -> int:
        return -(-self.n // self.chunk_elems)

    @property
    def bit_bytes(self) -> int:
        return -(-self.n // 8)

    @property
    def starts(self) -> tuple[int, int, int, int, int]:
        lo = 0
        hi = align(self.n)
        sign = 2 * align(self.n)
        big = sign + align(self.bit_bytes)
        mag = big + align(self.bit_bytes)
        return lo, hi, sign, big, mag

    @property
    def size(self) -> int:
        return self.starts[4] + self.chunks * self.chunk_elems

    def elems(self) -> np.ndarray:
        """Elements of each chunk."""
        k = np.arange(self.chunks, dtype=np.int64)
        return np.minimum(self.chunk_elems, self.n - k * self.chunk_elems)

    def frames(self, n_big: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offset, raw size) of every frame in the buffer, [chunks, 5] each, chunk-major."""
        e = self.chunk_elems
        k = np.arange(self.chunks, dtype=np.int64)
        elems = self.elems()
        lo, hi, sign, big, mag = self.starts
        offsets = np.stack([lo + k * e, hi + k * e, sign + k * (e // 8), big + k * (e // 8), mag + k * e], axis=1)
        bits = -(-elems // 8)
        sizes = np.stack([elems, elems, bits, bits, np.asarray(n_big, dtype=np.int64)], axis=1)
        return offsets, sizes


# -- planes on the device --------------------------------------------------------------------------


@dataclass
class Planes:
    """A file's changed elements as uncompressed planes (`buf`, laid out by `layout`), with their
    per-chunk counts (device int64 [chunks]) and escape tables (int64). Device or host."""

    layout: PlaneLayout
    buf: torch.Tensor  # uint8 [layout.size]
    n_big: torch.Tensor
    n_gap_esc: torch.Tensor
    n_mag_esc: torch.Tensor
    gap_esc: torch.Tensor
    mag_esc: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.buf.device


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [n] -> uint8 [ceil(n/8)], element i in bit i % 8 of byte i // 8 (zero padding)."""
    n = mask.numel()
    pad = -n % 8
    x = mask.to(torch.uint8)
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32, device=mask.device)
    return (x.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n/8)] -> bool [n] (inverse of `pack_bits`)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).reshape(-1)[:n].bool()


def chunk_ranks(mask: torch.Tensor, chunk_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a bool [m] over whole chunks (the last one may be short): (true elements per chunk, int64
    [chunks]; each element's rank among its chunk's true elements, int64 [m], meaningful where true)."""
    m = mask.numel()
    dev = mask.device
    c = torch.cumsum(mask, 0, dtype=torch.int64)
    starts = torch.arange(0, m, chunk_elems, device=dev, dtype=torch.int64)
    before = torch.where(starts > 0, c[(starts - 1).clamp_(min=0)], 0)
    ends = (starts + chunk_elems).clamp_(max=m) - 1
    counts = c[ends] - before
    rank = c.sub_(1).sub_(before.repeat_interleave(chunk_elems, output_size=starts.numel() * chunk_elems)[:m])
    return counts, rank


def chunk_counts(mask: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """True elements per chunk of a bool [m] (int64 [chunks])."""
    m = mask.numel()
    c = torch.cumsum(mask, 0, dtype=torch.int64)
    ends = torch.arange(chunk_elems - 1, m + chunk_elems - 1, chunk_elems, device=mask.device).clamp_(max=m - 1)
    total = c[ends]
    return torch.cat([total[:1], total[1:] - total[:-1]]) if total.numel() else total


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
    chosen = backend or _default_backend(dev)
    if chosen == "triton":
        if not kernels.available(dev):
            raise ValueError(f"the Triton encoder does not run on {dev}")
        try:
            return _encode_triton(batch, chunk_elems, slice_elems, context)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: the torch path
            if backend is not None:
                raise
            _KERNEL_FAILED.add(str(dev))
            log.warning("vllm-delta: the Triton encoder failed on %s, encoding with torch: %s", dev, exc)
    elif chosen != "torch":
        raise ValueError(f"planes backend must be one of {PLANES_BACKENDS}, not {chosen!r}")
    return _encode_torch(batch, chunk_elems, slice_elems, context)


PLANES_ENV = "VLLM_DELTA_PLANES_BACKEND"  # "torch": never the Triton kernels (default: Triton on CUDA)


def _default_backend(dev: torch.device) -> PlanesBackend:
    if os.environ.get(PLANES_ENV, "").strip().lower() == "torch":
        return "torch"
    return "triton" if dev.type == "cuda" and kernels.available(dev) and str(dev) not in _KERNEL_FAILED else "torch"


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
    starts_t = torch.tensor(batch.starts, dtype=torch.int64).to(dev, non_blocking=dev.type == "cuda")
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
    return Planes(
        layout=layout,
        buf=buf,
        n_big=counts[0],
        n_gap_esc=counts[1],
        n_mag_esc=counts[2],
        gap_esc=gap_esc,
        mag_esc=mag_esc,
    )


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
    starts_t = torch.tensor(batch.starts, dtype=torch.int64).to(dev, non_blocking=True)
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
    return Planes(
        layout=layout,
        buf=buf,
        n_big=counts[0],
        n_gap_esc=counts[1],
        n_mag_esc=counts[2],
        gap_esc=torch.cat(gap_esc) if gap_esc else empty,
        mag_esc=torch.cat(mag_esc) if mag_esc else empty,
    )


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
    )


# -- frames on the host (zstandard) ---------------------------------------------------------------

_TLS = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_TLS, "cctx", None)
    if cache is None:
        cache = _TLS.cctx = {}
    if level not in cache:
        # Standard frames with their content size and no zstd checksum (the chunk hash covers them):
        # what nvCOMP's zstd writes and reads too.
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)
    return cache[level]


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_TLS, "dctx", None)
    if d is None:
        d = _TLS.dctx = zstandard.ZstdDecompressor()
    return d


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


# -- reading: a file's streams, checked ----------------------------------------------------------


@dataclass
class Spans:
    """Tensors' (or pieces') elements in a file, as arrays sorted by `at`, none empty: tensor i holds
    elements [at[i], end[i]), its gap chain starts at start[i] and its positions lie in
    [start[i], stop[i]); `key[i]` is the caller's name for it (an index into its own list)."""

    at: np.ndarray
    end: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    key: np.ndarray

    @classmethod
    def of(cls, at, nnz, start, stop, key) -> Spans:
        arrays = [np.asarray(x, dtype=np.int64).reshape(-1) for x in (at, nnz, start, stop, key)]
        keep = arrays[1] > 0
        at_, nnz_, start_, stop_, key_ = (x[keep] for x in arrays)
        order = np.argsort(at_, kind="stable")
        return cls(at_[order], (at_ + nnz_)[order], start_[order], stop_[order], key_[order])

    def __len__(self) -> int:
        return int(self.at.size)

    def check(self, n: int, ctx_of) -> None:
        """Inside the file's n elements, not overlapping, starts within range (CodecError)."""
        bad = (self.at < 0) | (self.end > n) | (self.start < 0) | (self.start > self.stop)
        if len(self) > 1:
            bad[1:] |= self.at[1:] < self.end[:-1]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise err(
                CodecError,
                f"elements [{self.at[i]}, {self.end[i]}) outside the file's {n}, overlapping, or a bad start",
                ctx_of(i),
            )

    def chunks(self, chunk_elems: int, n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
        """(which chunks hold elements of any span, the first span holding elements of each chunk)."""
        first_k, last_k = self.at // chunk_elems, (self.end - 1) // chunk_elems
        marks = np.zeros(n_chunks + 1, dtype=np.int64)
        np.add.at(marks, first_k, 1)
        np.add.at(marks, last_k + 1, -1)
        needed = np.cumsum(marks)[:n_chunks] > 0
        owner = np.full(n_chunks, -1, dtype=np.int64)
        # spans are sorted: the first span covering a chunk is the smallest index whose range reaches it
        for_chunk = np.searchsorted(self.end, np.arange(n_chunks, dtype=np.int64) * chunk_elems, side="right")
        hit = for_chunk < len(self)
        owner[hit] = for_chunk[hit]
        return needed, owner


class Carry:
    """A gap chain running from one decoded run of chunks into the next: the span and its last position."""

    def __init__(self) -> None:
        self.span = -1
        self.last: torch.Tensor | None = None

    def clear(self) -> None:
        self.span, self.last = -1, None


class FileStreams:
    """A format-3 file's streams (`blob`, `index`, escape tables) and its file-level metadata
    (`{"chunk_elems", "elems"}`), parsed and checked against each other. Raises CodecError."""

    def __init__(self, payload: Mapping[str, torch.Tensor], meta: Any, ctx: Ctx):
        self.ctx = ctx
        if not isinstance(meta, Mapping):
            raise err(CodecError, "chunked payload lacks its file metadata", ctx)
        try:
            e, n = int(meta["chunk_elems"]), int(meta["elems"])
        except (KeyError, TypeError, ValueError):
            raise err(CodecError, f"malformed chunked file metadata {dict(meta)!r:.200}", ctx) from None
        if e % 128 or not 0 < e <= MAX_CHUNK_ELEMS or n < 0:
            raise err(CodecError, f"bad chunk size {e} or element count {n}", ctx)
        tensors = [payload.get(k) for k in PAYLOAD_PARTS]
        dtypes = (torch.uint8, torch.int64, torch.int64, torch.int64)
        if any(t is None or t.dtype != dt for t, dt in zip(tensors, dtypes)):
            raise err(CodecError, f"chunked payload lacks {'/'.join(PAYLOAD_PARTS)} or has wrong dtypes", ctx)
        blob, index, gap_esc, mag_esc = tensors
        assert blob is not None and index is not None and gap_esc is not None and mag_esc is not None
        self.layout = PlaneLayout(n, e)
        k = self.layout.chunks
        if index.shape != (k, INDEX_WIDTH):
            raise err(CodecError, f"index has shape {list(index.shape)}, {n} elements need [{k}, {INDEX_WIDTH}]", ctx)
        self.blob, self.gap_esc, self.mag_esc = blob.reshape(-1), gap_esc.reshape(-1), mag_esc.reshape(-1)
        self.index = index.numpy()
        idx = self.index
        self.frame_offsets, self.raw_sizes = self.layout.frames(idx[:, COL_BIG])
        comp = idx[:, :N_PLANES]
        padded = -(-comp // FRAME_ALIGN) * FRAME_ALIGN
        elems = self.layout.elems()
        bad = (
            (comp < 0).any(axis=1)
            | ((comp == 0) != (self.raw_sizes == 0)).any(axis=1)
            | (idx[:, COL_BIG] < 0)
            | (idx[:, COL_BIG] > elems)
            | (idx[:, COL_GAP_ESC] < 0)
            | (idx[:, COL_GAP_ESC] > elems)
            | (idx[:, COL_MAG_ESC] < 0)
            | (idx[:, COL_MAG_ESC] > idx[:, COL_BIG])
        )
        if bad.any():
            c = int(np.flatnonzero(bad)[0])
            raise err(CodecError, f"chunk {c}: malformed index row {idx[c].tolist()}", ctx)
        self.chunk_bytes = padded.sum(axis=1)
        self.chunk_starts = np.concatenate([[0], np.cumsum(self.chunk_bytes)]).astype(np.int64)
        frame_starts = np.cumsum(padded, axis=1) - padded
        self.blob_offsets = self.chunk_starts[:-1, None] + frame_starts  # [chunks, 5]
        if int(self.chunk_starts[-1]) != self.blob.numel():
            raise err(CodecError, f"index covers {int(self.chunk_starts[-1])} B, blob has {self.blob.numel()}", ctx)
        self.gap_esc_at = np.concatenate([[0], np.cumsum(idx[:, COL_GAP_ESC])]).astype(np.int64)
        self.mag_esc_at = np.concatenate([[0], np.cumsum(idx[:, COL_MAG_ESC])]).astype(np.int64)
        if self.gap_esc_at[-1] != self.gap_esc.numel() or self.mag_esc_at[-1] != self.mag_esc.numel():
            raise err(
                CodecError,
                f"escape tables hold {self.gap_esc.numel()}/{self.mag_esc.numel()} entries, "
                f"the index counts {int(self.gap_esc_at[-1])}/{int(self.mag_esc_at[-1])}",
                ctx,
            )

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def chunk_elems(self) -> int:
        return self.layout.chunk_elems

    def range_layout(self, k0: int, k1: int) -> PlaneLayout:
        e = self.chunk_elems
        return PlaneLayout(min(self.n, k1 * e) - k0 * e, e)

    def corrupt(self, k: int, ctx: Ctx) -> DeltaError:
        return err(CodecError, f"chunk {k} (elements {k * self.chunk_elems}..) is corrupt: its hash differs", ctx)

    def verify(self, k: int, ctx: Ctx) -> None:
        """Chunk k's bytes hash to its index entry (host)."""
        a, b = int(self.chunk_starts[k]), int(self.chunk_starts[k + 1])
        if chunk_hash_np(self.blob[a:b].numpy()) != int(self.index[k, COL_HASH]):
            raise self.corrupt(k, ctx)

    def decompress_into(self, k: int, run: tuple[int, int], out: np.ndarray, ctx: Ctx) -> None:
        """Verify chunk k and decompress its frames into `out`, the planes buffer of the chunks
        run = [k0, k1) (`range_layout`)."""
        self.verify(k, ctx)
        k0, k1 = run
        lay = self.range_layout(k0, k1)
        e = self.chunk_elems
        j = k - k0
        lo, hi, sign, big, mag = lay.starts
        offsets = (lo + j * e, hi + j * e, sign + j * (e // 8), big + j * (e // 8), mag + j * e)
        raw = self.blob.numpy()
        dctx = _dctx()
        for f in range(N_PLANES):
            size = int(self.raw_sizes[k, f])
            if not size:
                continue
            a = int(self.blob_offsets[k, f])
            try:
                data = dctx.decompress(raw[a : a + int(self.index[k, f])].data, max_output_size=size)
            except zstandard.ZstdError as exc:
                raise err(CodecError, f"chunk {k}: {PLANES[f]} frame does not decode: {exc}", ctx) from None
            if len(data) != size:
                raise err(CodecError, f"chunk {k}: {PLANES[f]} frame holds {len(data)} B, expected {size}", ctx)
            out[offsets[f] : offsets[f] + size] = np.frombuffer(data, dtype=np.uint8)

    def verify_run(self, k0: int, k1: int, ctx_of_chunk) -> None:
        """Chunks [k0, k1) hash to their index entries (host, vectorized: one pass over their words)."""
        a, b = int(self.chunk_starts[k0]), int(self.chunk_starts[k1])
        got = chunk_hashes_np(self.blob.numpy()[a:b], self.chunk_bytes[k0:k1])
        bad = np.flatnonzero(got != self.index[k0:k1, COL_HASH])
        if bad.size:
            k = k0 + int(bad[0])
            raise self.corrupt(k, ctx_of_chunk(k))

    def decompress_run(self, run: tuple[int, int], out: np.ndarray, ctx_of_chunk, threads: int) -> None:
        """Verify chunks run = [k0, k1) and decompress all their frames into `out` (their
        `range_layout`) with zstandard's own threads (one call, the GIL released throughout)."""
        k0, k1 = run
        self.verify_run(k0, k1, ctx_of_chunk)
        offsets, sizes = self.range_layout(k0, k1).frames(self.index[k0:k1, COL_BIG])
        used = sizes.reshape(-1) > 0
        a = int(self.chunk_starts[k0])
        src = np.stack(
            [(self.blob_offsets[k0:k1] - a).reshape(-1)[used], self.index[k0:k1, :N_PLANES].reshape(-1)[used]], 1
        )
        data = self.blob.numpy()[a : int(self.chunk_starts[k1])].tobytes()
        want = sizes.reshape(-1)[used]
        try:
            frames = zstandard.BufferWithSegments(data, src.astype(np.uint64).tobytes())
            got = _dctx().multi_decompress_to_buffer(
                frames, decompressed_sizes=want.astype(np.uint64).tobytes(), threads=max(1, threads)
            )
        except zstandard.ZstdError:  # find and name the frame: one chunk at a time
            for k in range(k0, k1):
                self.decompress_into(k, run, out, ctx_of_chunk(k))
            raise err(CodecError, f"chunks {k0}..{k1 - 1} do not decompress", ctx_of_chunk(k0)) from None
        for i, dst in enumerate(offsets.reshape(-1)[used].tolist()):
            seg = got[i]
            if len(seg) != want[i]:
                k = k0 + int(np.flatnonzero(used)[i]) // N_PLANES
                raise err(
                    CodecError, f"chunk {k}: a frame holds {len(seg)} B, expected {int(want[i])}", ctx_of_chunk(k)
                )
            out[dst : dst + len(seg)] = np.frombuffer(seg, dtype=np.uint8)  # type: ignore[call-overload]

    def views(self, k0: int, k1: int, buf: torch.Tensor, device: torch.device | None = None) -> PlaneViews:
        """The planes of chunks [k0, k1) over `buf` (their `range_layout`, filled by
        `decompress_into` or nvCOMP), with their counts and escape tables (on `device`, default buf's)."""
        dev = device or buf.device
        nb = dev.type == "cuda"
        lay = self.range_layout(k0, k1)
        lo, hi, sign, big, mag = lay.starts
        n, bits = lay.n, lay.bit_bytes
        idx = torch.from_numpy(np.ascontiguousarray(self.index[k0:k1, COL_BIG : COL_MAG_ESC + 1].T)).to(
            dev, non_blocking=nb
        )
        ga, gb = int(self.gap_esc_at[k0]), int(self.gap_esc_at[k1])
        ma, mb = int(self.mag_esc_at[k0]), int(self.mag_esc_at[k1])
        return PlaneViews(
            chunk_elems=self.chunk_elems,
            lo=buf[lo : lo + n],
            hi=buf[hi : hi + n],
            sign=buf[sign : sign + bits],
            big=buf[big : big + bits],
            mag=buf[mag : mag + lay.chunks * lay.chunk_elems].view(lay.chunks, lay.chunk_elems),
            n_big=idx[0],
            n_gap_esc=idx[1],
            n_mag_esc=idx[2],
            gap_esc=self.gap_esc[ga:gb].to(dev, non_blocking=nb),
            mag_esc=self.mag_esc[ma:mb].to(dev, non_blocking=nb),
        )

    def escape_offsets(self, k0: int, k1: int) -> tuple[int, int]:
        return int(self.gap_esc_at[k1] - self.gap_esc_at[k0]), int(self.mag_esc_at[k1] - self.mag_esc_at[k0])


class PlaneViews(NamedTuple):
    """The planes of a run of whole chunks as separate tensors (one device), with the chunks'
    counts and escape tables; `sub` cuts a run of its chunks out of it."""

    chunk_elems: int
    lo: torch.Tensor  # uint8 [n]
    hi: torch.Tensor  # uint8 [n]
    sign: torch.Tensor  # uint8 [ceil(n/8)]
    big: torch.Tensor  # uint8 [ceil(n/8)]
    mag: torch.Tensor  # uint8 [chunks, chunk_elems]
    n_big: torch.Tensor  # int64 [chunks]
    n_gap_esc: torch.Tensor
    n_mag_esc: torch.Tensor
    gap_esc: torch.Tensor  # int64
    mag_esc: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.lo.numel())

    def sub(self, j0: int, j1: int, esc: tuple[tuple[int, int], tuple[int, int]]) -> PlaneViews:
        """Chunks [j0, j1) of this run; `esc`: their (gap, mag) escape table ranges in this run's tables."""
        e = self.chunk_elems
        a, b = j0 * e, min(self.n, j1 * e)
        (ga, gb), (ma, mb) = esc
        return PlaneViews(
            chunk_elems=e,
            lo=self.lo[a:b],
            hi=self.hi[a:b],
            sign=self.sign[a // 8 : -(-b // 8)],
            big=self.big[a // 8 : -(-b // 8)],
            mag=self.mag[j0:j1],
            n_big=self.n_big[j0:j1],
            n_gap_esc=self.n_gap_esc[j0:j1],
            n_mag_esc=self.n_mag_esc[j0:j1],
            gap_esc=self.gap_esc[ga:gb],
            mag_esc=self.mag_esc[ma:mb],
        )


def plane_views(planes: Planes) -> PlaneViews:
    """An encoder's Planes as views (tests decode them directly)."""
    lay = planes.layout
    lo, hi, sign, big, mag = lay.starts
    buf = planes.buf
    return PlaneViews(
        chunk_elems=lay.chunk_elems,
        lo=buf[lo : lo + lay.n],
        hi=buf[hi : hi + lay.n],
        sign=buf[sign : sign + lay.bit_bytes],
        big=buf[big : big + lay.bit_bytes],
        mag=buf[mag : mag + lay.chunks * lay.chunk_elems].view(lay.chunks, lay.chunk_elems),
        n_big=planes.n_big,
        n_gap_esc=planes.n_gap_esc,
        n_mag_esc=planes.n_mag_esc,
        gap_esc=planes.gap_esc,
        mag_esc=planes.mag_esc,
    )


# -- planes -> positions and differences (device) -------------------------------------------------


class Decoded(NamedTuple):
    """Decoded elements of a run of chunks, in file order, restricted to the spans."""

    positions: torch.Tensor  # int64
    diffs: torch.Tensor  # int64: new - old mod 2^bits, read signed
    span: torch.Tensor  # int64: index into the spans, per element
    first: int  # the spans [first, first + len(counts)) have elements here, in element order
    counts: np.ndarray  # int64: elements of each of them


def decode_planes(
    v: PlaneViews, elem0: int, spans: Spans, carry: Carry, ctx_of, backend: PlanesBackend | None = None
) -> Decoded:
    """Device work of the decoder for one run of whole chunks (its first element is the file's
    `elem0`): escapes patched and checked against the chunks' counts, positions from the gap chains
    of the spans (a span that began in an earlier run continues from `carry`, updated here), every
    position checked against its span's range. Vectorized over the spans: no per-tensor work, and
    one host synchronization (every check folded into one flag; when it is set, the run is decoded
    again checking as it goes, by torch, to find the fault and raise the error naming it). `ctx_of(span
    index)` names a tensor for errors. `backend`: the planes' decode ("triton": one fused kernel;
    "torch": the reference; None: Triton on CUDA where it runs)."""
    dev = v.lo.device
    chosen = backend or _default_backend(dev)
    if chosen not in PLANES_BACKENDS or (chosen == "triton" and not kernels.available(dev)):
        raise ValueError(f"planes backend {chosen!r} does not run on {dev}")
    i0 = int(np.searchsorted(spans.end, elem0, side="right"))
    if i0 < len(spans) and spans.at[i0] < elem0 and (carry.span != i0 or carry.last is None):
        raise err(CodecError, "a tensor's elements continue a run that was not decoded", ctx_of(i0))
    saved = Carry()
    saved.span, saved.last = carry.span, carry.last
    try:
        out, checks = _decode(v, elem0, spans, carry, _Checks(eager=False), chosen)
    except Exception as exc:
        if backend is not None or chosen != "triton" or isinstance(exc, DeltaError):
            raise
        _KERNEL_FAILED.add(str(dev))  # a kernel that does not build here: the torch path from now on
        log.warning("vllm-delta: the Triton decoder failed on %s, decoding with torch: %s", dev, exc)
        carry.span, carry.last = saved.span, saved.last
        out, checks = _decode(v, elem0, spans, carry, _Checks(eager=False), "torch")
    if checks.flag is not None and bool(checks.flag):  # the one synchronization
        _decode(
            v,
            elem0,
            spans,
            saved,
            _Checks(eager=True, elem0=elem0, chunk_elems=v.chunk_elems, spans=spans, ctx_of=ctx_of),
            "torch",
        )
        raise err(CodecError, f"elements {elem0}..{elem0 + v.n} do not decode", ctx_of(min(i0, len(spans) - 1)))
    return out


class _Checks:
    """The checks of `_decode`: folded into one device flag (no synchronization), or, `eager`, each
    tested as it comes and raised with a message naming its chunk and a tensor."""

    def __init__(self, eager: bool, elem0: int = 0, chunk_elems: int = 1, spans: Spans | None = None, ctx_of=None):
        self.eager, self.elem0, self.e, self.spans, self.ctx_of = eager, elem0, chunk_elems, spans, ctx_of
        self.flag: torch.Tensor | None = None

    def __call__(self, bad: torch.Tensor, exc_type: type[DeltaError], what: str) -> None:
        """`bad`: per chunk (or one value) whether the check fails."""
        if not self.eager:
            self.flag = bad.any() if self.flag is None else self.flag | bad.any()
            return
        at = bad.reshape(-1).nonzero().reshape(-1)
        if at.numel():
            chunk = int(at[0]) if bad.dim() else 0
            assert self.spans is not None and self.ctx_of is not None
            start = self.elem0 + chunk * self.e
            j = min(int(np.searchsorted(self.spans.end, start, side="right")), len(self.spans) - 1)
            raise err(exc_type, f"chunk {start // self.e} (elements {start}..): {what}", self.ctx_of(j))

    def positions(self, bad: torch.Tensor, positions, local, sel, i0: int) -> None:
        """Positions outside their span's range (the message names the position and its element)."""
        if not self.eager:
            self(bad, PositionError, "")
            return
        if bool(bad.any()):
            assert self.spans is not None and self.ctx_of is not None
            w = int(bad.nonzero()[0, 0])
            i = i0 + int(local[w])
            elem = (w if sel is None else int(sel[w])) + self.elem0
            raise err(
                PositionError,
                f"position {int(positions[w])} out of range [{self.spans.start[i]}, {self.spans.stop[i]}) "
                f"(chunk {elem // self.e}, element {elem})",
                self.ctx_of(i),
            )


def _escape_checks(v: PlaneViews, check: _Checks) -> None:
    if v.gap_esc.numel():
        check((v.gap_esc < 0).any(), PositionError, "negative gap escape")
    if v.mag_esc.numel():
        check(
            ((v.mag_esc < MAG_BIAS + MAG_ESCAPE) | (v.mag_esc > 1 << 31)).any(), CodecError, "value escape out of range"
        )


def _planes_triton(v: PlaneViews, check: _Checks) -> tuple[torch.Tensor, torch.Tensor]:
    """(gap + 1, difference) per element by the fused kernel; its per-chunk count checks folded in."""
    counts = torch.stack([v.n_big, v.n_gap_esc, v.n_mag_esc])
    inc, diffs, bad = kernels.decode_chunks(
        (v.lo, v.hi, v.sign, v.big, v.mag),
        counts,
        v.gap_esc,
        v.mag_esc,
        chunk_elems=v.chunk_elems,
        gap_escape=GAP_ESCAPE,
        mag_bias=MAG_BIAS,
        mag_escape=MAG_ESCAPE,
    )
    check(bad != 0, CodecError, "big elements or escapes do not match the index")
    _escape_checks(v, check)
    return inc, diffs


def _planes_torch(v: PlaneViews, check: _Checks) -> tuple[torch.Tensor, torch.Tensor]:
    """(gap + 1, difference) per element, int64, escapes patched, counts checked against the index."""
    n, e = v.n, v.chunk_elems
    dev = v.lo.device
    gaps = v.lo.to(torch.int64).bitwise_or_(v.hi.to(torch.int64).bitwise_left_shift_(8))
    g_esc = gaps == GAP_ESCAPE
    check(chunk_counts(g_esc, e) != v.n_gap_esc, CodecError, "gap escapes do not match the index")
    if v.gap_esc.numel():  # the r-th escape code takes the r-th entry (clamped: a count mismatch is flagged)
        check((v.gap_esc < 0).any(), PositionError, "negative gap escape")
        at = torch.cumsum(g_esc, 0).sub_(1).clamp_(0, v.gap_esc.numel() - 1)
        gaps = torch.where(g_esc, v.gap_esc[at], gaps)
        del at
    del g_esc
    neg = unpack_bits(v.sign, n)
    big = unpack_bits(v.big, n)
    n_big, rank = chunk_ranks(big, e)
    check(n_big != v.n_big, CodecError, "big elements do not match the index")
    col = torch.where(big, rank, 0)
    col += torch.arange(n, device=dev, dtype=torch.int64).div_(e, rounding_mode="floor").mul_(e)
    codes = v.mag.reshape(-1)[col].to(torch.int64)
    del col, rank
    m_esc = big & (codes == MAG_ESCAPE)
    check(chunk_counts(m_esc, e) != v.n_mag_esc, CodecError, "value escapes do not match the index")
    m = torch.where(big, codes + MAG_BIAS, 1)
    if v.mag_esc.numel():
        check(
            ((v.mag_esc < MAG_BIAS + MAG_ESCAPE) | (v.mag_esc > 1 << 31)).any(), CodecError, "value escape out of range"
        )
        at = torch.cumsum(m_esc, 0).sub_(1).clamp_(0, v.mag_esc.numel() - 1)
        m = torch.where(m_esc, v.mag_esc[at], m)
        del at
    diffs = torch.where(neg, -m, m)
    return gaps.add_(1), diffs


def _decode(
    v: PlaneViews, elem0: int, spans: Spans, carry: Carry, check: _Checks, backend: PlanesBackend
) -> tuple[Decoded, _Checks]:
    """`decode_planes`' work, its checks made through `check`."""
    n = v.n
    dev = v.lo.device
    nb = dev.type == "cuda"
    i0 = int(np.searchsorted(spans.end, elem0, side="right"))
    i1 = int(np.searchsorted(spans.at, elem0 + n, side="left"))
    if backend == "triton":
        inc, diffs = _planes_triton(v, check)
    else:
        inc, diffs = _planes_torch(v, check)
    c = torch.cumsum(inc, 0)  # p = base(span) + (C_i - C_{first(span) - 1})
    del inc
    if i1 <= i0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return Decoded(empty, empty, empty, i0, np.zeros(0, dtype=np.int64)), check
    rel_at = np.maximum(spans.at[i0:i1], elem0) - elem0
    rel_end = np.minimum(spans.end[i0:i1], elem0 + n) - elem0
    counts = rel_end - rel_at
    total = int(counts.sum())
    small = torch.from_numpy(np.stack([rel_at, counts, spans.start[i0:i1] - 1, spans.start[i0:i1], spans.stop[i0:i1]]))
    at_t, cnt_t, base, lo_t, hi_t = small.to(dev, non_blocking=nb)
    if spans.at[i0] < elem0:  # began in an earlier run: continue its gap chain (decode_planes checked it)
        assert carry.last is not None
        base[0] = carry.last
    local = segment_ids(cnt_t, total)
    if int(rel_at[0]) == 0 and int(rel_end[-1]) == n and bool((rel_at[1:] == rel_end[:-1]).all()):
        sel = None  # the spans cover the run: every element is kept
        cc, d = c, diffs
    else:
        sel = torch.arange(total, device=dev, dtype=torch.int64) - (torch.cumsum(cnt_t, 0) - cnt_t)[local]
        sel += at_t[local]
        cc, d = c[sel], diffs[sel]
    before = torch.where(at_t > 0, c[(at_t - 1).clamp(min=0)], torch.zeros_like(at_t))
    positions = cc.sub_(before[local]).add_(base[local])
    check.positions((positions < lo_t[local]) | (positions >= hi_t[local]), positions, local, sel, i0)
    if spans.end[i1 - 1] > elem0 + n:  # the last span continues in the next run
        carry.span, carry.last = i1 - 1, positions[-1:].clone().reshape(())
    else:
        carry.clear()
    return Decoded(positions, d, local.add_(i0), i0, counts), check


# -- the codec ------------------------------------------------------------------------------------


@dataclass
class FilePack:
    """A file-level codec's output: payload tensors (by part name, stored as `::<part>`), the
    file's codec metadata (the header's `enc`) and each packed tensor's own `enc`."""

    payload: dict[str, torch.Tensor]
    enc: dict[str, Any]
    tensor_enc: dict[str, dict[str, Any]]


class ChunkedBatch(BatchSections):
    """`prepare_batch`'s (or a `StreamEncoder`'s) result: the batch's planes on its device (queued on
    the caller's stream; one Planes per run of whole chunks), and what the header needs per tensor.
    `wait()` waits for the device work, `split()` gives one Sections per tensor (pointing back here;
    None where nothing changed), `write_to()` compresses into a payload sink (`pack()`: into memory):
    with nvCOMP on the planes' GPU when it is available, else with zstandard on the host."""

    def __init__(self, codec: ChunkedCodec, counts: Sequence[int], starts: Sequence[int], parts: list[Planes]):
        self.codec = codec
        self.parts = parts
        self.counts = list(counts)
        self.starts = list(starts)
        self.ats = [0, *np.cumsum(self.counts).tolist()][:-1]
        self.event: Any = None
        self.device = parts[0].device if parts else torch.device("cpu")
        if self.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()
        super().__init__(self._sections, self._wait)

    @property
    def n(self) -> int:
        return sum(p.layout.n for p in self.parts)

    def _wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def _sections(self) -> list[Sections | None]:
        return [Sections(meta={"batch": self, "tensor": i}) if c else None for i, c in enumerate(self.counts)]

    def tensor_enc(self, i: int) -> dict[str, Any]:
        return {"at": int(self.ats[i]), "start": int(self.starts[i])}

    def file_enc(self) -> dict[str, Any]:
        return {"chunk_elems": self.codec.chunk_elems, "elems": self.n}

    def pack(self, pool: Executor | None = None, busy_ms: list[float] | None = None) -> FilePack:
        sink = MemorySink()
        self.write_to(sink, pool, busy_ms)
        return FilePack(payload=sink.payload(), enc=self.file_enc(), tensor_enc={})

    def write_to(self, sink: PayloadSink, pool: Executor | None = None, busy_ms: list[float] | None = None) -> None:
        """The payload's parts (PAYLOAD_LAYOUT, in order) into `sink`. On the GPU path the blob is
        compressed by nvCOMP, then copied to pinned memory in pieces of COPY_PIECE_BYTES, and a file
        sink writes each as its copy lands (the writes overlap the copies and each other)."""
        self.wait()
        t0 = time.perf_counter()
        dev = self.device
        done = False
        if dev.type == "cuda":
            backend, why = gpu.backend(dev)
            if backend is not None:
                try:
                    with torch.cuda.stream(gpu.encode_stream(dev)):
                        self._write_gpu(sink, backend)
                    gpu.note_path("encodes", f"on {dev} with nvCOMP {backend.version}")
                    done = True
                except Exception as exc:  # noqa: BLE001 - OOM, nvCOMP failure: the CPU path writes the same format
                    why = f"nvCOMP failed ({type(exc).__name__}: {exc})"
                    log.warning("vllm-delta: GPU encode failed, encoding on the CPU instead: %s", why)
                    sink.restart()
            if not done:
                gpu.note_path("encodes", f"on the CPU (zstandard): {why}")
        else:
            gpu.note_path("encodes", "on the CPU (zstandard): the changes are on the CPU")
        if not done:
            self._write_cpu(sink, pool)
        if busy_ms is not None:
            busy_ms.append((time.perf_counter() - t0) * 1e3)

    def _write_gpu(self, sink: PayloadSink, backend: gpu.GpuZstd) -> None:
        """nvCOMP over every frame of the file in as few calls as memory allows (a call costs ~10 ms
        on an H100 whatever its size: benchmarks/codec_calls.py), then the blob to pinned memory in
        pieces, each handed to the sink (written) as its copy lands."""
        if not self.parts:
            sink.append("blob", torch.zeros(0, dtype=torch.uint8))
            sink.append("index", _index([]))
            self._write_escapes(sink)
            return
        merged, bases = self._merge()
        counts = torch.cat([torch.stack([p.n_big, p.n_gap_esc, p.n_mag_esc], dim=1) for p in self.parts])
        counts_np = counts.cpu().numpy()
        frames = [p.layout.frames(counts_np[k0 : k0 + p.layout.chunks, 0]) for p, k0 in zip(self.parts, self._firsts())]
        offsets = np.concatenate([off + base for (off, _), base in zip(frames, bases)])
        sizes = np.concatenate([size for _, size in frames])
        blob, comp, hashes = gpu.compress_chunks(backend, merged, offsets, sizes)
        del merged
        host = torch.empty(blob.numel(), dtype=torch.uint8, pin_memory=True)
        for a in range(0, blob.numel(), COPY_PIECE_BYTES):
            b = min(blob.numel(), a + COPY_PIECE_BYTES)
            host[a:b].copy_(blob[a:b], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            sink.append("blob", host[a:b], event.synchronize)
        if not blob.numel():
            sink.append("blob", host)
        hashes_np = hashes.cpu().numpy()
        sink.append("index", _index([np.concatenate([comp, counts_np, hashes_np[:, None]], axis=1)]))
        self._write_escapes(sink)

    def _firsts(self) -> list[int]:
        """Each part's first chunk in the file."""
        return [0, *np.cumsum([p.layout.chunks for p in self.parts]).tolist()][:-1]

    def _merge(self) -> tuple[torch.Tensor, list[int]]:
        """Every part's planes in one device buffer (one nvCOMP call reads them all): the parts'
        buffers become views of it, so the separate ones are freed (memory: one copy at a time)."""
        sizes = [p.buf.numel() for p in self.parts]
        bases = [0, *np.cumsum(sizes).tolist()][:-1]
        if len(self.parts) == 1:
            return self.parts[0].buf, bases
        merged = torch.cat([p.buf for p in self.parts])
        for p, base, size in zip(self.parts, bases, sizes):
            p.buf = merged[base : base + size]
        return merged, bases

    def _write_cpu(self, sink: PayloadSink, pool: Executor | None) -> None:
        host = HostCopy(self.device)
        on_host = [planes_to_host(p, host) for p in self.parts]
        host.done()
        host.wait()
        index = []
        for p in on_host:
            blob_np, index_np = compress_cpu(p, self.codec.level, pool)
            sink.append("blob", torch.from_numpy(blob_np.copy()))
            index.append(index_np)
        if not on_host:
            sink.append("blob", torch.zeros(0, dtype=torch.uint8))
        sink.append("index", _index(index))
        self._write_escapes(sink)

    def _write_escapes(self, sink: PayloadSink) -> None:
        for key in ("gap_esc", "mag_esc"):
            tables = [getattr(p, key).cpu() for p in self.parts]
            sink.append(key, torch.cat(tables) if tables else torch.zeros(0, dtype=torch.int64))


def _index(rows: list[np.ndarray]) -> torch.Tensor:
    if not rows:
        return torch.zeros((0, INDEX_WIDTH), dtype=torch.int64)
    out = torch.from_numpy(np.concatenate(rows).astype(np.int64))
    assert out.shape[1] == INDEX_WIDTH
    return out


# the payload's parts in the order they are written: name, dtype, dimensions
PAYLOAD_LAYOUT: list[tuple[str, torch.dtype, int]] = [
    ("blob", torch.uint8, 1),
    ("index", torch.int64, 2),
    ("gap_esc", torch.int64, 1),
    ("mag_esc", torch.int64, 1),
]


@dataclass
class FilePlan:
    """A chunked file laid out before it is written (base.FileWrite): the header's `enc`, the
    tensors' `enc`, the payload's parts; `write_to` streams the payload."""

    batch: ChunkedBatch
    enc: dict[str, Any]
    tensor_enc: dict[str, dict[str, Any]]
    parts: list[tuple[str, torch.dtype, int]]
    size_hint: int = 0

    def write_to(self, sink: PayloadSink, pool: Executor | None = None, busy_ms: list[float] | None = None) -> None:
        self.batch.write_to(sink, pool, busy_ms)


class StreamEncoder:
    """Encodes a batch's changes as they arrive (the trainer's detection, pass by pass) into planes
    of whole chunks, holding back a last partial chunk for the next pass: the device holds one
    pass's changes at a time plus the planes (~3.3 B per changed element). `finish` gives the same
    file as `prepare_batch` of all the changes at once."""

    def __init__(self, codec: ChunkedCodec, starts: Sequence[int]):
        self.codec = codec
        self.starts = list(starts)
        self.parts: list[Planes] = []
        self._pending: tuple[torch.Tensor, ...] | None = None
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, positions: torch.Tensor, seg: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
        """The next changes (positions, tensor index, new bits, old bits), in owned order."""
        cur: tuple[torch.Tensor, ...] = (positions, seg, new, old)
        if self._pending is not None:
            cur = tuple(torch.cat([a, b]) for a, b in zip(self._pending, cur))
        e = self.codec.chunk_elems
        whole = cur[0].numel() // e * e
        if whole:
            self._encode(tuple(x[:whole] for x in cur))
        self._pending = tuple(x[whole:].clone() for x in cur) if cur[0].numel() > whole else None

    def _encode(self, part: tuple[torch.Tensor, ...]) -> None:
        pos, seg, new, old = part
        batch = Batch(positions=pos, new=new, old=old, seg=seg, counts=[], starts=self.starts, numels=[])
        c = self.codec
        self.parts.append(encode_planes(batch, c.chunk_elems, c.slice_elems, self._prev, c.encode_backend))
        self._prev = (pos[-1:].clone(), seg[-1:].clone())

    def finish(self, counts: Sequence[int]) -> ChunkedBatch:
        """The encoded batch; `counts`: changed elements per tensor (the detection's)."""
        if self._pending is not None:
            self._encode(self._pending)
            self._pending = None
        if sum(counts) != sum(p.layout.n for p in self.parts):
            raise ValueError(f"{sum(p.layout.n for p in self.parts)} changes encoded, the counts say {sum(counts)}")
        return ChunkedBatch(self.codec, counts, self.starts, self.parts)


class ChunkedCodec:
    """The chunked codec (module docstring). File-level: `pack_file` writes every changed tensor of
    a file at once; `prepare`/`unpack`/`finish` work on one tensor (or piece) for the per-tensor
    readers (replay, materialize) and the one-shot `encode`/`decode`."""

    name = "chunked"
    needs_base = True
    file_level = True

    def __init__(
        self,
        level: int = ZSTD_LEVEL,
        chunk_elems: int = CHUNK_ELEMS,
        slice_elems: int = SLICE_ELEMS,
        encode_backend: PlanesBackend | None = None,
    ):
        """`encode_backend`: the device encoder (`encode_planes`): None picks Triton on CUDA."""
        self.level = level
        self.chunk_elems = chunk_elems
        self.slice_elems = slice_elems
        self.encode_backend = encode_backend

    # -- trainer side ------------------------------------------------------------------------
    def prepare(
        self, positions: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, numel: int, start: int = 0
    ) -> Sections:
        """One tensor's changes, kept as they are (on their device) until `pack_file` lays out the file."""
        return Sections(meta={"changes": (positions, int_view(new_bits), int_view(old_bits)), "start": start})

    def prepare_batch(self, batch: Batch) -> ChunkedBatch:
        """Device work for many tensors at once: the planes, on the batch's device and stream."""
        if not batch.positions.numel():
            return ChunkedBatch(self, batch.counts, batch.starts, [])
        parts = [encode_planes(batch, self.chunk_elems, self.slice_elems, backend=self.encode_backend)]
        return ChunkedBatch(self, batch.counts, batch.starts, parts)

    def stream(self, starts: Sequence[int]) -> StreamEncoder:
        """`prepare_batch` for changes that arrive in passes (`StreamEncoder`)."""
        return StreamEncoder(self, starts)

    def plan_file(self, tensors: Sequence[tuple[str, Sections]]) -> FilePlan:
        """The file of the changed tensors given (Sections of one `prepare_batch`, or of `prepare`,
        laid out in the order given): its metadata now, its payload by `write_to`."""
        batches = {id(s.meta.get("batch")): s.meta.get("batch") for _, s in tensors}
        if len(batches) == 1 and None not in batches.values():
            (prepared,) = batches.values()
            assert isinstance(prepared, ChunkedBatch)
        else:
            if any("changes" not in s.meta for _, s in tensors):
                raise ValueError("pack_file takes the Sections of one prepare_batch, or of prepare")
            prepared = self.prepare_batch(_concat([s for _, s in tensors]))
        tensor_enc = {
            name: prepared.tensor_enc(s.meta["tensor"] if "batch" in s.meta else i)
            for i, (name, s) in enumerate(tensors)
        }
        # ~1.1-1.4 B per changed element (docs/PERFORMANCE.md), the index 72 B per chunk
        hint = prepared.n * 5 // 4 + -(-prepared.n // self.chunk_elems) * INDEX_WIDTH * 8
        return FilePlan(prepared, prepared.file_enc(), tensor_enc, list(PAYLOAD_LAYOUT), hint)

    def pack_file(
        self, tensors: Sequence[tuple[str, Sections]], pool: Executor | None = None, busy_ms: list[float] | None = None
    ) -> FilePack:
        """The file payload of the changed tensors given, in memory (`plan_file` into a MemorySink)."""
        plan = self.plan_file(tensors)
        sink = MemorySink()
        plan.write_to(sink, pool, busy_ms)
        return FilePack(payload=sink.payload(), enc=plan.enc, tensor_enc=plan.tensor_enc)

    def pack(self, sections: Sections, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One tensor as a file of its own: the payload and its `enc` (with the file's under "file")."""
        out = self.pack_file([("", sections)])
        return out.payload, {**out.tensor_enc[""], "file": out.enc}

    # -- reader side (one piece) -----------------------------------------------------------------
    def unpack(
        self, tensors: Mapping[str, torch.Tensor], meta: Any, *, numel: int, nnz: int, dtype: torch.dtype, ctx: Ctx
    ) -> Sections:
        """Host work: verify and decompress the chunks holding the piece's elements."""
        at, start = piece_at(meta, numel, ctx)
        streams = FileStreams(tensors, meta.get("file"), ctx)
        spans = Spans.of([at], [nnz], [start], [numel], [0])
        spans.check(streams.n, lambda _: ctx)
        buf = torch.zeros(0, dtype=torch.uint8)
        k0 = k1 = 0
        if nnz:
            e = streams.chunk_elems
            k0, k1 = at // e, -(-(at + nnz) // e)
            buf = torch.empty(streams.range_layout(k0, k1).size, dtype=torch.uint8)
            for k in range(k0, k1):
                streams.decompress_into(k, (k0, k1), buf.numpy(), ctx)
        return Sections(meta={"streams": streams, "spans": spans, "chunks": (k0, k1), "buf": buf})

    def finish(self, sections: Sections, *, numel: int, device: torch.device | str, ctx: Ctx) -> Changes:
        """Device work: positions and differences of the piece's elements."""
        dev = torch.device(device)
        streams, spans, buf = sections.meta["streams"], sections.meta["spans"], sections.meta["buf"]
        if not len(spans):
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            return Changes(positions=empty, diffs=empty)
        k0, k1 = sections.meta["chunks"]
        views = streams.views(k0, k1, buf.to(dev), dev)
        out = decode_planes(views, k0 * streams.chunk_elems, spans, Carry(), lambda _: ctx)
        return Changes(positions=out.positions, diffs=out.diffs)


def piece_at(meta: Any, numel: int, ctx: Ctx) -> tuple[int, int]:
    """A piece's first element in its file's streams and the start of its gap chain (its `enc`)."""
    try:
        at, start = int(meta["at"]), int(meta.get("start", 0))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise err(CodecError, f"chunked tensor metadata lacks 'at': {meta!r:.200}", ctx) from None
    if at < 0 or not 0 <= start <= numel:
        raise err(CodecError, f"bad element offset {at} or start {start}", ctx)
    return at, start


def _concat(sections: Sequence[Sections]) -> Batch:
    """Single-tensor Sections (`prepare`) laid end to end as one Batch."""
    changes = [s.meta["changes"] for s in sections]
    dev = changes[0][0].device if changes else torch.device("cpu")
    counts = [int(c[0].numel()) for c in changes]
    seg = segment_ids(torch.tensor(counts, dtype=torch.int64, device=dev), sum(counts))
    return Batch(
        positions=torch.cat([c[0].to(torch.int64) for c in changes]),
        new=torch.cat([c[1] for c in changes]),
        old=torch.cat([c[2] for c in changes]),
        seg=seg,
        counts=counts,
        starts=[int(s.meta["start"]) for s in sections],
        numels=[0] * len(sections),
    )
