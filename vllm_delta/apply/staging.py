"""Staging: a version's changed pieces -> their changes on the engine's device, in chunks.

Staging owns what is the same for every codec; the codec's decoder (codec/decoding.py, found
through the codec registry by the header's codec name) owns what is its own:

* staging: which pieces this rank needs (`changed_items`, from the engine's layout: a format-3
  version, one file or every part of a multi-part one, read straight off its headers into arrays,
  `FilePieces` of one `FileSet`, with no per-tensor objects: a mixture of experts lists ~19K tensors;
  what depends only on the header's tensor set and the layout, `LayoutTable`, is computed once and
  reused by every later version), the positions of each tensor this rank holds (so that a decoder
  can skip the chunks of other ranks' rows), host memory (pinned buffers, reused threads, reading
  files' bytes into them in parallel pieces), the order work runs in (every unit's host work queued
  at once on the thread pool, running ahead of the device, which takes the units in order on the
  caller's stream: the engine's side stream), per-phase timings, the count of changed elements
  decoded, and the Chunks handed to the engine;
* the codec: its units and their host work (decompression, copies), the device decode, every
  integrity check and the errors naming version, tensor and chunk.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codec import get_decoder
from ..codec.decoding import Chunk, Fetch, FilePieces, FileSet, Item, PieceEncs, Pieces
from ..format import (
    DTYPES,
    STREAMS_FORMAT_VERSIONS,
    RowMap,
    Version,
    VersionFile,
    VersionHeader,
    VersionLike,
    mapped_files,
    row_size,
)
from ..format import TensorTable as HeaderTable
from .layout import DeviceLayout

# Changed elements decoded per device chunk: bounds staging's temporary memory. On a GPU each chunk
# costs a few host waits and ~40 launches whatever its size, so small chunks leave the GPU idle:
# Qwen3-8B at 1% (82M changes) staged in 71.4 / 57.3 / 54.0 ms at 2^23 / 2^24 / 2^25 with peaks of 1.80 /
# 2.09 / 2.49 GB (H100, `benchmarks/profile_stage.py --sweep`, docs/PERFORMANCE.md). On the CPU a chunk's
# fixed cost is small beside its work, and the smaller chunk keeps the host's temporaries at half.
CHUNK_ELEMS = 1 << 23
GPU_CHUNK_ELEMS = 1 << 24


def default_chunk_elems(device: torch.device) -> int:
    """Staging's device chunk for `device` when the caller names none."""
    return GPU_CHUNK_ELEMS if device.type == "cuda" else CHUNK_ELEMS


READ_PIECE_BYTES = 4 << 20  # compressed bytes copied into pinned memory per task
# "sync": every staging phase waits for the device before it is timed (each phase's own device time,
# for profiling). Default: phases are timed on the host, and the device runs behind the host up to the
# waits the data needs. Those timing waits were 29 of the 48 waits, and 16 ms of waiting, in a 62 ms
# staging of Qwen3-8B at 1% on an H100 (`benchmarks/profile_stage.py`; the time staging gains without
# them is not measured yet). The staging total is exact either way (`stage` ends in a wait).
PHASE_TIMING_ENV = "VLLM_DELTA_STAGE_TIMING"


def phase_waits() -> bool:
    """Whether staging's phases each wait for the device (VLLM_DELTA_STAGE_TIMING=sync)."""
    return os.environ.get(PHASE_TIMING_ENV, "").strip().lower() == "sync"


Items = Pieces  # a version's changed tensors of one element width (codec/decoding.py)

__all__ = [
    "CHUNK_ELEMS",
    "GPU_CHUNK_ELEMS",
    "PHASE_TIMING_ENV",
    "Chunk",
    "default_chunk_elems",
    "Decoder",
    "FilePieces",
    "FileSet",
    "Item",
    "Items",
    "LayoutTable",
    "changed_items",
    "item_indices",
]


def item_indices(items: Items) -> list[int]:
    """The layout indices of the tensors `items` changes."""
    if isinstance(items, FileSet):
        return [int(i) for i in items.indices]
    return [it.index for it in items]


def _threads() -> int:
    env = os.environ.get("VLLM_DELTA_STAGE_THREADS")
    return max(1, int(env)) if env else max(1, min(32, os.cpu_count() or 1))


class Decoder:
    """Decodes versions for one engine: a thread pool, pinned buffers, per-phase timings, the
    changed elements decoded (`decoded`, summed over decodes until reset). Each `decode` lends a
    codec's decoder a `_Host` (codec.decoding.StagingHost)."""

    def __init__(self, device: torch.device, chunk_elems: int | None = None, threads: int | None = None):
        self.device = device
        self.chunk_elems = chunk_elems or default_chunk_elems(device)
        self.n_threads = threads or _threads()
        self.phase_waits = phase_waits()
        self._pool: ThreadPoolExecutor | None = None
        self.host_bytes = 0  # pinned / host staging bytes of the last decode
        self.decoded = 0  # changed elements decoded since the last reset (what the plans' units hold)

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.n_threads, thread_name_prefix="vllm-delta-stage")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def sync(self) -> None:
        """Wait for the work queued on the device's current stream."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def decode(self, version: int, codec: str, items: Items, width: int, timings: dict[str, float]) -> Iterator[Chunk]:
        """Yield Chunks covering `items` (changed pieces of one element width, in layout order)."""
        if not isinstance(items, FileSet):
            items = [it for it in items if it.nnz]
        if not len(items):
            return
        host = _Host(self, timings)
        self.host_bytes = 0
        plan = get_decoder(codec, {"version": version}).plan(version, items, width, host)
        self.decoded += plan.elements
        fetches: list[Fetch] = []
        try:
            fetches.extend(plan.fetch(unit) for unit in plan.units)  # the host work runs ahead of the device
            for unit, fetched in zip(plan.units, fetches):
                fetched.wait()
                host.mark("read", sync=False)
                for chunk in plan.decode(unit, fetched):
                    yield chunk
                    host.restart()
            finish = getattr(plan, "finish", None)  # a decoder's checks read once, after every unit
            if finish is not None:
                finish()
                host.mark("check", sync=False)
        finally:
            for fetched in fetches:
                fetched.cancel()
            self.sync()  # the copies out of the pinned buffers are done before they are reused


class _Host:
    """What staging lends a codec's decoder for one decode (codec.decoding.StagingHost)."""

    def __init__(self, decoder: Decoder, timings: dict[str, float]):
        self._decoder, self._timings = decoder, timings
        self._t0 = time.perf_counter()

    @property
    def device(self) -> torch.device:
        return self._decoder.device

    @property
    def chunk_elems(self) -> int:
        return self._decoder.chunk_elems

    @property
    def threads(self) -> int:
        return self._decoder.n_threads

    def buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(n, dtype=dtype, pin_memory=self.device.type == "cuda")
        self._decoder.host_bytes += n * out.element_size()
        return out

    def read(self, ranges: Sequence[tuple[np.ndarray, int, int]]) -> Fetch:
        """Bytes src[a:b] of each range (files' memory maps) end to end in one pinned buffer, in pieces
        on the pool's threads (the read: page cache or disk; preadv and numpy copies run without the
        GIL, so the pieces run in parallel). Bytes of an open version file are read from the file
        itself (`format.mapped_files`: half the time of copying them out of the mapping on tmpfs)."""
        buf = self.buffer(sum(b - a for _, a, b in ranges), torch.uint8)
        dst = buf.numpy()
        pool = self._decoder.pool
        futures: list[Future[None]] = []
        at = 0
        for src, a, b in ranges:
            span = mapped_files.span_of(src.ctypes.data + a, b - a) if b > a else None
            fd = mapped_files.open_span(span) if span is not None else None
            if fd is None or span is None:
                for s in range(a, b, READ_PIECE_BYTES):
                    futures.append(pool.submit(_copy_into, dst, src, at + s - a, s, min(b, s + READ_PIECE_BYTES)))
            else:
                futures += _pread_pieces(pool, dst, at, fd, span.offset, b - a)
            at += b - a
        return Fetch(futures, buf)

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self._decoder.pool.submit(fn)

    def mark(self, phase: str, sync: bool = True) -> None:
        """The time since the last mark goes to `phase` (waiting for the device first only with
        VLLM_DELTA_STAGE_TIMING=sync: a codec never relies on this wait)."""
        if sync and self._decoder.phase_waits:
            self._decoder.sync()
        t1 = time.perf_counter()
        self._timings[phase] = self._timings.get(phase, 0.0) + (t1 - self._t0) * 1e3
        self._t0 = t1

    def restart(self) -> None:
        self._t0 = time.perf_counter()


def changed_items(vf: VersionLike, layout: DeviceLayout) -> dict[int, Items]:
    """A delta's changed tensors that this layout holds any of, by element width, in layout order.
    A format-3 version (one file, or every part of a multi-part version): a FileSet, one FilePieces
    per file read straight off its header into arrays, each piece with the positions this layout
    holds of its tensor (`need_lo`/`need_hi`). Other formats: one Item per piece, the pieces of one
    tensor adjacent and in position order."""
    files = _stream_files(vf)
    if files is None:
        return _piece_items(vf, layout)
    by_width: dict[int, list[FilePieces]] = {}
    for f in files:
        for width, pieces in _file_pieces(f, layout).items():
            by_width.setdefault(width, []).append(pieces)
    return {width: FileSet(pieces) for width, pieces in sorted(by_width.items())}


def _stream_files(vf: VersionLike) -> list[VersionFile] | None:
    """The files of a format-3 version (one, or its parts in order); None for other formats."""
    if vf.header.format_version not in STREAMS_FORMAT_VERSIONS or vf.header.kind != "delta":
        return None
    files = vf.parts if isinstance(vf, Version) else [vf]
    if not all(isinstance(f, VersionFile) for f in files):
        return None  # a stand-in of the reader's API (tests): piece by piece
    return files


def _piece_items(vf: VersionLike, layout: DeviceLayout) -> dict[int, Items]:
    """`changed_items` piece by piece (`vf.pieces`): formats 1 and 2."""
    h = vf.header
    by_width: dict[int, list[Item]] = {}
    segments, index = layout.layout.segments, layout.index
    for name, entry in h.tensors.items():
        if not entry.nnz or not segments.get(name):
            continue
        dtype = entry.torch_dtype
        items = by_width.setdefault(dtype.itemsize, [])
        i, numel = index[name], entry.numel
        for piece in vf.pieces(name):
            items.append(Item(i, name, numel, piece.nnz, piece.enc, piece.payload, dtype, piece.start, piece.stop))
    out: dict[int, Items] = {}
    for width, items in by_width.items():
        items.sort(key=lambda it: it.index)  # stable: a tensor's pieces keep their order
        out[width] = items
    return out


@dataclass(frozen=True)
class LayoutTable:
    """What staging needs of a header's tensor table that depends only on its tensor set and the
    layout (a version changes positions and values, never the set of tensors): per header entry, in
    header order, its layout index (-1: the layout holds none of it), element width, size and row
    size, and the positions the layout holds of it. Built once per tensor set and layout
    (`of`), then every version's header is read into arrays with no per-tensor work but its own
    fields (nnz, codec metadata)."""

    names: np.ndarray  # object: the header's tensor names, in header order
    index: np.ndarray  # int64
    width: np.ndarray  # int64: bytes per element (the header's dtype)
    numel: np.ndarray  # int64
    row: np.ndarray  # int64: elements per row of dim 0 (a part owns rows)
    need_lo: np.ndarray  # int64: the layout holds positions in [need_lo, need_hi) of the tensor
    need_hi: np.ndarray
    need_c0: np.ndarray  # int64: ... and of each row, the columns [need_c0, need_c1)
    need_c1: np.ndarray

    @classmethod
    def of(cls, header: VersionHeader, layout: DeviceLayout) -> LayoutTable:
        """The table of `header`'s tensor set on `layout`, remembered on the layout for later versions
        (keyed by the names, shapes and dtypes as one string and bytes: a format-5 header's as read, no
        object per tensor)."""
        columns = HeaderTable.of(header.tensors)
        key = columns.set_key()
        cache = layout.caches.setdefault("tensor_tables", {})
        table: LayoutTable | None = cache.get(key)
        if table is None:
            names = columns.names
            entries = list(header.tensors.values())
            held = layout.layout.segments
            index = np.array([layout.index[n] if held.get(n) else -1 for n in names], dtype=np.int64)
            at = np.maximum(index, 0)
            table = cls(
                names=np.array(names, dtype=object),
                index=index,
                width=np.array([_WIDTH[e.dtype] for e in entries], dtype=np.int64),
                numel=np.array([e.numel for e in entries], dtype=np.int64),
                row=np.array([row_size(e.shape) for e in entries], dtype=np.int64),
                need_lo=np.where(index >= 0, layout.need_lo[at], 0),
                need_hi=np.where(index >= 0, layout.need_hi[at], 0),
                need_c0=np.where(index >= 0, layout.need_c0[at], 0),
                need_c1=np.where(index >= 0, layout.need_c1[at], 0),
            )
            if len(cache) >= 4:  # a server sees one tensor set; a few in tests
                cache.clear()
            cache[key] = table
        return table


def _file_pieces(vf: VersionFile, layout: DeviceLayout) -> dict[int, FilePieces]:
    """One format-3 file's changed pieces that the layout holds, by width, as arrays in layout order
    (the pieces' `enc` are handed to the codec's decoder as they are: it checks them)."""
    h = vf.header
    table = LayoutTable.of(h, layout)
    columns = HeaderTable.of(h.tensors)  # the header's columns: no entry object per tensor
    nnz = columns.nnz_array()
    start, stop = np.zeros_like(nnz), table.numel
    if h.part is not None:  # a part: the rows it owns (a tensor it does not own has nnz 0)
        bounds = _part_bounds(h.part.rows, columns, table)
        start, stop = bounds[:, 0] * table.row, bounds[:, 1] * table.row
    keep = np.flatnonzero((nnz > 0) & (table.index >= 0))
    out: dict[int, FilePieces] = {}
    if not keep.size:
        return out
    payload = vf.file_payload()
    widths = table.width[keep]
    for width in sorted(set(widths.tolist())):
        sel = keep[widths == width]
        sel = sel[np.argsort(table.index[sel], kind="stable")]
        out[int(width)] = FilePieces(
            payload=payload,
            file_enc=h.enc,
            names=table.names[sel].tolist(),
            encs=_encs_of(columns, sel),
            index=table.index[sel],
            numel=table.numel[sel],
            nnz=nnz[sel],
            start=start[sel],
            stop=stop[sel],
            need_lo=table.need_lo[sel],
            need_hi=table.need_hi[sel],
            header_index=sel,  # what a file with rank blocks names its split tensors by
            row_size=table.row[sel],
            need_c0=table.need_c0[sel],
            need_c1=table.need_c1[sel],
            # the whole piece lies in what the layout needs: its rows, and every column of them
            inside=(start[sel] >= table.need_lo[sel])
            & (stop[sel] <= table.need_hi[sel])
            & (table.need_c0[sel] == 0)
            & (table.need_c1[sel] == table.row[sel]),
        )
    return out


def _part_bounds(rows: Mapping[str, list[int]], columns: HeaderTable, table: LayoutTable) -> np.ndarray:
    """A part's rows [T, 2] in the header's order, (0, 0) where it owns none (format 5: its array)."""
    aligned = rows.array_for(columns.names_text) if isinstance(rows, RowMap) else None
    if aligned is not None:
        assert isinstance(rows, RowMap)
        return np.where(rows.held()[:, None], aligned, 0)
    return np.array([rows.get(n) or (0, 0) for n in table.names], dtype=np.int64).reshape(-1, 2)


def _encs_of(columns: HeaderTable, sel: np.ndarray) -> list[Any] | PieceEncs:
    """The selected pieces' `enc`: as arrays where the table has them (format 5), else the dicts."""
    arrays = columns._arrays  # noqa: SLF001 - read as arrays (format 5): no dict per piece
    if arrays is not None:
        return PieceEncs(arrays.at[sel], arrays.start[sel])
    return [columns.encs[i] for i in sel.tolist()]


_WIDTH = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def _copy_into(dst: np.ndarray, src: np.ndarray, at: int, a: int, b: int) -> None:
    dst[at : at + b - a] = src[a:b]


def _pread_pieces(
    pool: ThreadPoolExecutor, dst: np.ndarray, at: int, fd: int, offset: int, n: int
) -> list[Future[None]]:
    """dst[at : at + n] = the file's n bytes at `offset`, in pieces on the pool; `fd` is closed by the
    last piece to finish, or (when pieces are cancelled before they run) by the last cancellation."""
    starts = range(0, n, READ_PIECE_BYTES)
    left = [len(starts)]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            os.close(fd)

    def piece(s: int) -> None:
        try:
            mapped_files.pread_into(dst, at + s, fd, offset + s, min(n, s + READ_PIECE_BYTES) - s)
        finally:
            one_done()

    futures = [pool.submit(piece, s) for s in starts]
    for f in futures:
        f.add_done_callback(lambda f: one_done() if f.cancelled() else None)
    return futures
