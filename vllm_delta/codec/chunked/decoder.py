"""`ChunkedDecoder`: a server's staging decoder of chunked files (the interface of codec/decoding.py).

Per file of the pieces given: its streams checked, the chunks holding the pieces' elements found
(the others are skipped) and cut into runs. A run's host work is a copy of its compressed bytes into
pinned memory (GPU path: nvCOMP verifies and inflates it on the device, runs of up to GPU_RUN_ELEMS
elements per call) or the verification and decompression of its frames by zstandard into pinned
memory (CPU path). Its device work decodes the planes in runs of up to `host.chunk_elems` elements,
every tensor of a run at once (no per-tensor work: what mixture-of-experts models need).

A GPU failure (out of memory, nvCOMP) moves the rest of the file to the CPU path with a log line;
a corrupt chunk is a CodecError naming the version, a tensor and the chunk on either path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from ...bits import INT_DTYPE
from ...errors import CodecError, PositionError
from ..decoding import Chunk, Fetch, FilePieces, Pieces, StagingHost, ctx_of, files_of
from . import gpu
from .decode import Carry, Spans, decode_planes
from .planes import COL_BIG, COL_HASH, N_PLANES, PLANES
from .streams import FileStreams, piece_at

log = logging.getLogger(__name__)

GPU_RUN_ELEMS = 1 << 27  # GPU path: elements per nvCOMP call (3.3 B each of device planes): few
# calls (~10 ms each on an H100 whatever their size, benchmarks/codec_calls.py); Qwen3-8B at 1% is one


class ChunkedDecoder:
    """The chunked codec's staging decoder (stateless: each `plan` holds one decode's state)."""

    def plan(self, version: int, pieces: Pieces, width: int, host: StagingHost) -> _Plan:
        return _Plan([_File(version, f, width, host) for f in files_of(pieces)])


class _Run(NamedTuple):
    """Chunks [k0, k1) of one file; `fresh`: the run does not continue the previous one (chunks
    were skipped in between, so no gap chain runs into it)."""

    file: _File
    k0: int
    k1: int
    fresh: bool


class _Plan:
    """Every file's runs, file after file (base.DecodePlan)."""

    def __init__(self, files: list[_File]):
        self.units = [run for f in files for run in f.runs]

    def fetch(self, unit: _Run) -> Fetch:
        return unit.file.fetch(unit)

    def decode(self, unit: _Run, fetched: Fetch) -> Iterator[Chunk]:
        return unit.file.decode(unit, fetched)


class _File:
    """One file's decode: its streams and spans, its path (the nvCOMP backend, or None: the CPU),
    and the gap chain carried from one run into the next."""

    def __init__(self, version: int, pieces: FilePieces, width: int, host: StagingHost):
        self.version, self.names, self.width, self.host = version, pieces.names, width, host
        at, start = _offsets(version, pieces)
        self.streams = FileStreams(pieces.payload, pieces.file_enc, ctx_of(version, self.names[0]))
        e = self.streams.chunk_elems
        self.spans = Spans.of(at, pieces.nnz, start, pieces.stop, np.arange(len(pieces), dtype=np.int64))
        self.spans.check(self.streams.n, self.ctx_of)
        needed, self.owner = self.spans.chunks(e, self.streams.layout.chunks)
        dev = host.device
        self.nb = dev.type == "cuda"
        backend, why = gpu.backend(dev)  # (None, why) off CUDA, or without nvCOMP
        self.backend: gpu.GpuZstd | None = backend
        gpu.note_path("decodes", f"on {dev} with nvCOMP {backend.version}" if backend else f"on the CPU: {why}")
        self.index_np = pieces.index[self.spans.key]
        self.index_of = torch.from_numpy(self.index_np).to(dev, non_blocking=self.nb)
        self.per_decode = max(1, host.chunk_elems // e)
        per_run = max(self.per_decode, GPU_RUN_ELEMS // e) if backend is not None else self.per_decode
        self.runs = [_Run(self, k0, k1, fresh) for k0, k1, fresh in _chunk_runs(needed, per_run)]
        self.raw = self.streams.blob.numpy()
        self.compressed: set[int] = set()  # runs (by first chunk) fetched as compressed bytes
        self.carry = Carry()

    def ctx_of(self, i: int) -> dict[str, Any]:
        """Where an error about span i happened."""
        return ctx_of(self.version, self.names[int(self.spans.key[i])])

    def ctx_of_chunk(self, k: int) -> dict[str, Any]:
        return self.ctx_of(int(self.owner[k])) if self.owner[k] >= 0 else ctx_of(self.version, self.names[0])

    def fetch(self, run: _Run) -> Fetch:
        """The run's compressed bytes into pinned memory (GPU path), or its frames verified and
        decompressed there (CPU path: zstandard's own threads, one task a run keeps the GIL free)."""
        k0, k1 = run.k0, run.k1
        if self.backend is not None:
            self.compressed.add(k0)
            return self.host.read(self.raw, int(self.streams.chunk_starts[k0]), int(self.streams.chunk_starts[k1]))
        planes = self.host.buffer(self.streams.range_layout(k0, k1).size, torch.uint8)
        return Fetch([self.host.submit(lambda: self._inflate_cpu(run, planes))], planes)

    def _inflate_cpu(self, run: _Run, out: torch.Tensor) -> None:
        self.streams.decompress_run((run.k0, run.k1), out.numpy(), self.ctx_of_chunk, self.host.threads)

    def decode(self, run: _Run, fetched: Fetch) -> Iterator[Chunk]:
        k0, k1 = run.k0, run.k1
        if run.fresh:
            self.carry.clear()  # a run after skipped chunks: no gap chain continues into it
        data = fetched.data
        assert data is not None
        buf: torch.Tensor | None = None
        if self.backend is not None:
            try:
                buf = self._inflate_gpu(self.backend, run, data)
            except (CodecError, PositionError):
                raise
            except Exception as exc:  # noqa: BLE001 - OOM, nvCOMP failure: the CPU path reads the same bytes
                log.warning("vllm-delta: GPU decode of version %s failed, decoding on the CPU: %s", self.version, exc)
                gpu.note_path("decodes", f"on the CPU after a GPU failure ({type(exc).__name__})")
                self.backend = None
            self.host.restart()
        if buf is None:
            if k0 in self.compressed:  # fell back after reading the compressed bytes
                data = self.host.buffer(self.streams.range_layout(k0, k1).size, torch.uint8)
                self._inflate_cpu(run, data)
            buf = data.to(self.host.device, non_blocking=self.nb)
            self.host.mark("h2d")
        yield from self._decode_planes(run, buf)

    def _decode_planes(self, run: _Run, buf: torch.Tensor) -> Iterator[Chunk]:
        """The run's planes (`buf`, on the device) in sub-runs of `per_decode` chunks."""
        k0, k1 = run.k0, run.k1
        e, streams = self.streams.chunk_elems, self.streams
        views = streams.views(k0, k1, buf, self.host.device)
        for j0 in range(0, k1 - k0, self.per_decode):
            j1 = min(k1 - k0, j0 + self.per_decode)
            g0, m0 = streams.escape_offsets(k0, k0 + j0)
            g1, m1 = streams.escape_offsets(k0, k0 + j1)
            sub = views.sub(j0, j1, ((g0, g1), (m0, m1)))
            out = decode_planes(sub, (k0 + j0) * e, self.spans, self.carry, self.ctx_of)
            if not out.counts.size:
                continue
            layout_idx = self.index_np[out.first : out.first + out.counts.size].tolist()
            chunk = Chunk(
                t_idx=self.index_of[out.span],
                p=out.positions,
                diffs=out.diffs.to(INT_DTYPE[self.width]),
                values=None,
                runs=list(zip(layout_idx, out.counts.tolist())),
            )
            self.host.mark("decode")
            yield chunk

    def _inflate_gpu(self, backend: gpu.GpuZstd, run: _Run, host: torch.Tensor) -> torch.Tensor:
        """GPU path of one run of chunks: its compressed bytes to the device, each chunk's hash
        checked there, its frames decompressed by nvCOMP into a planes buffer (sizes checked)."""
        k0, k1 = run.k0, run.k1
        streams = self.streams
        dev = self.host.device
        blob = host.to(dev, non_blocking=True)
        self.host.mark("h2d")
        want = torch.from_numpy(streams.index[k0:k1, COL_HASH].copy()).to(dev, non_blocking=True)
        got = gpu.hashes(blob, streams.chunk_bytes[k0:k1])
        bad = (got != want).nonzero().reshape(-1)
        if bad.numel():
            k = k0 + int(bad[0])
            raise streams.corrupt(k, self.ctx_of_chunk(k))
        layout = streams.range_layout(k0, k1)
        out = torch.empty(layout.size, dtype=torch.uint8, device=dev)
        dst_off, dst_size = layout.frames(streams.index[k0:k1, COL_BIG])
        src_off = streams.blob_offsets[k0:k1] - streams.chunk_starts[k0]
        src_size = streams.index[k0:k1, :N_PLANES]
        used = dst_size.reshape(-1) > 0
        sizes = backend.decompress(
            blob,
            src_off.reshape(-1)[used],
            src_size.reshape(-1)[used],
            out,
            dst_off.reshape(-1)[used],
            dst_size.reshape(-1)[used],
        )
        short = np.flatnonzero(sizes != dst_size.reshape(-1)[used])
        if short.size:
            frame = np.flatnonzero(used)[short[0]]
            k = k0 + int(frame) // N_PLANES
            ctx = self.ctx_of_chunk(k)
            raise CodecError(
                f"chunk {k}: {PLANES[int(frame) % N_PLANES]} frame decompressed to "
                f"{int(sizes[short[0]])} B, expected {int(dst_size.reshape(-1)[used][short[0]])}",
                version=ctx.get("version"),
                tensor=ctx.get("tensor"),
            )
        self.host.mark("inflate")
        return out


def _offsets(version: int, pieces: FilePieces) -> tuple[np.ndarray, np.ndarray]:
    """Each piece's first element in the file's streams and the start of its gap chain (its `enc`),
    checked (CodecError naming the tensor): one pass, no per-piece objects."""
    n = len(pieces)
    at, start = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for k, enc in enumerate(pieces.encs):
        try:
            at[k], start[k] = int(enc["at"]), int(enc.get("start", 0))
        except (KeyError, TypeError, ValueError, AttributeError):
            piece_at(enc, int(pieces.numel[k]), ctx_of(version, pieces.names[k]))  # raises, naming the tensor
            raise
    bad = np.flatnonzero((at < 0) | (start < 0) | (start > pieces.numel))
    if bad.size:
        k = int(bad[0])
        piece_at(pieces.encs[k], int(pieces.numel[k]), ctx_of(version, pieces.names[k]))  # raises
    moved = np.flatnonzero(start != pieces.start)
    if moved.size:
        k = int(moved[0])
        raise CodecError(
            f"piece starts at {start[k]}, its part's rows at {pieces.start[k]}", version=version, tensor=pieces.names[k]
        )
    return at, start


def _chunk_runs(needed: np.ndarray, per_run: int) -> list[tuple[int, int, bool]]:
    """Runs of needed chunks [k0, k1) of at most `per_run` chunks; `fresh`: the run does not
    continue the previous one (chunks were skipped in between)."""
    out: list[tuple[int, int, bool]] = []
    k, n = 0, needed.size
    while k < n:
        if not needed[k]:
            k += 1
            continue
        fresh = not out or out[-1][1] != k
        stop = k
        while stop < n and needed[stop] and stop - k < per_run:
            stop += 1
        out.append((k, stop, fresh))
        k = stop
    return out
