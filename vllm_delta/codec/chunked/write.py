"""Writing a chunked file: a batch's planes (`ChunkedBatch`, from `prepare_batch` or a
`StreamEncoder` fed pass by pass) compressed into the payload's parts and streamed into a sink, by
nvCOMP on the planes' GPU when it runs, else by zstandard on the host; `FilePlan` is a file laid out
before it is written (base.FileWrite).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..base import Batch, BatchSections, HostCopy, MemorySink, PayloadSink, Sections
from . import gpu
from .blocks import BlockLayout, regions_of
from .encode import compress_cpu, encode_planes, planes_to_host
from .planes import FIRST_PART, INDEX_WIDTH, PAYLOAD_LAYOUT, SPANS_LAYOUT, SPANS_PART, Planes, PlanesBackend

log = logging.getLogger(__name__)

COPY_PIECE_BYTES = 8 << 20  # GPU path: compressed bytes copied to the host (and written) at a time


class EncodeSettings(Protocol):
    """The encoder's settings (what ChunkedCodec holds)."""

    level: int
    chunk_elems: int
    slice_elems: int
    encode_backend: PlanesBackend | None
    # GPU path: frames per nvCOMP compression call (None: as many as a call takes, gpu.FRAMES_PER_CALL);
    # fewer bound the publish's device memory (nvCOMP's temporary space and output slots grow with a
    # call's frames) at the cost of more calls
    encode_frames: int | None


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

    def __init__(
        self,
        codec: EncodeSettings,
        counts: Sequence[int],
        starts: Sequence[int] | np.ndarray,
        parts: list[Planes],
        blocks: BlockLayout | None = None,
    ):
        """`counts`, `starts`: per segment of the batch (a tensor; with `blocks`, a (region, tensor)
        piece: segment r * tensors + t), in the file's order."""
        self.codec = codec
        self.parts = parts
        self.counts = list(counts)
        self.starts = list(starts)
        self.ats = [0, *np.cumsum(self.counts).tolist()][:-1]
        self.blocks = blocks
        self.tensor_rows: np.ndarray | None = None  # the tensors' rows in the header (the writer's): `spans`'s
        self._launched: tuple[gpu.LaunchedChunks, np.ndarray] | None = None  # begin(): (compression, counts)
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

    def enc_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every tensor's place in the streams as arrays in batch order: `at` (its first element) and
        `start` (where its gap chain counts from), -1 and -1 where it did not change (format 5). With
        rank blocks a split tensor's are -1 too: its pieces are the file's `spans`."""
        k = self.blocks.tensors if self.blocks is not None else len(self.counts)
        counts = np.asarray(self.counts[:k], dtype=np.int64)
        changed = counts > 0
        at = np.where(changed, np.asarray(self.ats[:k], dtype=np.int64), -1)
        start = np.where(changed, np.asarray(self.starts[:k], dtype=np.int64), -1)
        return at, start

    def spans(self) -> torch.Tensor:
        """A file with rank blocks: its split tensors' pieces in file order, int32 [S, 4] (blocks.py)."""
        assert self.blocks is not None
        if self.tensor_rows is None:
            raise ValueError("a file with rank blocks is written with its tensors' rows in the header")
        return self.blocks.spans(np.asarray(self.counts, dtype=np.int64), self.tensor_rows)

    def file_enc(self) -> dict[str, Any]:
        enc: dict[str, Any] = {"chunk_elems": self.codec.chunk_elems, "elems": self.n}
        if self.blocks is not None:
            enc.update(self.blocks.enc(np.asarray(self.counts, dtype=np.int64)))
        return enc

    @property
    def payload_layout(self) -> list[tuple[str, torch.dtype, int]]:
        """The payload's parts in order (a file with rank blocks: `spans` last)."""
        return list(PAYLOAD_LAYOUT) + ([SPANS_LAYOUT] if self.blocks is not None else [])

    def begin(self) -> None:
        """Start the GPU compression now, on the encode stream, so that nvCOMP runs while the host hands
        the version over and lays out the file's header (~3 ms at Qwen3-8B). Idempotent: the Publisher
        calls it on the training thread right after detection, the upload thread again before it lays
        out the file (a no-op then; the start for sections made elsewhere). Only where nvCOMP's C API
        runs and calls are not bounded (`encode_frames`); anything that fails here is left to
        `write_to`, which compresses (or falls back to the CPU) as it always did."""
        if self._launched is not None or not self.parts or self.device.type != "cuda":
            return
        if getattr(self.codec, "encode_frames", None):
            return
        backend, _ = gpu.backend(self.device)
        if backend is None or backend.c_api is None:
            return
        try:
            self.wait()
            with torch.cuda.stream(gpu.encode_stream(self.device)):
                self._launched = self._launch(backend.c_api)
        except Exception as exc:  # noqa: BLE001 - write_to compresses again, or falls back to the CPU
            log.info("vllm-delta: early GPU compression not started (%s: %s)", type(exc).__name__, exc)
            self._launched = None

    def _launch(self, c_api: Any) -> tuple[gpu.LaunchedChunks, np.ndarray]:
        """Every part's frames in one nvCOMP batch (no merged copy of the parts): (launched, counts)."""
        counts = torch.cat([torch.stack([p.n_big, p.n_gap_esc, p.n_mag_esc], dim=1) for p in self.parts])
        counts_np = counts.cpu().numpy()
        frames = [p.layout.frames(counts_np[k0 : k0 + p.layout.chunks, 0]) for p, k0 in zip(self.parts, self._firsts())]
        launched = gpu.launch_chunks(c_api, [p.buf for p in self.parts], [o for o, _ in frames], [z for _, z in frames])
        return launched, counts_np

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
        pieces, each handed to the sink (written) as its copy lands. With `encode_frames` the parts
        are compressed one after the other (no merged copy of the planes), in calls of that many frames."""
        if not self.parts:
            sink.append("blob", torch.zeros(0, dtype=torch.uint8))
            sink.append("index", _index([]))
            self._write_escapes(sink)
            return
        per_call = getattr(self.codec, "encode_frames", None)
        if self._launched is None and backend.c_api is not None and not per_call:
            self._launched = self._launch(backend.c_api)
        if self._launched is not None:
            launched, counts_np = self._launched
            self._launched = None
            blob, comp, hashes = launched.finish()
            del launched
            self._copy_blob(sink, blob)
            self._write_index(sink, comp, counts_np, hashes)
            return
        counts = torch.cat([torch.stack([p.n_big, p.n_gap_esc, p.n_mag_esc], dim=1) for p in self.parts])
        counts_np = counts.cpu().numpy()
        frames = [p.layout.frames(counts_np[k0 : k0 + p.layout.chunks, 0]) for p, k0 in zip(self.parts, self._firsts())]
        if per_call:
            pieces = [
                gpu.compress_chunks(backend, p.buf, off, size, per_call) for p, (off, size) in zip(self.parts, frames)
            ]
            blob = pieces[0][0] if len(pieces) == 1 else torch.cat([b for b, _, _ in pieces])
            comp = np.concatenate([c for _, c, _ in pieces])
            hashes = torch.cat([h for _, _, h in pieces])
        else:
            merged, bases = self._merge()
            offsets = np.concatenate([off + base for (off, _), base in zip(frames, bases)])
            sizes = np.concatenate([size for _, size in frames])
            blob, comp, hashes = gpu.compress_chunks(backend, merged, offsets, sizes)
            del merged
        self._copy_blob(sink, blob)
        self._write_index(sink, comp, counts_np, hashes)

    @staticmethod
    def _copy_blob(sink: PayloadSink, blob: torch.Tensor) -> None:
        """The compressed blob to pinned memory in pieces, each handed to the sink as its copy lands."""
        host = torch.empty(blob.numel(), dtype=torch.uint8, pin_memory=True)
        for a in range(0, blob.numel(), COPY_PIECE_BYTES):
            b = min(blob.numel(), a + COPY_PIECE_BYTES)
            host[a:b].copy_(blob[a:b], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            sink.append("blob", host[a:b], event.synchronize)
        if not blob.numel():
            sink.append("blob", host)

    def _write_index(self, sink: PayloadSink, comp: np.ndarray, counts_np: np.ndarray, hashes: torch.Tensor) -> None:
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
        """The escape tables, then each chunk's first position (`first`), then (rank blocks) `spans`."""
        for key in ("gap_esc", "mag_esc", FIRST_PART):
            tables = [getattr(p, key) for p in self.parts]
            if any(t is None for t in tables):
                raise ValueError(f"planes without their chunks' {key} (made by encode_planes, they have it)")
            host = [t.cpu() for t in tables if t is not None]
            sink.append(key, torch.cat(host) if host else torch.zeros(0, dtype=torch.int64))
        if self.blocks is not None:
            sink.append(SPANS_PART, self.spans())


def _index(rows: list[np.ndarray]) -> torch.Tensor:
    if not rows:
        return torch.zeros((0, INDEX_WIDTH), dtype=torch.int64)
    out = torch.from_numpy(np.concatenate(rows).astype(np.int64))
    assert out.shape[1] == INDEX_WIDTH
    return out


@dataclass
class FilePlan:
    """A chunked file laid out before it is written (base.FileWrite): the header's `enc`, the
    tensors' `enc`, the payload's parts; `write_to` streams the payload."""

    batch: ChunkedBatch
    enc: dict[str, Any]
    tensor_enc: dict[str, dict[str, Any]]  # by name (plan_file); empty from plan_batch, whose batch has them as arrays
    parts: list[tuple[str, torch.dtype, int]]
    size_hint: int = 0

    def write_to(self, sink: PayloadSink, pool: Executor | None = None, busy_ms: list[float] | None = None) -> None:
        self.batch.write_to(sink, pool, busy_ms)

    def enc_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.batch.enc_arrays()

    def set_tensor_rows(self, rows: np.ndarray) -> None:
        self.batch.tensor_rows = np.asarray(rows, dtype=np.int64)


class StreamEncoder:
    """Encodes a batch's changes as they arrive (the trainer's detection, pass by pass) into planes
    of whole chunks, holding back a last partial chunk for the next pass: the device holds one
    pass's changes at a time plus the planes (~3.3 B per changed element). `finish` gives the same
    file as `prepare_batch` of all the changes at once."""

    def __init__(self, codec: EncodeSettings, starts: Sequence[int] | np.ndarray):
        self.codec = codec
        self.starts = starts if isinstance(starts, np.ndarray) else list(starts)  # an array: one copy a pass
        self.parts: list[Planes] = []
        self._pending: tuple[torch.Tensor, ...] | None = None
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, positions: torch.Tensor, seg: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
        """The next changes (positions, tensor index, new bits, old bits), in owned order. The held-back
        partial chunk is completed from the pass's first elements and encoded as a part of its own:
        the pass itself is encoded in place (a copy of it would hold a second pass's changes, ~430 MB
        at Qwen3-8B 1%, at the publish's peak)."""
        cur: tuple[torch.Tensor, ...] = (positions, seg, new, old)
        e = self.codec.chunk_elems
        if self._pending is not None:
            need = e - self._pending[0].numel()
            head = tuple(torch.cat([a, b[:need]]) for a, b in zip(self._pending, cur))
            self._pending = None
            if head[0].numel() < e:  # the pass did not complete the chunk: still held back
                self._pending = head
                return
            self._encode(head)
            cur = tuple(x[need:] for x in cur)
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

    def flush(self) -> None:
        """Encode the held-back partial chunk (the stream's last: a short chunk)."""
        if self._pending is not None:
            self._encode(self._pending)
            self._pending = None

    def finish(self, counts: Sequence[int]) -> ChunkedBatch:
        """The encoded batch; `counts`: changed elements per tensor (the detection's)."""
        self.flush()
        if sum(counts) != sum(p.layout.n for p in self.parts):
            raise ValueError(f"{sum(p.layout.n for p in self.parts)} changes encoded, the counts say {sum(counts)}")
        return ChunkedBatch(self.codec, counts, self.starts, self.parts)


class BlockStreamEncoder:
    """A `StreamEncoder` per region of a file with rank blocks (blocks.py): each pass's changes are
    partitioned by region (stable: a region keeps the pass's order, tensor after tensor), each region
    encoded as its own stream (its last chunk short), and the regions laid end to end at `finish`.
    Segment r * tensors + t is tensor t's piece in region r (its gap chain starts at its block's
    first position in the writer's rows). One host wait per pass (the regions' sizes)."""

    def __init__(self, codec: EncodeSettings, layout: BlockLayout, starts: Sequence[int]):
        self.codec, self.layout = codec, layout
        self.starts = layout.piece_starts(np.asarray(starts, dtype=np.int64))
        self.encoders = [StreamEncoder(codec, self.starts) for _ in range(layout.blocks + 1)]
        self.counts = np.zeros(self.starts.size, dtype=np.int64)
        self._cols: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def add(self, positions: torch.Tensor, seg: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
        """The next changes (positions, tensor index, new bits, old bits), in owned order."""
        lay = self.layout
        if self._cols is None:
            self._cols = lay.device_columns(positions.device)
        kind, rows, size = self._cols
        region, positions = regions_of(positions, seg, kind, rows, size, lay.blocks)  # column blocks': their own
        piece = region * lay.tensors + seg
        order = torch.argsort(region.to(torch.uint8), stable=True)  # few key bits: a cheaper radix sort
        sizes = torch.cat(
            [torch.bincount(region, minlength=lay.blocks + 1), torch.bincount(piece, minlength=self.counts.size)]
        )
        host = sizes.cpu().numpy()  # the one wait of the pass: where each region's elements are
        self.counts += host[lay.blocks + 1 :]
        at = 0
        for r, k in enumerate(host[: lay.blocks + 1].tolist()):
            if k:
                sel = order[at : at + k]
                self.encoders[r].add(positions[sel], piece[sel], new[sel], old[sel])
            at += k

    def finish(self, counts: Sequence[int]) -> ChunkedBatch:
        """The encoded batch, regions in order; `counts`: changed elements per tensor (the detection's)."""
        if sum(counts) != int(self.counts.sum()):
            raise ValueError(f"{int(self.counts.sum())} changes encoded, the counts say {sum(counts)}")
        parts: list[Planes] = []
        for enc in self.encoders:
            enc.flush()
            parts += enc.parts
        return ChunkedBatch(self.codec, self.counts.tolist(), self.starts, parts, self.layout)
