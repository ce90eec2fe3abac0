"""Staging, host and device decode: a version file -> its changes on the device, in chunks.

`compact` payloads (docs/FORMAT.md) take a fast path built for one large version at a time:

* host: every zstd frame of every tensor is independent, so a thread pool decompresses them all
  in parallel (zstandard releases the GIL), largest first, straight into one pinned buffer laid
  out as [gap low bytes | gap high bytes | diff codes] over all frames of the version (3 B per
  changed element; escape tables are small and separate);
* one host-to-device copy (on the caller's stream: the engine's side stream);
* device: widen, patch escapes, prefix sums per frame and range checks, vectorized over all the
  frames of a chunk (a few million elements), not per tensor.

It validates what docs/FORMAT.md says readers validate, with the same exceptions as
`vllm_delta.codec` (tests compare the two on the same files). `raw` payloads are copied through
pinned memory and checked on the device. Any other codec goes through the codec's own
`unpack`/`finish`, one tensor at a time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import zstandard

from .. import codec as codecs
from ..bits import INT_DTYPE, int_view
from ..codec import chunked, gpu
from ..errors import CodecError, PositionError
from ..format import DTYPES, STREAMS_FORMAT_VERSION, VersionLike
from .layout import DeviceLayout

log = logging.getLogger(__name__)

CHUNK_ELEMS = 1 << 23  # changed elements decoded per device chunk (bounds temporary memory)
GPU_RUN_ELEMS = 1 << 27  # chunked, GPU path: elements per nvCOMP call (3.3 B each of device planes): few
# calls (~10 ms each on an H100 whatever their size, benchmarks/codec_calls.py); Qwen3-8B at 1% is one
READ_PIECE_BYTES = 4 << 20  # compressed bytes copied into pinned memory per task


@dataclass
class Item:
    """One piece of a changed tensor of a version (a one-file version has one piece per changed
    tensor; a multi-part version one per part that changed it), in the engine's layout order."""

    index: int  # tensor index in the engine's layout order
    name: str
    numel: int
    nnz: int
    enc: dict
    parts: dict  # the payload, by part name
    dtype: torch.dtype  # the tensor's dtype (header)
    start: int = 0  # the piece's positions lie in [start, end)
    stop: int | None = None  # None: numel

    @property
    def end(self) -> int:
        return self.numel if self.stop is None else min(self.stop, self.numel)


@dataclass
class FilePieces:
    """The changed pieces of one format-3 file (a chunked codec's file) that a layout holds, as
    arrays in layout order: what staging a mixture of experts needs (~19K tensors per version) with
    no per-tensor objects. Built straight from a one-file version's header (`changed_items`) or from
    Items (`of_items`: multi-part versions, chains)."""

    payload: Mapping[str, torch.Tensor]  # the file's streams
    file_enc: Any  # the file's codec metadata
    names: list[str]
    index: np.ndarray  # int64: tensor index in the engine's layout order
    nnz: np.ndarray  # int64
    at: np.ndarray  # int64: the piece's first element in the file's streams
    start: np.ndarray  # int64: its positions lie in [start, stop)
    stop: np.ndarray

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of_items(cls, version: int, items: list[Item]) -> FilePieces:
        """Pieces of one file (sharing its payload); their `enc` checked (CodecError)."""
        at, start = np.empty(len(items), dtype=np.int64), np.empty(len(items), dtype=np.int64)
        for k, it in enumerate(items):
            at[k], start[k] = chunked.piece_at(it.enc, it.numel, _ctx(version, it.name))
            if start[k] != it.start:
                raise CodecError(
                    f"piece starts at {start[k]}, its part's rows at {it.start}", version=version, tensor=it.name
                )
        return cls(
            payload=items[0].parts,
            file_enc=items[0].enc.get("file"),
            names=[it.name for it in items],
            index=np.array([it.index for it in items], dtype=np.int64),
            nnz=np.array([it.nnz for it in items], dtype=np.int64),
            at=at,
            start=start,
            stop=np.array([it.end for it in items], dtype=np.int64),
        )


Items = list[Item] | FilePieces  # a version's changed tensors of one element width


def item_indices(items: Items) -> list[int]:
    """The layout indices of the tensors `items` changes."""
    if isinstance(items, FilePieces):
        return items.index.tolist()
    return [it.index for it in items]


@dataclass
class Chunk:
    """Decoded changes of consecutive tensors (or of part of one), on the device."""

    t_idx: torch.Tensor  # int64: tensor index (layout order) of each element
    p: torch.Tensor  # int64: row-major position in its tensor (sorted within a tensor)
    diffs: torch.Tensor | None  # int16/int32 (element width): new - old bits, mod 2^bits
    values: torch.Tensor | None  # int16/int32: absolute new bits
    runs: list[tuple[int, int]]  # (tensor index, element count), in element order

    @property
    def tensors(self) -> list[int]:
        return [t for t, n in self.runs if n]

    @property
    def n(self) -> int:
        return int(self.p.numel())


class _FrameJob(NamedTuple):
    """One compact frame to decompress, and where its output goes in the version's host buffers."""

    item: int  # index into the decoded items
    offset: int  # byte offset of the frame in its item's blob
    frame: codecs.Frame
    elem: int  # first element in the planes
    gap_at: int  # first entry in the gap escape buffer
    diff_at: int  # first entry in the value escape buffer


def _ctx(version: int, name: str) -> dict:
    return {"version": version, "tensor": name}


def _kw(ctx: dict) -> dict:
    return {"version": ctx.get("version"), "tensor": ctx.get("tensor")}


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


def _threads() -> int:
    env = os.environ.get("VLLM_DELTA_STAGE_THREADS")
    return max(1, int(env)) if env else max(1, min(32, os.cpu_count() or 1))


class Decoder:
    """Decodes versions for one engine: a thread pool, reused pinned buffers, per-phase timings."""

    def __init__(self, device: torch.device, chunk_elems: int = CHUNK_ELEMS, threads: int | None = None):
        self.device = device
        self.chunk_elems = chunk_elems
        self.n_threads = threads or _threads()
        self._pool: ThreadPoolExecutor | None = None
        self._tls = threading.local()
        self.host_bytes = 0  # pinned / host staging bytes of the last decode

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.n_threads, thread_name_prefix="vllm-delta-stage")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._tls, "dctx", None)
        if d is None:
            d = self._tls.dctx = zstandard.ZstdDecompressor()
        return d

    def _host(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.empty(n, dtype=dtype, pin_memory=pin)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _span(self, timings: dict, key: str, t0: float, sync: bool = True) -> float:
        if sync:
            self._sync()
        t1 = time.perf_counter()
        timings[key] = timings.get(key, 0.0) + (t1 - t0) * 1e3
        return t1

    # -- entry point -----------------------------------------------------------------------------
    def decode(self, version: int, codec: str, items: Items, width: int, timings: dict):
        """Yield Chunks covering `items` (changed tensors of one element width, in layout order)."""
        if isinstance(items, FilePieces):
            if codec != "chunked":
                raise CodecError(f"pieces of a format-3 file named codec {codec!r}", version=version)
            if len(items):
                yield from self._chunked_file(version, items, width, timings)
            return
        items = [it for it in items if it.nnz]
        if not items:
            return
        if codec == "chunked":
            yield from self._chunked(version, items, width, timings)
        elif codec == "compact":
            yield from self._compact(version, items, width, timings)
        elif codec == "raw":
            yield from self._raw(version, items, width, timings)
        else:
            yield from self._generic(version, codec, items, width, timings)

    # -- chunked (format 3): one set of streams per file -----------------------------------------
    def _chunked(self, version, items, width, timings):
        files: dict[int, list[Item]] = {}  # a file's pieces share its payload dict (format.VersionFile)
        for it in items:
            files.setdefault(id(it.parts), []).append(it)
        for pieces in files.values():
            yield from self._chunked_file(version, FilePieces.of_items(version, pieces), width, timings)

    def _chunked_file(self, version, items: FilePieces, width: int, timings: dict):
        """Every chunk of one file that holds elements of `items`, in file order: verified and
        decompressed by nvCOMP on the device (GPU path, runs of up to GPU_RUN_ELEMS elements per
        call) or by zstandard on the thread pool into pinned memory (CPU path, running ahead of the
        device), then decoded on the device in runs of up to `chunk_elems` elements, every tensor of
        a run at once (no per-tensor work: what mixture-of-experts models need)."""
        t0 = time.perf_counter()
        names = items.names
        streams = chunked.FileStreams(items.payload, items.file_enc, _ctx(version, names[0]))
        e = streams.chunk_elems
        spans = chunked.Spans.of(items.at, items.nnz, items.start, items.stop, np.arange(len(items), dtype=np.int64))

        def ctx_of(i: int) -> dict:
            return _ctx(version, names[int(spans.key[i])])

        spans.check(streams.n, ctx_of)
        needed, owner = spans.chunks(e, streams.layout.chunks)
        dev = self.device
        nb = dev.type == "cuda"
        backend, why = gpu.backend(dev) if nb else (None, "the engine is on the CPU")
        gpu.note_path("decodes", f"on {dev} with nvCOMP {backend.version}" if backend else f"on the CPU: {why}")
        index_np = items.index[spans.key]
        index_of = torch.from_numpy(index_np).to(dev, non_blocking=nb)
        per_decode = max(1, self.chunk_elems // e)
        runs = _chunk_runs(needed, max(per_decode, GPU_RUN_ELEMS // e) if backend is not None else per_decode)
        raw = streams.blob.numpy()

        def ctx_of_chunk(k: int) -> dict:
            return ctx_of(int(owner[k])) if owner[k] >= 0 else _ctx(version, names[0])

        def read_blob(run: tuple[int, int]) -> tuple[torch.Tensor, list]:
            """The run's compressed bytes into pinned memory, in pieces on the pool's threads (the
            read: page cache or disk; numpy copies without the GIL, so the pieces run in parallel)."""
            a, b = int(streams.chunk_starts[run[0]]), int(streams.chunk_starts[run[1]])
            buf = self._host(b - a, torch.uint8)
            dst = buf.numpy()
            return buf, [
                self.pool.submit(_copy_into, dst, raw, s - a, s, min(b, s + READ_PIECE_BYTES))
                for s in range(a, b, READ_PIECE_BYTES)
            ]

        def inflate_cpu(run: tuple[int, int], buf: torch.Tensor) -> None:
            streams.decompress_run(run, buf.numpy(), ctx_of_chunk, self.n_threads)

        # the host work of every run is queued at once and runs ahead of the device
        hosts: list[torch.Tensor] = []
        futures: list[list] = []
        for k0, k1, _ in runs:
            if backend is not None:
                blob, reads = read_blob((k0, k1))
                hosts.append(blob)
                futures.append(reads)
            else:
                planes = self._host(streams.range_layout(k0, k1).size, torch.uint8)
                hosts.append(planes)
                # zstandard decompresses a run's frames on its own threads: one task a run keeps the GIL free
                futures.append([self.pool.submit(inflate_cpu, (k0, k1), planes)])
        self.host_bytes = 0
        carry = chunked.Carry()
        try:
            for r, (k0, k1, fresh) in enumerate(runs):
                if fresh:
                    carry.clear()  # a run after skipped chunks: no gap chain continues into it
                for f in futures[r]:
                    f.result()
                host = hosts[r]
                self.host_bytes += host.numel()
                t0 = self._span(timings, "read", t0, sync=False)
                buf: torch.Tensor | None = None
                if backend is not None:
                    try:
                        buf = self._inflate(streams, backend, (k0, k1), host, ctx_of_chunk, timings)
                    except (CodecError, PositionError):
                        raise
                    except Exception as exc:  # noqa: BLE001 - OOM, nvCOMP failure: the CPU path reads the same bytes
                        log.warning(
                            "vllm-delta: GPU decode of version %s failed, decoding on the CPU: %s", version, exc
                        )
                        gpu.note_path("decodes", f"on the CPU after a GPU failure ({type(exc).__name__})")
                        backend = None
                    t0 = time.perf_counter()
                if buf is None:
                    if host.numel() != streams.range_layout(k0, k1).size:  # fell back after reading the blob
                        host = self._host(streams.range_layout(k0, k1).size, torch.uint8)
                        inflate_cpu((k0, k1), host)
                    buf = host.to(dev, non_blocking=nb)
                    t0 = self._span(timings, "h2d", t0)
                views = streams.views(k0, k1, buf, dev)
                for j0 in range(0, k1 - k0, per_decode):
                    j1 = min(k1 - k0, j0 + per_decode)
                    g0, m0 = streams.escape_offsets(k0, k0 + j0)
                    g1, m1 = streams.escape_offsets(k0, k0 + j1)
                    sub = views.sub(j0, j1, ((g0, g1), (m0, m1)))
                    out = chunked.decode_planes(sub, (k0 + j0) * e, spans, carry, ctx_of)
                    if not out.counts.size:
                        continue
                    layout_idx = index_np[out.first : out.first + out.counts.size].tolist()
                    chunk = Chunk(
                        t_idx=index_of[out.span],
                        p=out.positions,
                        diffs=out.diffs.to(INT_DTYPE[width]),
                        values=None,
                        runs=list(zip(layout_idx, out.counts.tolist())),
                    )
                    t0 = self._span(timings, "decode", t0)
                    yield chunk
                    t0 = time.perf_counter()
        finally:
            for fs in futures:
                for fut in fs:
                    fut.cancel()
            self._sync()

    def _inflate(self, streams, backend, run, host, ctx_of_chunk, timings) -> torch.Tensor:
        """GPU path of one run of chunks: its compressed bytes to the device, each chunk's hash
        checked there, its frames decompressed by nvCOMP into a planes buffer (sizes checked)."""
        k0, k1 = run
        t0 = time.perf_counter()
        dev = self.device
        blob = host.to(dev, non_blocking=True)
        t0 = self._span(timings, "h2d", t0)
        want = torch.from_numpy(streams.index[k0:k1, chunked.COL_HASH].copy()).to(dev, non_blocking=True)
        got = gpu.hashes(blob, streams.chunk_bytes[k0:k1])
        bad = (got != want).nonzero().reshape(-1)
        if bad.numel():
            k = k0 + int(bad[0])
            raise streams.corrupt(k, ctx_of_chunk(k))
        layout = streams.range_layout(k0, k1)
        out = torch.empty(layout.size, dtype=torch.uint8, device=dev)
        dst_off, dst_size = layout.frames(streams.index[k0:k1, chunked.COL_BIG])
        src_off = streams.blob_offsets[k0:k1] - streams.chunk_starts[k0]
        src_size = streams.index[k0:k1, : chunked.N_PLANES]
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
            k = k0 + int(frame) // chunked.N_PLANES
            raise CodecError(
                f"chunk {k}: {chunked.PLANES[int(frame) % chunked.N_PLANES]} frame decompressed to "
                f"{int(sizes[short[0]])} B, expected {int(dst_size.reshape(-1)[used][short[0]])}",
                **_kw(ctx_of_chunk(k)),
            )
        self._span(timings, "inflate", t0)
        return out

    # -- compact ---------------------------------------------------------------------------------
    def _compact(self, version, items, width, timings):
        t0 = time.perf_counter()
        jobs: list[_FrameJob] = []
        blobs = []
        elem = ge_at = de_at = 0
        for k, it in enumerate(items):
            blob = it.parts.get("blob")
            frames = codecs.parse_frames(blob, it.enc, it.nnz, _ctx(version, it.name))
            blobs.append(blob.numpy().data)
            offset = 0
            for f in frames:
                jobs.append(_FrameJob(k, offset, f, elem, ge_at, de_at))
                offset, elem = offset + f.nbytes, elem + f.elems
                ge_at, de_at = ge_at + f.gap_escapes, de_at + f.diff_escapes
        total = elem
        planes_t = self._host(3 * total, torch.uint8)
        ge_t = self._host(ge_at, torch.int64)
        de_t = self._host(de_at, INT_DTYPE[width])
        self.host_bytes = planes_t.numel() + ge_t.numel() * 8 + de_t.numel() * width
        planes, ge_all, de_all = planes_t.numpy(), ge_t.numpy(), de_t.numpy()

        def work(job: _FrameJob) -> None:
            it, f, e = items[job.item], job.frame, job.elem
            fa = codecs.decompress_frame(
                self._dctx(), blobs[job.item], job.offset, f, width, it.numel, _ctx(version, it.name)
            )
            planes[e : e + f.elems] = fa.gap_lo
            planes[total + e : total + e + f.elems] = fa.gap_hi
            planes[2 * total + e : 2 * total + e + f.elems] = fa.d8.view(np.uint8)
            ge_all[job.gap_at : job.gap_at + f.gap_escapes] = fa.gap_esc
            de_all[job.diff_at : job.diff_at + f.diff_escapes] = fa.diff_esc

        # Decompression runs ahead on the pool (frames in order) while this thread copies each
        # finished chunk to the device and decodes it there: host and device work overlap.
        pooled = len(jobs) > 1 and self.n_threads > 1
        futures = [self.pool.submit(work, job) for job in jobs] if pooled else None
        dev = self.device
        nb = dev.type == "cuda"
        order = codecs.FrameOrder()  # per piece, positions keep rising across frames and chunks
        for k, it in enumerate(items):
            order.begin(k, it.start)
        try:
            i = 0
            while i < len(jobs):
                j, size = i, 0
                while j < len(jobs) and (j == i or size + jobs[j].frame.elems <= self.chunk_elems):
                    size += jobs[j].frame.elems
                    j += 1
                for k in range(i, j):
                    if futures is not None:
                        futures[k].result()
                    else:
                        work(jobs[k])
                t0 = self._span(timings, "read", t0, sync=False)
                chunk_jobs = jobs[i:j]
                a, b = chunk_jobs[0].elem, chunk_jobs[-1].elem + chunk_jobs[-1].frame.elems
                ga, gb = chunk_jobs[0].gap_at, chunk_jobs[-1].gap_at + chunk_jobs[-1].frame.gap_escapes
                da, db = chunk_jobs[0].diff_at, chunk_jobs[-1].diff_at + chunk_jobs[-1].frame.diff_escapes
                lo = planes_t[a:b].to(dev, non_blocking=nb)
                hi = planes_t[total + a : total + b].to(dev, non_blocking=nb)
                d8 = planes_t[2 * total + a : 2 * total + b].to(dev, non_blocking=nb)
                ge = ge_t[ga:gb].to(dev, non_blocking=nb)
                de = de_t[da:db].to(dev, non_blocking=nb)
                t0 = self._span(timings, "h2d", t0)
                chunk = self._compact_chunk(version, items, chunk_jobs, lo, hi, d8, ge, de, width, order)
                t0 = self._span(timings, "decode", t0)
                if chunk is not None:
                    yield chunk
                t0 = time.perf_counter()
                i = j
        finally:
            if futures:
                for fut in futures:
                    fut.cancel()
            self._sync()  # the copies out of the pinned buffers are done before they are reused

    def _compact_chunk(self, version, items, jobs, lo, hi, d8, ge, de, width, order) -> Chunk | None:
        """Device decode of the frames of one chunk: positions and diffs, checked."""

        def ctx_of(f: int) -> dict:
            return _ctx(version, items[jobs[f].item].name)

        frames = [job.frame for job in jobs]
        if lo.numel() == 0:
            for f, job in enumerate(jobs):
                order.check(job.item, job.frame, None, items[job.item].end, ctx_of(f))
            return None
        gaps = lo.to(torch.int64).bitwise_or_(hi.to(torch.int64).bitwise_left_shift_(8))
        diffs = d8.view(torch.int8).to(INT_DTYPE[width])
        p, d, frame_of = codecs.decode_frames(gaps, diffs, ge, de, frames, ctx_of)
        counts = np.array([f.elems for f in frames], dtype=np.int64)
        ends = np.cumsum(counts) - 1
        nonempty = np.flatnonzero(counts)
        lasts = dict(zip(nonempty.tolist(), p[torch.from_numpy(ends[nonempty]).to(p.device)].tolist()))
        for f, job in enumerate(jobs):
            order.check(job.item, job.frame, lasts.get(f), items[job.item].end, ctx_of(f))
        idx = torch.from_numpy(np.array([items[job.item].index for job in jobs], dtype=np.int64)).to(p.device)
        t_idx = idx[frame_of]
        runs: list[tuple[int, int]] = []
        for job in jobs:
            t = items[job.item].index
            if runs and runs[-1][0] == t:
                runs[-1] = (t, runs[-1][1] + job.frame.elems)
            else:
                runs.append((t, job.frame.elems))
        return Chunk(t_idx=t_idx, p=p, diffs=d, values=None, runs=runs)

    # -- raw -------------------------------------------------------------------------------------
    def _raw(self, version, items, width, timings):
        t0 = time.perf_counter()
        sections = []
        for it in items:
            ctx = {"version": version, "tensor": it.name}
            sec = codecs.get_codec("raw", ctx).unpack(
                it.parts, it.enc, numel=it.numel, nnz=it.nnz, dtype=it.dtype, ctx=ctx
            )
            sections.append(sec)
        total = sum(it.nnz for it in items)
        pos_t = self._host(total, torch.int64)
        val_t = self._host(total, INT_DTYPE[width])
        self.host_bytes = total * (8 + width)
        pos, val = pos_t.numpy(), val_t.numpy()
        bounds, at = [], 0
        for it, sec in zip(items, sections):
            pos[at : at + it.nnz] = sec.arrays["idx"]
            val[at : at + it.nnz] = sec.arrays["val"]
            bounds.append((at, at + it.nnz))
            at += it.nnz
        t0 = self._span(timings, "read", t0, sync=False)
        nb = self.device.type == "cuda"
        pos_d = pos_t.to(self.device, non_blocking=nb)
        val_d = val_t.to(self.device, non_blocking=nb)
        t0 = self._span(timings, "h2d", t0)
        for group in _groups([it.nnz for it in items], self.chunk_elems):
            a, b = bounds[group[0]][0], bounds[group[-1]][1]
            p = pos_d[a:b]
            idx = torch.tensor([items[k].index for k in group], dtype=torch.int64, device=self.device)
            cnt = torch.tensor([items[k].nnz for k in group], dtype=torch.int64, device=self.device)
            seg = codecs.segment_ids(cnt, b - a)
            t_idx = idx[seg]
            lo = torch.tensor([items[k].start for k in group], dtype=torch.int64, device=self.device)
            hi = torch.tensor([items[k].end for k in group], dtype=torch.int64, device=self.device)
            bad = (p < lo[seg]) | (p >= hi[seg])
            if b - a > 1:
                bad[1:] |= (p[1:] <= p[:-1]) & (t_idx[1:] == t_idx[:-1])
            if bool(bad.any()):
                for k in group:  # find the tensor and raise the codec's own message
                    s, e = bounds[k]
                    ctx = {"version": version, "tensor": items[k].name}
                    codecs.check_positions(pos_d[s:e], items[k].numel, ctx)
                    codecs.check_piece(pos_d[s:e], items[k].start, items[k].end, ctx)
                raise PositionError("invalid positions", version=version, tensor=items[group[0]].name)
            t0 = self._span(timings, "decode", t0)
            yield Chunk(
                t_idx=t_idx, p=p, diffs=None, values=val_d[a:b], runs=[(items[k].index, items[k].nnz) for k in group]
            )
            t0 = time.perf_counter()

    # -- any other codec: its own unpack/finish, one tensor at a time ----------------------------
    def _generic(self, version, codec, items, width, timings):
        c = codecs.get_codec(codec, {"version": version})
        for it in items:
            ctx = {"version": version, "tensor": it.name}
            t0 = time.perf_counter()
            sec = c.unpack(it.parts, it.enc, numel=it.numel, nnz=it.nnz, dtype=it.dtype, ctx=ctx)
            t0 = self._span(timings, "read", t0, sync=False)
            ch = c.finish(sec, numel=it.numel, device=self.device, ctx=ctx)
            pos = ch.positions.to(torch.int64)
            codecs.check_piece(pos, it.start, it.end, ctx)
            t_idx = torch.full_like(pos, it.index)
            vals = diffs = None
            if ch.values is not None:
                vals = int_view(ch.values).to(INT_DTYPE[width])
            elif ch.diffs is not None:
                diffs = ch.diffs.to(torch.int64).to(INT_DTYPE[width])
            self._span(timings, "decode", t0)
            yield Chunk(t_idx=t_idx, p=pos, diffs=diffs, values=vals, runs=[(it.index, int(pos.numel()))])


def changed_items(vf: VersionLike, layout: DeviceLayout) -> dict[int, Items]:
    """A delta's changed tensors that this layout holds any of, by element width, in layout order:
    one Item per piece, the pieces of one tensor adjacent and in position order (a one-file
    format-3 version: FilePieces, arrays read straight off the header)."""
    h = vf.header
    file_payload = getattr(vf, "file_payload", None)
    if h.format_version == STREAMS_FORMAT_VERSION and h.part is None and file_payload is not None:
        fast = _file_pieces(vf, layout, file_payload())
        if fast is not None:
            return fast
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


def _file_pieces(vf: VersionLike, layout: DeviceLayout, payload: Mapping[str, torch.Tensor]) -> dict[int, Items] | None:
    """`changed_items` of a one-file format-3 version, one pass over its header entries into arrays.
    None when an entry's `enc` is malformed (the per-item path then names the tensor)."""
    h = vf.header
    segments, index = layout.layout.segments, layout.index
    rows: dict[int, tuple[list[str], list[tuple[int, int, int, int]]]] = {}
    try:
        for name, entry in h.tensors.items():
            if entry.nnz and segments.get(name):
                names, vals = rows.setdefault(_WIDTH[entry.dtype], ([], []))
                names.append(name)
                vals.append((index[name], entry.nnz, int(entry.enc["at"]), int(entry.enc.get("start", 0))))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    out: dict[int, Items] = {}
    for width, (names, vals) in rows.items():
        table = np.array(vals, dtype=np.int64).reshape(-1, 4)
        order = np.argsort(table[:, 0], kind="stable")
        table = table[order]
        if (table[:, 2] < 0).any() or (table[:, 3] != 0).any():
            return None  # a bad offset, or a start inside a one-file tensor: the per-item path raises
        out[width] = FilePieces(
            payload=payload,
            file_enc=h.enc,
            names=[names[i] for i in order.tolist()],
            index=table[:, 0],
            nnz=table[:, 1],
            at=table[:, 2],
            start=table[:, 3],
            stop=layout.numels[table[:, 0]],
        )
    return out


_WIDTH = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def _copy_into(dst: np.ndarray, src: np.ndarray, at: int, a: int, b: int) -> None:
    dst[at : at + b - a] = src[a:b]


def _groups(sizes: list[int], limit: int) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for k, n in enumerate(sizes):
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    if cur:
        out.append(cur)
    return out
