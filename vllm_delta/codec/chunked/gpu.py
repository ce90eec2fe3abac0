"""nvCOMP, optional (`pip install vllm-delta[gpu]`): the chunked codec's zstd frames, on a CUDA device.

nvCOMP's zstd, given one frame per batch entry (`BitstreamKind.RAW`), writes standard zstd frames
that the CPU `zstandard` library reads, and reads the frames `zstandard` writes: the CPU and GPU
paths share one format (this package). Everything here is lazy and optional:

* `backend(device)` imports nvCOMP the first time it is asked for a device and proves it on a small
  round trip against zstandard (a wrong CUDA build of the wheel fails here, not in an update); it
  returns (None, why) when nvCOMP is missing, cannot run, or VLLM_DELTA_CODEC_PATH=cpu;
* callers fall back to the CPU path on any exception (an out-of-memory GPU included), with a log
  line, so an update never fails because of nvCOMP; `note_path` logs once which path ran.

Data errors are not left to nvCOMP: a chunk's bytes are checked against the index's hash on the
device before it is decompressed (decoder.py), and decompressed sizes against the index after.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...checksums import chunk_hashes
from . import kernels, nvcomp_c
from .planes import FRAME_ALIGN  # nvCOMP's alignment divides it

log = logging.getLogger(__name__)

PATH_ENV = "VLLM_DELTA_CODEC_PATH"  # "auto" (default): nvCOMP where it runs; "cpu": never
API_ENV = "VLLM_DELTA_NVCOMP_API"  # "auto" (default): nvCOMP's C API where it loads (nvcomp_c.py); "python": never
FRAMES_PER_CALL = 8192  # frames compressed per nvCOMP call: a call through the Python API costs ~10 ms whatever
# its size (H100), and its output slots ~66 KB per frame (8192 frames: 540 MB; Qwen3-8B at 1% has 6,250)

# Frames per launch through the C API (`_launches`). Not fewer: GPU zstd needs the whole batch in flight
# (1,024 frames per launch: Qwen3-8B's inflate 8 -> 37 ms, its compression 28 -> 90 ms on an H200).
C_FRAMES_PER_LAUNCH = 8192

_lock = threading.Lock()
_backends: dict[tuple[str, int], tuple[GpuZstd | None, str]] = {}
_noted: set[str] = set()
_streams: dict[int, Any] = {}  # device index -> the stream encodes run on (never the legacy default stream)


def note_path(direction: str, how: str) -> None:
    """Log once per process which path a codec direction runs ("encodes"/"decodes", "on ...")."""
    msg = f"vllm-delta: the chunked codec {direction} {how}"
    with _lock:
        if msg in _noted:
            return
        _noted.add(msg)
    log.info("%s", msg)


def forced_cpu() -> bool:
    return os.environ.get(PATH_ENV, "auto").strip().lower() == "cpu"


def backend(device: torch.device) -> tuple[GpuZstd | None, str]:
    """(the nvCOMP zstd backend of a CUDA device, "") or (None, why it is not used)."""
    if forced_cpu():
        return None, f"{PATH_ENV}=cpu"
    if device.type != "cuda":
        return None, f"{device} is not a CUDA device"
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    with _lock:
        if key not in _backends:
            _backends[key] = _load(torch.device("cuda", key[1]))
        return _backends[key]


def reset() -> None:
    """Forget loaded backends and logged paths (tests)."""
    with _lock:
        _backends.clear()
        _noted.clear()


def _load(device: torch.device) -> tuple[GpuZstd | None, str]:
    try:
        from nvidia import nvcomp
    except ImportError:
        return None, "nvCOMP is not installed (pip install vllm-delta[gpu])"
    except Exception as exc:  # noqa: BLE001 - a broken install is "not available", never a crash
        return None, f"nvCOMP does not load ({type(exc).__name__}: {exc})"
    try:
        be = GpuZstd(nvcomp, device)
        try:
            be.self_test()
        except Exception as exc:  # noqa: BLE001 - the C API misbehaving: nvCOMP's Python API may still run
            if be.c_api is None:
                raise
            log.warning("vllm-delta: nvCOMP's C API failed its self-test, using its Python API: %s", exc)
            be = GpuZstd(nvcomp, device, c_api=False)
            be.self_test()
    except Exception as exc:  # noqa: BLE001 - wrong CUDA build, no driver support, ...
        return None, f"nvCOMP cannot run on {device} ({type(exc).__name__}: {exc})"
    return be, ""


class GpuZstd:
    """nvCOMP's zstd on one device: batches of frames in one device buffer, compressed into or
    decompressed from another, on the caller's current CUDA stream. Through nvCOMP's C API where it
    loads (`nvcomp_c`: the batch described by four columns built on the device), else its Python API
    (an `Array` object per frame)."""

    def __init__(self, nvcomp: Any, device: torch.device, *, c_api: bool | None = None):
        self.nvcomp = nvcomp
        self.device = device
        self.version = getattr(nvcomp, "__version__", "?")
        self._tls = threading.local()
        self.c_api: nvcomp_c.ZstdC | None = None
        if c_api is None:
            c_api = os.environ.get(API_ENV, "auto").strip().lower() != "python"
        if c_api:
            self.c_api, why = nvcomp_c.load()
            if self.c_api is None:
                log.info("vllm-delta: nvCOMP's Python API for zstd (%s)", why)

    def _codec(self) -> Any:
        """One nvCOMP Codec per thread and stream (a Codec is not thread-safe)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        cache = getattr(self._tls, "codecs", None)
        if cache is None:
            cache = self._tls.codecs = {}
        if stream not in cache:
            nv = self.nvcomp
            cache[stream] = nv.Codec(
                algorithm="Zstd",
                bitstream_kind=nv.BitstreamKind.RAW,
                device_id=self.device.index,
                cuda_stream=stream,
            )
        return cache[stream]

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def compress(
        self, buf: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray
    ) -> tuple[torch.Tensor, int, np.ndarray]:
        """Frames buf[offsets[i] : offsets[i] + sizes[i]] (sizes > 0), compressed into slots of `cap`
        bytes (frame i at slots[i * cap :]): (slots, cap, compressed sizes). Waits for nvCOMP."""
        if self.c_api is not None:
            return self._compress_c(self.c_api, buf, offsets, sizes)
        nv, codec = self.nvcomp, self._codec()
        stream = self._stream()
        sample = nv.as_array(buf[: int(sizes.max())], stream)
        cap = -(-int(codec.get_max_comp_buffer_size(sample)) // FRAME_ALIGN) * FRAME_ALIGN
        nf = len(sizes)
        slots = torch.empty(nf * cap, dtype=torch.uint8, device=self.device)
        srcs = nv.as_arrays(buf, [int(x) for x in offsets], [int(x) for x in sizes], stream)
        dsts = nv.as_arrays(slots, [f * cap for f in range(nf)], [cap] * nf, stream)
        res = codec.encode(srcs, out=dsts)
        got = np.asarray(res.buffer_sizes, dtype=np.int64)  # waits for the compression
        if (got <= 0).any() or (got > cap).any():
            raise RuntimeError(f"nvCOMP returned compressed sizes outside (0, {cap}]")
        return slots, cap, got

    def decompress(
        self,
        src: torch.Tensor,
        offsets: np.ndarray,
        sizes: np.ndarray,
        dst: torch.Tensor,
        dst_offsets: np.ndarray,
        dst_sizes: np.ndarray,
    ) -> np.ndarray:
        """Frames src[offsets[i]:+sizes[i]] into dst[dst_offsets[i]:+dst_sizes[i]]; returns the sizes
        nvCOMP decompressed (the caller compares them with dst_sizes; -1 for a frame nvCOMP reported
        an error for)."""
        if self.c_api is not None:
            frames = np.stack([offsets, sizes, dst_offsets, dst_sizes], axis=1).astype(np.int64, copy=False)
            c_api = self.c_api
            return _host_sizes(
                *[c_api.decompress(src, dst, frames[i : i + C_FRAMES_PER_LAUNCH]) for i in _launches(frames)]
            )
        nv, codec = self.nvcomp, self._codec()
        stream = self._stream()
        srcs = nv.as_arrays(src, [int(x) for x in offsets], [int(x) for x in sizes], stream)
        dsts = nv.as_arrays(dst, [int(x) for x in dst_offsets], [int(x) for x in dst_sizes], stream)
        res = codec.decode(srcs, out=dsts)
        return np.asarray(res.buffer_sizes, dtype=np.int64)

    def _compress_c(
        self, c_api: nvcomp_c.ZstdC, buf: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray
    ) -> tuple[torch.Tensor, int, np.ndarray]:
        cap = -(-c_api.max_compressed_bytes(int(sizes.max())) // FRAME_ALIGN) * FRAME_ALIGN
        nf = len(sizes)
        slots = torch.empty(nf * cap, dtype=torch.uint8, device=self.device)
        slot_at = np.arange(nf, dtype=np.int64) * cap
        frames = np.stack([offsets, sizes, slot_at, np.zeros(nf, dtype=np.int64)], axis=1).astype(np.int64, copy=False)
        got = _host_sizes(*[c_api.compress(buf, slots, frames[i : i + C_FRAMES_PER_LAUNCH]) for i in _launches(frames)])
        if (got <= 0).any() or (got > cap).any():
            raise RuntimeError(f"nvCOMP returned compressed sizes outside (0, {cap}] or an error status")
        return slots, cap, got

    def self_test(self) -> None:
        """A round trip against zstandard both ways (raises on any difference)."""
        import zstandard

        rng = np.random.default_rng(0)
        raw = np.concatenate([rng.integers(0, 40, 50_000), np.zeros(15_536, dtype=np.int64)]).astype(np.uint8)
        with torch.cuda.device(self.device):
            dev = torch.from_numpy(raw).to(self.device)
            blob, sizes = compress_frames(self, dev, np.array([0]), np.array([raw.size]))
            frame = blob[: int(sizes[0])].cpu().numpy().tobytes()
            if zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw.size) != raw.tobytes():
                raise RuntimeError("nvCOMP's zstd frame does not decode to its input with zstandard")
            cpu_frame = zstandard.ZstdCompressor(level=3, write_checksum=False).compress(raw.tobytes())
            src = torch.zeros(-(-len(cpu_frame) // FRAME_ALIGN) * FRAME_ALIGN, dtype=torch.uint8)
            src[: len(cpu_frame)] = torch.frombuffer(bytearray(cpu_frame), dtype=torch.uint8)
            out = torch.empty(raw.size, dtype=torch.uint8, device=self.device)
            got = self.decompress(
                src.to(self.device), np.array([0]), np.array([len(cpu_frame)]), out, np.array([0]), np.array([raw.size])
            )
            if int(got[0]) != raw.size or not torch.equal(out.cpu(), torch.from_numpy(raw)):
                raise RuntimeError("nvCOMP does not decode zstandard's frame to its input")


def _launches(frames: np.ndarray) -> range:
    """Where each launch of a batch through the C API starts: sub-batches of C_FRAMES_PER_LAUNCH frames,
    back to back on the stream with one wait after the last. nvCOMP's zstd temporary space grows with
    the frames of a launch (decompression ~0.2 MB a frame: 1.3 GB for Qwen3-8B's 6,250 at once), and
    each launch's space is reused by the next."""
    return range(0, len(frames), C_FRAMES_PER_LAUNCH)


def _host_sizes(*batches: nvcomp_c.Batch) -> np.ndarray:
    """Launched batches' sizes on the host, in order (one wait), -1 where nvCOMP reported an error."""
    statuses = torch.cat([b.statuses.to(torch.int64) for b in batches])
    both = torch.stack([statuses, torch.cat([b.sizes for b in batches])]).cpu().numpy()
    return np.where(both[0] == nvcomp_c.SUCCESS, both[1], -1)


def _encode_stream(device: torch.device) -> Any:
    """A stream of its own for encodes (the Publisher's upload thread): nvCOMP on the thread's
    default (legacy) stream would wait for, and hold up, the training stream."""
    with _lock:
        if device.index not in _streams:
            _streams[device.index] = torch.cuda.Stream(device)
        return _streams[device.index]


def encode_stream(device: torch.device) -> Any:
    """A stream of its own for encodes (the Publisher's upload thread): nvCOMP on the thread's
    default (legacy) stream would wait for, and hold up, the training stream."""
    return _encode_stream(device)


def compress_frames(
    be: GpuZstd, buf: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, per_call: int | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """Frames of `buf` (sizes > 0) -> (their compressed bytes, each zero-padded to FRAME_ALIGN, end to
    end on the device; compressed sizes), at most `per_call` (default FRAMES_PER_CALL) frames per
    nvCOMP call: a call's output slots and temporary space are freed (reused) before the next."""
    step = max(1, min(per_call or FRAMES_PER_CALL, FRAMES_PER_CALL))
    blobs, got_all = [], []
    for i in range(0, len(sizes), step):
        slots, cap, got = be.compress(buf, offsets[i : i + step], sizes[i : i + step])
        blobs.append(compact(slots, cap, got))
        del slots
        got_all.append(got)
    if not blobs:
        return torch.zeros(0, dtype=torch.uint8, device=buf.device), np.zeros(0, dtype=np.int64)
    return (blobs[0] if len(blobs) == 1 else torch.cat(blobs)), np.concatenate(got_all)


def compact(slots: torch.Tensor, cap: int, got: np.ndarray) -> torch.Tensor:
    """Compressed frames in slots of `cap` bytes -> end to end, each zero-padded to FRAME_ALIGN (the
    Triton kernel where it runs; else masks, ~16 B of indices per byte)."""
    padded = -(-got // FRAME_ALIGN) * FRAME_ALIGN
    if kernels.available(slots.device):
        return kernels.compact_frames(slots, cap, got, padded)
    nf = got.size
    rows = slots[: nf * cap].view(nf, cap)
    col = torch.arange(cap, device=slots.device)
    got_t = torch.from_numpy(got).to(slots.device)
    rows.masked_fill_(col[None, :] >= got_t[:, None], 0)  # nvCOMP may leave scratch past the end
    pad_t = torch.from_numpy(padded).to(slots.device)
    return rows[col[None, :] < pad_t[:, None]]


def hashes(blob: torch.Tensor, chunk_bytes: np.ndarray) -> torch.Tensor:
    """`checksums.chunk_hashes` on the device: the Triton kernel where it runs."""
    if kernels.available(blob.device):
        return kernels.chunk_hashes(blob, chunk_bytes)
    return chunk_hashes(blob, torch.from_numpy(np.asarray(chunk_bytes, dtype=np.int64)))


@dataclass
class LaunchedChunks:
    """Runs of chunks of several planes buffers whose frames nvCOMP compresses (C API, launched, not
    waited for): `finish` packs them end to end once they are done. The buffers stay referenced."""

    bufs: list[torch.Tensor]
    slots: torch.Tensor
    cap: int
    batches: list[nvcomp_c.Batch]
    used: np.ndarray  # bool [chunks, planes]: the frames compressed (size > 0)

    def finish(self) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """(compressed bytes end to end, sizes [chunks, planes], the chunks' hashes): compress_chunks's."""
        got = _host_sizes(*self.batches)
        if (got <= 0).any() or (got > self.cap).any():
            raise RuntimeError(f"nvCOMP returned compressed sizes outside (0, {self.cap}] or an error status")
        blob = compact(self.slots, self.cap, got)
        self.slots = self.slots[:0]  # freed (stream-ordered) once compacted
        comp = np.zeros(self.used.shape, dtype=np.int64)
        comp[self.used] = got
        chunk_bytes = (-(-comp // FRAME_ALIGN) * FRAME_ALIGN).sum(axis=1)
        return blob, comp, hashes(blob, chunk_bytes)


def launch_chunks(
    c_api: nvcomp_c.ZstdC, bufs: list[torch.Tensor], offsets: list[np.ndarray], sizes: list[np.ndarray]
) -> LaunchedChunks:
    """Every frame of several planes buffers (each with its frames' `offsets` and raw `sizes`, [chunks,
    planes]) in one batch on the current stream, without copying the buffers into one: the frames'
    addresses are taken relative to the lowest-addressed buffer (nvCOMP reads by address)."""
    base = min(bufs, key=lambda b: b.data_ptr())
    flat_off = np.concatenate([o.reshape(-1) + (b.data_ptr() - base.data_ptr()) for b, o in zip(bufs, offsets)])
    size_all = np.concatenate([s.reshape(-1, s.shape[-1]) for s in sizes])
    used = size_all > 0
    off, size = flat_off[used.reshape(-1)], size_all[used]
    cap = -(-c_api.max_compressed_bytes(int(size.max())) // FRAME_ALIGN) * FRAME_ALIGN
    nf = len(size)
    slots = torch.empty(nf * cap, dtype=torch.uint8, device=base.device)
    frames = np.stack([off, size, np.arange(nf, dtype=np.int64) * cap, np.zeros(nf, dtype=np.int64)], axis=1)
    frames = frames.astype(np.int64, copy=False)
    batches = [c_api.compress(base, slots, frames[i : i + C_FRAMES_PER_LAUNCH]) for i in _launches(frames)]
    return LaunchedChunks(list(bufs), slots, cap, batches, used)


def compress_chunks(
    be: GpuZstd, buf: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, per_call: int | None = None
) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    """A run of chunks of a planes buffer (their frames' `offsets` and raw `sizes`, [chunks, planes])
    -> (the chunks' compressed bytes end to end on the device, compressed sizes [chunks, planes] (0
    for empty frames), the chunks' hashes (device int64)), on the current stream; `per_call`: frames
    per nvCOMP call (compress_frames)."""
    used = sizes.reshape(-1) > 0
    blob, got = compress_frames(be, buf, offsets.reshape(-1)[used], sizes.reshape(-1)[used], per_call)
    flat = np.zeros(sizes.size, dtype=np.int64)
    flat[used] = got
    comp = flat.reshape(sizes.shape)
    chunk_bytes = (-(-comp // FRAME_ALIGN) * FRAME_ALIGN).sum(axis=1)
    return blob, comp, hashes(blob, chunk_bytes)
