"""Staging: a version's changed pieces -> their changes on the engine's device, in chunks.

Staging owns what is the same for every codec; the codec's decoder (codec/decoding.py, found
through the codec registry by the header's codec name) owns what is its own:

* staging: which pieces this rank needs (`changed_items`, from the engine's layout: a one-file
  format-3 version read straight off its header into arrays, `FilePieces`, with no per-tensor
  objects: a mixture of experts lists ~19K tensors), host memory (pinned buffers, reused threads,
  reading a file's bytes into them in parallel pieces), the order work runs in (every unit's host
  work queued at once on the thread pool, running ahead of the device, which takes the units in
  order on the caller's stream: the engine's side stream), per-phase timings, and the Chunks handed
  to the engine;
* the codec: its units and their host work (decompression, copies), the device decode, every
  integrity check and the errors naming version, tensor and chunk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..codec import get_decoder
from ..codec.decoding import Chunk, Fetch, FilePieces, Item, Pieces
from ..format import DTYPES, STREAMS_FORMAT_VERSION, VersionLike
from .layout import DeviceLayout

CHUNK_ELEMS = 1 << 23  # changed elements decoded per device chunk (bounds temporary memory)
READ_PIECE_BYTES = 4 << 20  # compressed bytes copied into pinned memory per task

Items = Pieces  # a version's changed tensors of one element width (codec/decoding.py)

__all__ = ["CHUNK_ELEMS", "Chunk", "Decoder", "FilePieces", "Item", "Items", "changed_items", "item_indices"]


def item_indices(items: Items) -> list[int]:
    """The layout indices of the tensors `items` changes."""
    if isinstance(items, FilePieces):
        return [int(i) for i in items.index.tolist()]
    return [it.index for it in items]


def _threads() -> int:
    env = os.environ.get("VLLM_DELTA_STAGE_THREADS")
    return max(1, int(env)) if env else max(1, min(32, os.cpu_count() or 1))


class Decoder:
    """Decodes versions for one engine: a thread pool, pinned buffers, per-phase timings. Each
    `decode` lends a codec's decoder a `_Host` (codec.decoding.StagingHost)."""

    def __init__(self, device: torch.device, chunk_elems: int = CHUNK_ELEMS, threads: int | None = None):
        self.device = device
        self.chunk_elems = chunk_elems
        self.n_threads = threads or _threads()
        self._pool: ThreadPoolExecutor | None = None
        self.host_bytes = 0  # pinned / host staging bytes of the last decode

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
        if not isinstance(items, FilePieces):
            items = [it for it in items if it.nnz]
        if not len(items):
            return
        host = _Host(self, timings)
        self.host_bytes = 0
        plan = get_decoder(codec, {"version": version}).plan(version, items, width, host)
        fetches: list[Fetch] = []
        try:
            fetches.extend(plan.fetch(unit) for unit in plan.units)  # the host work runs ahead of the device
            for unit, fetched in zip(plan.units, fetches):
                fetched.wait()
                host.mark("read", sync=False)
                for chunk in plan.decode(unit, fetched):
                    yield chunk
                    host.restart()
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

    def read(self, src: np.ndarray, a: int, b: int) -> Fetch:
        """Bytes src[a:b] into pinned memory, in pieces on the pool's threads (the read: page cache
        or disk; numpy copies without the GIL, so the pieces run in parallel)."""
        buf = self.buffer(b - a, torch.uint8)
        dst = buf.numpy()
        pool = self._decoder.pool
        return Fetch(
            [
                pool.submit(_copy_into, dst, src, s - a, s, min(b, s + READ_PIECE_BYTES))
                for s in range(a, b, READ_PIECE_BYTES)
            ],
            buf,
        )

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self._decoder.pool.submit(fn)

    def mark(self, phase: str, sync: bool = True) -> None:
        if sync:
            self._decoder.sync()
        t1 = time.perf_counter()
        self._timings[phase] = self._timings.get(phase, 0.0) + (t1 - self._t0) * 1e3
        self._t0 = t1

    def restart(self) -> None:
        self._t0 = time.perf_counter()


def changed_items(vf: VersionLike, layout: DeviceLayout) -> dict[int, Items]:
    """A delta's changed tensors that this layout holds any of, by element width, in layout order:
    one Item per piece, the pieces of one tensor adjacent and in position order (a one-file
    format-3 version: FilePieces, arrays read straight off the header)."""
    h = vf.header
    file_payload = getattr(vf, "file_payload", None)
    if h.format_version == STREAMS_FORMAT_VERSION and h.part is None and file_payload is not None:
        return _file_pieces(vf, layout, file_payload())
    return _piece_items(vf, layout)


def _piece_items(vf: VersionLike, layout: DeviceLayout) -> dict[int, Items]:
    """`changed_items` piece by piece (`vf.pieces`): multi-part versions and formats 1 and 2."""
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


def _file_pieces(vf: VersionLike, layout: DeviceLayout, payload: Mapping[str, torch.Tensor]) -> dict[int, Items]:
    """`changed_items` of a one-file format-3 version, one pass over its header entries into arrays
    (the pieces' `enc` are handed to the codec's decoder as they are: it checks them)."""
    h = vf.header
    segments, index = layout.layout.segments, layout.index
    rows: dict[int, tuple[list[str], list[Any], list[tuple[int, int, int]]]] = {}
    for name, entry in h.tensors.items():
        if entry.nnz and segments.get(name):
            names, encs, vals = rows.setdefault(_WIDTH[entry.dtype], ([], [], []))
            names.append(name)
            encs.append(entry.enc)
            vals.append((index[name], entry.nnz, entry.numel))
    out: dict[int, Items] = {}
    for width, (names, encs, vals) in rows.items():
        table = np.array(vals, dtype=np.int64).reshape(-1, 3)
        order = np.argsort(table[:, 0], kind="stable")
        table = table[order]
        picked = order.tolist()
        out[width] = FilePieces(
            payload=payload,
            file_enc=h.enc,
            names=[names[i] for i in picked],
            encs=[encs[i] for i in picked],
            index=table[:, 0],
            numel=table[:, 2],
            nnz=table[:, 1],
            start=np.zeros(len(picked), dtype=np.int64),
            stop=layout.numels[table[:, 0]],
        )
    return out


_WIDTH = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def _copy_into(dst: np.ndarray, src: np.ndarray, at: int, a: int, b: int) -> None:
    dst[at : at + b - a] = src[a:b]
