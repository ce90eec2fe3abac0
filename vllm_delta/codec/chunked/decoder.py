"""`ChunkedDecoder`: a server's staging decoder of chunked files (the interface of codec/decoding.py).

The files of one decode (one file, or every part of a multi-part version) are read as ONE sequence of
chunks (`_Sequence`: file after file, each file's chunks in order), so that a run of chunks, and with
it one nvCOMP call and one fused decode, can take chunks of several parts: a version published by W
ranks stages like one file. Per file: its streams checked, the chunks holding elements the layout
needs found (the others skipped: tensors the layout does not hold, and, where the file records each
chunk's first position, the chunks of other ranks' rows; on a GPU only gaps long enough to pay for
another run, GPU_SKIP_MIN_ELEMS), then the needed chunks cut into runs. A
run's host work is a copy of its compressed bytes into pinned memory (GPU path: nvCOMP verifies and
inflates them on the device, runs of up to GPU_RUN_ELEMS elements per call) or the verification and
decompression of its frames by zstandard into pinned memory (CPU path). Its device work decodes the
planes in runs of up to `host.chunk_elems` elements, every tensor of a run at once (no per-tensor
work: what mixture-of-experts models need).

In a run, every chunk takes chunk_elems elements of each plane, whatever it holds: a file's last
chunk (short) followed by the next file's is padded with zeros (gap 0, difference +1, in no tensor:
the decode drops them), its bits past its elements cleared.

A GPU failure (out of memory, nvCOMP) moves the rest of the decode to the CPU path with a log line;
a corrupt chunk is a CodecError naming the version, a tensor and the chunk on either path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import zstandard

from ...bits import INT_DTYPE
from ...checksums import chunk_hashes_np
from ...errors import CodecError, DeltaError, PositionError
from ..base import Ctx, err
from ..decoding import Chunk, Fetch, FilePieces, PieceEncs, Pieces, Runs, StagingHost, ctx_of, files_of
from . import gpu
from .blocks import from_block_positions
from .decode import Carry, Spans, decode_planes, recheck
from .planes import COL_HASH, N_PLANES, PLANES, PlaneLayout, PlaneViews, views_over
from .regions import has_blocks, region_pieces
from .streams import FileStreams, piece_at

log = logging.getLogger(__name__)

PAD_DEVICES = frozenset({"cuda"})  # where a run decodes a part's short last chunk padded (one fused decode)
GPU_RUN_ELEMS = 1 << 27  # GPU path: elements per nvCOMP call (3.3 B each of device planes): few
# calls (~10 ms each on an H100 whatever their size, benchmarks/codec_calls.py); Qwen3-8B at 1% is one
GPU_SKIP_MIN_ELEMS = 1 << 22  # GPU path: skipped chunks between two needed ones are decoded anyway unless they
# hold at least this many elements: each run costs an nvCOMP call, a fused decode and a host wait (~1.5 ms
# on an H200), decoding 4M elements about as much. Skipping every gap cut Qwen3-8B's staging at TP=2 into
# ~250 runs, 17x TP=1's time (benchmarks/results/issue26/stage_tp_h200x4.log).
CPU_SKIP_MIN_ELEMS = 1  # CPU path: every gap skipped (a run there is a task of zstandard frames: no fixed cost)
_TLS = threading.local()


class ChunkedDecoder:
    """The chunked codec's staging decoder (stateless: each `plan` holds one decode's state)."""

    def plan(self, version: int, pieces: Pieces, width: int, host: StagingHost) -> _Plan:
        # a file with rank blocks is read as its regions, each a file of its own (regions.py)
        files = [r for f in files_of(pieces) for r in (region_pieces(f, version) if has_blocks(f.file_enc) else [f])]
        groups: list[list[FilePieces]] = []  # consecutive files of one chunk size read as one sequence
        streams: list[list[FileStreams]] = []
        for f in files:
            s = FileStreams(f.payload, f.file_enc, ctx_of(version, f.names[0]))
            if groups and streams[-1][-1].chunk_elems == s.chunk_elems:
                groups[-1].append(f)
                streams[-1].append(s)
            else:
                groups.append([f])
                streams.append([s])
        return _Plan([_Sequence(version, g, s, width, host) for g, s in zip(groups, streams)])


class _Run(NamedTuple):
    """Chunks [g0, g1) of a sequence; `fresh`: the run does not continue the previous one (chunks
    were skipped in between, so no gap chain runs into it from a decoded chunk)."""

    seq: _Sequence
    g0: int
    g1: int
    fresh: bool


class _Pending(NamedTuple):
    """A decoded sub-run (chunks [j0, j1) of `run`) whose checks' flag is not read yet, and the gap
    chain it started from (to decode it again, checking, if the flag is set)."""

    flag: torch.Tensor
    run: _Run
    j0: int
    j1: int
    carry: Carry


class _Plan:
    """Every sequence's runs, one after the other (decoding.DecodePlan); `finish` reads every
    sequence's deferred checks."""

    def __init__(self, seqs: list[_Sequence]):
        self.seqs = seqs
        self.units = [run for s in seqs for run in s.runs]
        self.elements = sum(s.elements for s in seqs)

    def finish(self) -> None:
        for s in self.seqs:
            s.finish()

    def fetch(self, unit: _Run) -> Fetch:
        return unit.seq.fetch(unit)

    def decode(self, unit: _Run, fetched: Fetch) -> Iterator[Chunk]:
        return unit.seq.decode(unit, fetched)


class _Sequence:
    """Files of one chunk size read as one sequence of chunks: chunk g of the sequence is chunk
    `local[g]` of file `file[g]`, and its elements are the sequence's [g·E, g·E + elems[g]). Holds the
    decode's state: the spans (every file's pieces, in sequence elements), the runs, the path (the
    nvCOMP backend, or None: the CPU) and the gap chain carried from one run into the next."""

    def __init__(
        self, version: int, files: list[FilePieces], streams: list[FileStreams], width: int, host: StagingHost
    ):
        self.version, self.width, self.host = version, width, host
        self.streams = streams
        e = self.e = streams[0].chunk_elems
        self.names: list[str] = [name for f in files for name in f.names]
        counts = np.array([s.layout.chunks for s in streams], dtype=np.int64)
        self.base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # first chunk of each file
        self.file = np.repeat(np.arange(len(streams), dtype=np.int64), counts)
        self.local = np.arange(int(self.base[-1]), dtype=np.int64) - self.base[self.file]
        self.index = _cat([s.index for s in streams], (0, streams[0].index.shape[1]))
        self.elems = _cat([s.layout.elems() for s in streams], (0,))
        self.raw_sizes = _cat([s.raw_sizes for s in streams], (0, N_PLANES))
        self.chunk_bytes = _cat([s.chunk_bytes for s in streams], (0,))
        # where each frame starts in its chunk's bytes (the chunks of a run are read end to end)
        self.in_chunk = _cat([s.blob_offsets - s.chunk_starts[:-1, None] for s in streams], (0, N_PLANES))
        self.gap_esc = _cat_t([s.gap_esc for s in streams])
        self.mag_esc = _cat_t([s.mag_esc for s in streams])
        self.gap_at = _offsets_of([s.gap_esc_at for s in streams])
        self.mag_at = _offsets_of([s.mag_esc_at for s in streams])
        # each chunk's first position where its file records them (files written before issue 26 do not)
        firsts = [np.zeros(c, np.int64) if s.first is None else s.first for s, c in zip(streams, counts)]
        self.first = _cat(firsts, (0,))
        self.has_first = np.repeat(np.array([s.first is not None for s in streams]), counts)
        parts, needed, owners, keys, n_spans = [], [], [], 0, 0
        for i, (f, s) in enumerate(zip(files, streams)):
            at, start = _offsets(version, f)
            spans = Spans.of(at, f.nnz, start, f.stop, np.arange(len(f), dtype=np.int64), f.need_lo, f.need_hi)
            ctx = _span_ctx(version, f.names, spans)
            spans.check(s.n, ctx)
            need, owner = spans.chunks(e, s.layout.chunks, s.first, ctx)
            parts.append(spans.shifted(int(self.base[i]) * e, keys))
            needed.append(need)
            owners.append(np.where(owner >= 0, owner + n_spans, -1))
            keys += len(f)
            n_spans += len(spans)
        self.spans = Spans.concat(parts) if parts else Spans.of([], [], [], [], [])
        self.owner = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
        needed_all = np.concatenate(needed) if needed else np.zeros(0, dtype=bool)
        index_all = np.concatenate([f.index for f in files]) if files else np.zeros(0, dtype=np.int64)
        self.index_np = index_all[self.spans.key]  # layout index of each span
        self.inside: np.ndarray | None = None  # each span lies in what the layout needs (Runs.held)
        if files and all(f.inside is not None for f in files):
            self.inside = np.concatenate([f.inside for f in files if f.inside is not None])[self.spans.key]
        dev = host.device
        self.nb = dev.type == "cuda"
        backend, why = gpu.backend(dev)  # (None, why) off CUDA, or without nvCOMP
        self.backend: gpu.GpuZstd | None = backend
        gpu.note_path("decodes", f"on {dev} with nvCOMP {backend.version}" if backend else f"on the CPU: {why}")
        self.index_of = torch.from_numpy(self.index_np).to(dev, non_blocking=self.nb)
        self.unblock = _column_blocks(files, self.spans.key, dev)  # per span (first column, width, row size)
        self.per_decode = max(1, host.chunk_elems // e)
        per_run = max(self.per_decode, GPU_RUN_ELEMS // e) if backend is not None else self.per_decode
        skip_min = GPU_SKIP_MIN_ELEMS if backend is not None else CPU_SKIP_MIN_ELEMS
        needed_all = _fill_gaps(needed_all, max(1, skip_min // e))
        self.runs = [_Run(self, g0, g1, fresh) for g0, g1, fresh in _chunk_runs(needed_all, per_run)]
        self.elements = int(self.elems[needed_all].sum())
        self.compressed: set[int] = set()  # runs (by first chunk) fetched as compressed bytes
        self.carry = Carry()
        self.pending: list[_Pending] = []  # decoded sub-runs whose checks are not read yet (`finish`)

    # -- errors ------------------------------------------------------------------------------------
    def ctx_of(self, i: int) -> Ctx:
        """Where an error about span i happened."""
        return ctx_of(self.version, self.names[int(self.spans.key[i])])

    def ctx_of_chunk(self, g: int) -> Ctx:
        if self.owner[g] >= 0:
            return self.ctx_of(int(self.owner[g]))
        return ctx_of(self.version, self.names[0])

    def _chunk_name(self, g: int) -> str:
        k = int(self.local[g])
        return f"chunk {k}" if len(self.streams) == 1 else f"chunk {k} of file {int(self.file[g])}"

    def corrupt(self, g: int) -> DeltaError:
        k = int(self.local[g])
        msg = f"{self._chunk_name(g)} (elements {k * self.e}..) is corrupt: its hash differs"
        return err(CodecError, msg, self.ctx_of_chunk(g))

    # -- a run's bytes -------------------------------------------------------------------------------
    def _segments(self, g0: int, g1: int) -> list[tuple[int, int, int]]:
        """The run's chunks by file: (file, first local chunk, end local chunk)."""
        out = []
        for f in np.unique(self.file[g0:g1]).tolist():
            a, b = max(g0, int(self.base[f])), min(g1, int(self.base[f + 1]))
            out.append((f, int(self.local[a]), int(self.local[b - 1]) + 1))
        return out

    def _byte_ranges(self, g0: int, g1: int) -> list[tuple[np.ndarray, int, int]]:
        """The run's compressed bytes: one range of each file's blob it takes chunks of."""
        out = []
        for f, k0, k1 in self._segments(g0, g1):
            s = self.streams[f]
            out.append((s.blob.numpy(), int(s.chunk_starts[k0]), int(s.chunk_starts[k1])))
        return out

    def _layout(self, g0: int, g1: int) -> PlaneLayout:
        """The run's planes: chunk j at j·E of every plane; the last chunk may be short."""
        return PlaneLayout((g1 - g0 - 1) * self.e + int(self.elems[g1 - 1]), self.e)

    def _frames(self, g0: int, g1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The run's non-empty frames: (offset in the run's compressed bytes, compressed size, offset
        in its planes buffer, raw size), in chunk-major order."""
        cb = self.chunk_bytes[g0:g1]
        src = (np.cumsum(cb) - cb)[:, None] + self.in_chunk[g0:g1]
        raw = self.raw_sizes[g0:g1]
        used = raw.reshape(-1) > 0
        dst = self._layout(g0, g1).frame_offsets()
        comp = self.index[g0:g1, :N_PLANES]
        return src.reshape(-1)[used], comp.reshape(-1)[used], dst.reshape(-1)[used], raw.reshape(-1)[used]

    def _padded(self, g0: int, g1: int) -> np.ndarray:
        """Chunks of the run before its last that are short (a file's last chunk): their slots are padded."""
        return np.flatnonzero(self.elems[g0 : g1 - 1] < self.e)

    def _clear_padding(self, buf: torch.Tensor, g0: int, g1: int, short: np.ndarray) -> None:
        """The bits of a short chunk's last sign and big bytes past its elements (the rest of its slot is
        zero): padded elements decode as +1 differences in no tensor."""
        tail = self.elems[g0 + short] % 8
        keep = tail > 0
        if not keep.any():
            return
        offsets = self._layout(g0, g1).frame_offsets()[short[keep]][:, 2:4]  # sign, big
        at = offsets + ((self.elems[g0 + short[keep]] // 8)[:, None])
        masks = ((1 << tail[keep]) - 1).astype(np.uint8)
        idx = torch.from_numpy(at.reshape(-1)).to(buf.device, non_blocking=self.nb)
        m = torch.from_numpy(np.repeat(masks, 2)).to(buf.device, non_blocking=self.nb)
        buf[idx] = buf[idx] & m

    # -- host work -----------------------------------------------------------------------------------
    def fetch(self, run: _Run) -> Fetch:
        """The run's compressed bytes into pinned memory (GPU path), or its frames verified and
        decompressed there (CPU path: zstandard's own threads, one task a run keeps the GIL free)."""
        if self.backend is not None:
            self.compressed.add(run.g0)
            return self.host.read(self._byte_ranges(run.g0, run.g1))
        planes = self.host.buffer(self._layout(run.g0, run.g1).size, torch.uint8)
        return Fetch([self.host.submit(lambda: self._inflate_cpu(run, planes))], planes)

    def _inflate_cpu(self, run: _Run, out: torch.Tensor) -> None:
        g0, g1 = run.g0, run.g1
        ranges = self._byte_ranges(g0, g1)
        data = ranges[0][0][ranges[0][1] : ranges[0][2]] if len(ranges) == 1 else None
        if data is None:
            data = np.concatenate([src[a:b] for src, a, b in ranges])
        got = chunk_hashes_np(data, self.chunk_bytes[g0:g1])
        bad = np.flatnonzero(got != self.index[g0:g1, COL_HASH])
        if bad.size:
            raise self.corrupt(g0 + int(bad[0]))
        short = self._padded(g0, g1)
        buf = out.numpy()
        if short.size:
            buf[:] = 0
        src, comp, dst, raw = self._frames(g0, g1)
        blob = data.tobytes()
        try:
            frames = zstandard.BufferWithSegments(blob, np.stack([src, comp], 1).astype(np.uint64).tobytes())
            segs = _dctx().multi_decompress_to_buffer(
                frames, decompressed_sizes=raw.astype(np.uint64).tobytes(), threads=max(1, self.host.threads)
            )
        except zstandard.ZstdError:
            self._name_bad_frame(g0, g1, blob, src, comp, raw)
            raise err(CodecError, f"chunks {g0}..{g1 - 1} do not decompress", self.ctx_of_chunk(g0)) from None
        for i, d in enumerate(dst.tolist()):
            seg = segs[i]
            if len(seg) != raw[i]:
                self._bad_size(g0, g1, i, len(seg), int(raw[i]))
            buf[d : d + len(seg)] = np.frombuffer(seg, dtype=np.uint8)  # type: ignore[call-overload]
        if short.size:
            self._clear_padding(out, g0, g1, short)

    def _frame_chunk(self, g0: int, g1: int, i: int) -> tuple[int, int]:
        """(sequence chunk, plane) of the run's i-th non-empty frame."""
        used = np.flatnonzero(self.raw_sizes[g0:g1].reshape(-1) > 0)
        j = int(used[i])
        return g0 + j // N_PLANES, j % N_PLANES

    def _bad_size(self, g0: int, g1: int, i: int, got: int, want: int) -> None:
        g, plane = self._frame_chunk(g0, g1, i)
        msg = f"{self._chunk_name(g)}: {PLANES[plane]} frame decompressed to {got} B, expected {want}"
        raise err(CodecError, msg, self.ctx_of_chunk(g))

    def _name_bad_frame(
        self, g0: int, g1: int, blob: bytes, src: np.ndarray, comp: np.ndarray, raw: np.ndarray
    ) -> None:
        """One frame at a time, to raise the error naming the chunk and plane that do not decompress."""
        dctx = _dctx()
        for i in range(src.size):
            try:
                data = dctx.decompress(blob[int(src[i]) : int(src[i] + comp[i])], max_output_size=int(raw[i]))
            except zstandard.ZstdError as exc:
                g, plane = self._frame_chunk(g0, g1, i)
                msg = f"{self._chunk_name(g)}: {PLANES[plane]} frame does not decode: {exc}"
                raise err(CodecError, msg, self.ctx_of_chunk(g)) from None
            if len(data) != raw[i]:
                self._bad_size(g0, g1, i, len(data), int(raw[i]))

    # -- device work ---------------------------------------------------------------------------------
    def decode(self, run: _Run, fetched: Fetch) -> Iterator[Chunk]:
        g0, g1 = run.g0, run.g1
        if run.fresh:
            self.carry.clear()  # a run after skipped chunks: no decoded gap chain continues into it
            i0 = int(np.searchsorted(self.spans.end, g0 * self.e, side="right"))
            if i0 < len(self.spans) and self.spans.at[i0] < g0 * self.e:
                assert self.has_first[g0]  # without `first`, no chunk inside a tensor is skipped
                self.carry.resume(i0, int(self.first[g0]))
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
            if g0 in self.compressed:  # fell back after reading the compressed bytes
                data = self.host.buffer(self._layout(g0, g1).size, torch.uint8)
                self._inflate_cpu(run, data)
            buf = data.to(self.host.device, non_blocking=self.nb)
            self.host.mark("h2d")
        yield from self._decode_planes(run, buf)

    def _views(self, g0: int, g1: int, buf: torch.Tensor) -> PlaneViews:
        """The planes of the run over `buf` (on the device), with its counts, escapes and first positions
        (checked against the decoded positions, where every chunk of the run has one)."""
        ga, gb = int(self.gap_at[g0]), int(self.gap_at[g1])
        ma, mb = int(self.mag_at[g0]), int(self.mag_at[g1])
        first = self.first[g0:g1] if self.has_first[g0:g1].all() else None
        escapes = (self.gap_esc[ga:gb], self.mag_esc[ma:mb])
        return views_over(buf, self._layout(g0, g1), self.index[g0:g1], escapes, self.host.device, first)

    def _sub_runs(self, g0: int, g1: int) -> list[tuple[int, int]]:
        """The run's chunks in sub-runs of at most `per_decode`, each decoded by one `decode_planes`.
        A short chunk inside the run (a part's last) is padded on a GPU (decoding a chunk's room of
        zeros costs microseconds, one more decode a launch and a host wait) and ends a sub-run on the
        CPU (where the padding would cost more than the decode)."""
        cuts = set(range(0, g1 - g0, self.per_decode)) | {g1 - g0}
        if self.host.device.type not in PAD_DEVICES:
            cuts |= {int(j) + 1 for j in self._padded(g0, g1)}
        edges = sorted(cuts)
        return list(zip(edges[:-1], edges[1:]))

    def _sub_views(self, views: PlaneViews, g0: int, j0: int, j1: int) -> PlaneViews:
        esc = (
            (int(self.gap_at[g0 + j0] - self.gap_at[g0]), int(self.gap_at[g0 + j1] - self.gap_at[g0])),
            (int(self.mag_at[g0 + j0] - self.mag_at[g0]), int(self.mag_at[g0 + j1] - self.mag_at[g0])),
        )
        return views.sub(j0, j1, esc, int(self.elems[g0 + j1 - 1]))

    def _decode_planes(self, run: _Run, buf: torch.Tensor) -> Iterator[Chunk]:
        """The run's planes (`buf`, on the device) in sub-runs (`_sub_runs`). No sub-run waits for its
        checks: each one's flag is kept (with the carry it started from) and read once, by `finish`."""
        g0, g1, e = run.g0, run.g1, self.e
        views = self._views(g0, g1, buf)
        for j0, j1 in self._sub_runs(g0, g1):
            sub = self._sub_views(views, g0, j0, j1)
            before = self.carry.copy()
            out = decode_planes(sub, (g0 + j0) * e, self.spans, self.carry, self.ctx_of, defer=True)
            assert out.flag is not None
            self.pending.append(_Pending(out.flag, run, j0, j1, before))
            if not out.counts.size:
                continue
            p = out.positions  # a column block's in its own coordinates: the tensor's (blocks.py)
            if self.unblock is not None:
                p = from_block_positions(p, *(t[out.span] for t in self.unblock))
            chunk = Chunk(
                t_idx=self.index_of[out.span],
                p=p,
                diffs=out.diffs.to(INT_DTYPE[self.width]),
                values=None,
                runs=Runs(
                    self.index_np[out.first : out.first + out.counts.size],
                    out.counts,
                    None if self.inside is None else self.inside[out.first : out.first + out.counts.size],
                ),
            )
            self.host.mark("decode")
            yield chunk

    def finish(self) -> None:
        """Every decoded sub-run's checks, read at once (one host wait for the whole sequence); a
        flagged one, the first in order, decoded again from its bytes checking as it goes, to raise
        the error that names its chunk and a tensor. Nothing is written before this returns (staging
        calls it before the engine's plans are final)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        flags = torch.stack([p.flag.reshape(()) for p in pending])
        bad = np.flatnonzero(flags.cpu().numpy())  # the one synchronization of the sequence's checks
        if not bad.size:
            return
        p = pending[int(bad[0])]
        g0, g1 = p.run.g0, p.run.g1
        fetched = self.fetch(p.run)
        fetched.wait()
        assert fetched.data is not None
        if self.backend is not None:
            buf = self._inflate_gpu(self.backend, p.run, fetched.data)
        else:
            buf = fetched.data.to(self.host.device)
        sub = self._sub_views(self._views(g0, g1, buf), g0, p.j0, p.j1)
        recheck(sub, (g0 + p.j0) * self.e, self.spans, p.carry, self.ctx_of)

    def _inflate_gpu(self, backend: gpu.GpuZstd, run: _Run, host: torch.Tensor) -> torch.Tensor:
        """GPU path of one run of chunks: its compressed bytes to the device, each chunk's hash
        checked there, its frames decompressed by nvCOMP into a planes buffer (sizes checked)."""
        g0, g1 = run.g0, run.g1
        dev = self.host.device
        blob = host.to(dev, non_blocking=True)
        self.host.mark("h2d")
        want = torch.from_numpy(self.index[g0:g1, COL_HASH].copy()).to(dev, non_blocking=True)
        got = gpu.hashes(blob, self.chunk_bytes[g0:g1])
        bad = (got != want).nonzero().reshape(-1)
        if bad.numel():
            raise self.corrupt(g0 + int(bad[0]))
        short = self._padded(g0, g1)
        size = self._layout(g0, g1).size
        alloc = torch.zeros if short.size else torch.empty  # padded slots read as zeros
        out = alloc(size, dtype=torch.uint8, device=dev)
        src, comp, dst, raw = self._frames(g0, g1)
        sizes = backend.decompress(blob, src, comp, out, dst, raw)
        wrong = np.flatnonzero(sizes != raw)
        if wrong.size:
            i = int(wrong[0])
            self._bad_size(g0, g1, i, int(sizes[i]), int(raw[i]))
        if short.size:
            self._clear_padding(out, g0, g1, short)
        self.host.mark("inflate")
        return out


def _column_blocks(files: list[FilePieces], key: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, ...] | None:
    """Per span of the sequence (by `key`), on `dev`: the first column, width and row size of the column
    block it is a piece of (width 0: not one); None where no span is (no transform)."""
    if all(f.block_width is None or not f.block_width.any() for f in files):
        return None
    cols = []
    for name in ("block_c0", "block_width", "row_size"):
        parts = [getattr(f, name) if getattr(f, name) is not None else np.zeros(len(f), np.int64) for f in files]
        cols.append(np.concatenate(parts)[key])
    host = torch.from_numpy(np.stack(cols).astype(np.int64))
    c0, width, size = host.to(dev, non_blocking=dev.type == "cuda")
    return c0, width, size


def _cat(arrays: list[np.ndarray], empty: tuple[int, ...]) -> np.ndarray:
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else np.zeros(empty, dtype=np.int64)


def _cat_t(tables: list[torch.Tensor]) -> torch.Tensor:
    return tables[0] if len(tables) == 1 else torch.cat(tables)


def _offsets_of(ats: list[np.ndarray]) -> np.ndarray:
    """Per-file cumulative counts ([chunks + 1] each) -> the sequence's ([chunks + 1])."""
    if len(ats) == 1:
        return ats[0]
    out, base = [], 0
    for at in ats:
        out.append(at[:-1] + base)
        base += int(at[-1])
    out.append(np.array([base], dtype=np.int64))
    return np.concatenate(out)


def _span_ctx(version: int, names: list[str], spans: Spans) -> Any:
    def ctx(i: int) -> Ctx:
        return ctx_of(version, names[int(spans.key[i])])

    return ctx


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_TLS, "dctx", None)
    if d is None:
        d = _TLS.dctx = zstandard.ZstdDecompressor()
    return d


def _offsets(version: int, pieces: FilePieces) -> tuple[np.ndarray, np.ndarray]:
    """Each piece's first element in the file's streams and the start of its gap chain (its `enc`),
    checked (CodecError naming the tensor): one pass, no per-piece objects."""
    n = len(pieces)
    try:
        if isinstance(pieces.encs, PieceEncs):  # a format-5 header's columns (-1: a piece without enc)
            at, start = pieces.encs.at, pieces.encs.start
        else:
            at = np.fromiter((enc["at"] for enc in pieces.encs), dtype=np.int64, count=n)
            start = np.fromiter((enc.get("start", 0) for enc in pieces.encs), dtype=np.int64, count=n)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        for k, enc in enumerate(pieces.encs):  # find the piece, and raise naming its tensor
            piece_at(enc, int(pieces.numel[k]), ctx_of(version, pieces.names[k]))
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


def _fill_gaps(needed: np.ndarray, min_gap: int) -> np.ndarray:
    """`needed` with every gap of fewer than `min_gap` chunks between two needed chunks filled (decoded
    rather than skipped); the chunks before the first and after the last needed one stay skipped."""
    edges = np.diff(np.concatenate([[0], needed.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if starts.size < 2 or min_gap <= 1:
        return needed
    gap_from, gap_to = ends[:-1], starts[1:]
    short = (gap_to - gap_from) < min_gap
    if not short.any():
        return needed
    out: np.ndarray = needed.copy()
    delta = np.zeros(needed.size + 1, dtype=np.int64)
    np.add.at(delta, gap_from[short], 1)
    np.add.at(delta, gap_to[short], -1)
    out |= np.cumsum(delta[:-1]) > 0
    return out


def _chunk_runs(needed: np.ndarray, per_run: int) -> list[tuple[int, int, bool]]:
    """Runs of needed chunks [k0, k1) of at most `per_run` chunks; `fresh`: the run does not
    continue the previous one (chunks were skipped in between)."""
    edges = np.diff(np.concatenate([[0], needed.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # maximal spans of needed chunks
    out: list[tuple[int, int, bool]] = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        for k in range(a, b, per_run):
            out.append((k, min(b, k + per_run), k == a))
    return out
