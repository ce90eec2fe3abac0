"""nvCOMP, optional (`pip install vllm-delta[gpu]`): the chunked codec's zstd frames, on a CUDA device.

nvCOMP's zstd, given one frame per batch entry (`BitstreamKind.RAW`), writes standard zstd frames
that the CPU `zstandard` library reads, and reads the frames `zstandard` writes: the CPU and GPU
paths share one format (chunked.py). Everything here is lazy and optional:

* `backend(device)` imports nvCOMP the first time it is asked for a device and proves it on a small
  round trip against zstandard (a wrong CUDA build of the wheel fails here, not in an update); it
  returns (None, why) when nvCOMP is missing, cannot run, or VLLM_DELTA_CODEC_PATH=cpu;
* callers fall back to the CPU path on any exception (an out-of-memory GPU included), with a log
  line, so an update never fails because of nvCOMP; `note_path` logs once which path ran.

Data errors are not left to nvCOMP: a chunk's bytes are checked against the index's hash on the
device before it is decompressed (chunked.py), and decompressed sizes against the index after.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np
import torch

from ..checksums import chunk_hashes

log = logging.getLogger(__name__)

PATH_ENV = "VLLM_DELTA_CODEC_PATH"  # "auto" (default): nvCOMP where it runs; "cpu": never
FRAMES_PER_CALL = 2048  # frames compressed per nvCOMP call (bounds the output buffer: ~66 KB each)
FRAME_ALIGN = 16  # the chunked codec's frame alignment (nvCOMP's alignment divides it)

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
        be.self_test()
    except Exception as exc:  # noqa: BLE001 - wrong CUDA build, no driver support, ...
        return None, f"nvCOMP cannot run on {device} ({type(exc).__name__}: {exc})"
    return be, ""


class GpuZstd:
    """nvCOMP's zstd on one device: batches of frames in one device buffer, compressed into or
    decompressed from another, on the caller's current CUDA stream."""

    def __init__(self, nvcomp: Any, device: torch.device):
        self.nvcomp = nvcomp
        self.device = device
        self.version = getattr(nvcomp, "__version__", "?")
        self._tls = threading.local()

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

    def compress(self, buf: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Frames buf[offsets[i] : offsets[i] + sizes[i]] (sizes > 0) -> (their compressed bytes, each
        zero-padded to FRAME_ALIGN, concatenated, on the device; compressed sizes)."""
        nv, codec = self.nvcomp, self._codec()
        stream = self._stream()
        sample = nv.as_array(buf[: int(sizes.max())], stream)
        cap = -(-int(codec.get_max_comp_buffer_size(sample)) // FRAME_ALIGN) * FRAME_ALIGN
        parts, got_all = [], []
        for i in range(0, len(sizes), FRAMES_PER_CALL):
            off, size = offsets[i : i + FRAMES_PER_CALL], sizes[i : i + FRAMES_PER_CALL]
            nf = len(size)
            out = torch.zeros(nf * cap, dtype=torch.uint8, device=self.device)
            srcs = nv.as_arrays(buf, [int(x) for x in off], [int(x) for x in size], stream)
            dsts = nv.as_arrays(out, [f * cap for f in range(nf)], [cap] * nf, stream)
            res = codec.encode(srcs, out=dsts)
            got = np.asarray(res.buffer_sizes, dtype=np.int64)  # waits for the compression
            if (got <= 0).any() or (got > cap).any():
                raise RuntimeError(f"nvCOMP returned compressed sizes outside (0, {cap}]")
            rows = out.view(nf, cap)
            col = torch.arange(cap, device=self.device)
            got_t = torch.from_numpy(got).to(self.device)
            rows.masked_fill_(col[None, :] >= got_t[:, None], 0)  # nvCOMP may leave scratch past the end
            parts.append(rows[col[None, :] < ((got_t + FRAME_ALIGN - 1) // FRAME_ALIGN * FRAME_ALIGN)[:, None]])
            got_all.append(got)
        return torch.cat(parts), np.concatenate(got_all)

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
        nvCOMP decompressed (the caller compares them with dst_sizes)."""
        nv, codec = self.nvcomp, self._codec()
        stream = self._stream()
        srcs = nv.as_arrays(src, [int(x) for x in offsets], [int(x) for x in sizes], stream)
        dsts = nv.as_arrays(dst, [int(x) for x in dst_offsets], [int(x) for x in dst_sizes], stream)
        res = codec.decode(srcs, out=dsts)
        return np.asarray(res.buffer_sizes, dtype=np.int64)

    def self_test(self) -> None:
        """A round trip against zstandard both ways (raises on any difference)."""
        import zstandard

        rng = np.random.default_rng(0)
        raw = np.concatenate([rng.integers(0, 40, 50_000), np.zeros(15_536, dtype=np.int64)]).astype(np.uint8)
        with torch.cuda.device(self.device):
            dev = torch.from_numpy(raw).to(self.device)
            blob, sizes = self.compress(dev, np.array([0]), np.array([raw.size]))
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


def _encode_stream(device: torch.device) -> Any:
    """A stream of its own for encodes (the Publisher's upload thread): nvCOMP on the thread's
    default (legacy) stream would wait for, and hold up, the training stream."""
    with _lock:
        if device.index not in _streams:
            _streams[device.index] = torch.cuda.Stream(device)
        return _streams[device.index]


def compress_planes(be: GpuZstd, planes: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A device Planes (chunked.py, computed and waited for) -> (blob, index int64 [chunks, 9]),
    both on the host: every frame compressed by nvCOMP, padded, hashed per chunk on the device; only
    the compressed bytes cross to the host. Runs on a stream of its own and waits for it."""
    with torch.cuda.stream(_encode_stream(planes.buf.device)):
        return _compress_planes(be, planes)


def _compress_planes(be: GpuZstd, planes: Any) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.stack([planes.n_big, planes.n_gap_esc, planes.n_mag_esc], dim=1).cpu().numpy()
    offsets, sizes = planes.layout.frames(counts[:, 0])
    used = sizes.reshape(-1) > 0
    blob, got = be.compress(planes.buf, offsets.reshape(-1)[used], sizes.reshape(-1)[used])
    comp = np.zeros(sizes.size, dtype=np.int64)
    comp[used] = got
    comp = comp.reshape(sizes.shape)
    chunk_bytes = (-(-comp // FRAME_ALIGN) * FRAME_ALIGN).sum(axis=1)
    hashes = chunk_hashes(blob, torch.from_numpy(chunk_bytes).to(blob.device)).cpu().numpy()
    index = np.concatenate([comp, counts, hashes[:, None]], axis=1).astype(np.int64)
    host = torch.empty(blob.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(blob, non_blocking=True)
    torch.cuda.current_stream(blob.device).synchronize()
    return host, torch.from_numpy(index)
