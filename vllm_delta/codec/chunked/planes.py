"""The chunked codec's planes: constants of the format, where the planes of a run of chunks sit in
one flat buffer (`PlaneLayout`), the planes themselves (`Planes`, `PlaneViews`), bit helpers, and
which device backend (Triton or the torch reference) turns changes into planes and back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import numpy as np
import torch

from . import kernels

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
PAYLOAD_PARTS = ("blob", "index", "gap_esc", "mag_esc")  # file-level payload keys (`::<part>`) every file has
FIRST_PART = "first"  # optional (written since issue 26): each chunk's first position, for skipping chunks
# the payload's parts in the order they are written: name, dtype, dimensions
PAYLOAD_LAYOUT: list[tuple[str, torch.dtype, int]] = [
    ("blob", torch.uint8, 1),
    ("index", torch.int64, 2),
    ("gap_esc", torch.int64, 1),
    ("mag_esc", torch.int64, 1),
    (FIRST_PART, torch.int64, 1),
]
SPANS_PART = "spans"  # files with rank blocks (blocks.py): int32 [spans, 4], after `first`
SPANS_LAYOUT = (SPANS_PART, torch.int32, 2)
PlanesBackend = Literal["torch", "triton"]  # planes on the device: the fused kernels, or the torch reference
PLANES_BACKENDS: tuple[PlanesBackend, ...] = get_args(PlanesBackend)
PLANES_ENV = "VLLM_DELTA_PLANES_BACKEND"  # "torch": never the Triton kernels (default: Triton on CUDA)
KERNEL_FAILED: set[str] = set()  # devices where a Triton kernel failed (not tried again)


def default_backend(dev: torch.device) -> PlanesBackend:
    """Triton on CUDA where it runs (and has not failed here), else the torch reference."""
    if os.environ.get(PLANES_ENV, "").strip().lower() == "torch":
        return "torch"
    return "triton" if dev.type == "cuda" and kernels.available(dev) and str(dev) not in KERNEL_FAILED else "torch"


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
        elems = self.elems()
        bits = -(-elems // 8)
        sizes = np.stack([elems, elems, bits, bits, np.asarray(n_big, dtype=np.int64)], axis=1)
        return self.frame_offsets(), sizes

    def frame_offsets(self) -> np.ndarray:
        """Where each chunk's five frames start in the buffer, [chunks, 5]: chunk k at k·E elements
        of every plane, whatever the sizes of the chunks before it."""
        e = self.chunk_elems
        k = np.arange(self.chunks, dtype=np.int64)
        lo, hi, sign, big, mag = self.starts
        return np.stack([lo + k * e, hi + k * e, sign + k * (e // 8), big + k * (e // 8), mag + k * e], axis=1)


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
    first: torch.Tensor | None = None  # int64 [chunks]: the position (in its tensor) of each chunk's first element

    @classmethod
    def of(
        cls, layout: PlaneLayout, buf: torch.Tensor, counts: torch.Tensor, gap_esc: torch.Tensor, mag_esc: torch.Tensor
    ) -> Planes:
        """Planes from the encoders' per-chunk counts: rows big, gap escapes, magnitude escapes ([3, chunks])."""
        return cls(layout, buf, counts[0], counts[1], counts[2], gap_esc, mag_esc)

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
    first: torch.Tensor | None = None  # int64 [chunks]: each chunk's first position (checked when given)

    @property
    def n(self) -> int:
        return int(self.lo.numel())

    def sub(
        self, j0: int, j1: int, esc: tuple[tuple[int, int], tuple[int, int]], last: int | None = None
    ) -> PlaneViews:
        """Chunks [j0, j1) of this run; `esc`: their (gap, mag) escape table ranges in this run's tables;
        `last`: the elements of chunk j1 - 1 when it is short (default: whole, or the run's end)."""
        e = self.chunk_elems
        a, b = j0 * e, min(self.n, j1 * e)
        if last is not None:
            b = min(b, (j1 - 1) * e + last)
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
            first=self.first[j0:j1] if self.first is not None else None,
        )


def views_over(
    buf: torch.Tensor,
    layout: PlaneLayout,
    index: np.ndarray,
    escapes: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    first: np.ndarray | None = None,
) -> PlaneViews:
    """The planes of a run of chunks over `buf` (laid out by `layout`, on `device`), with the chunks'
    counts (`index`: their rows of a file's index, [chunks, 9]), their (gap, value) escape tables and,
    when given, their first positions, copied to `device`."""
    nb = device.type == "cuda"
    lo, hi, sign, big, mag = layout.starts
    n, bits, e = layout.n, layout.bit_bytes, layout.chunk_elems
    counts = torch.from_numpy(np.ascontiguousarray(index[:, COL_BIG : COL_MAG_ESC + 1].T)).to(device, non_blocking=nb)
    return PlaneViews(
        chunk_elems=e,
        lo=buf[lo : lo + n],
        hi=buf[hi : hi + n],
        sign=buf[sign : sign + bits],
        big=buf[big : big + bits],
        mag=buf[mag : mag + layout.chunks * e].view(layout.chunks, e),
        n_big=counts[0],
        n_gap_esc=counts[1],
        n_mag_esc=counts[2],
        gap_esc=escapes[0].to(device, non_blocking=nb),
        mag_esc=escapes[1].to(device, non_blocking=nb),
        first=torch.from_numpy(first.copy()).to(device, non_blocking=nb) if first is not None else None,
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
