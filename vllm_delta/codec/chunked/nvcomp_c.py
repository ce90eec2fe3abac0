"""nvCOMP's batched zstd through its C API (ctypes), with the batch's pointer and size arrays built on
the device: a leaf (torch, numpy, ctypes; nothing of this package).

Why not nvCOMP's Python API alone: its batched calls take one `Array` object per frame
(`nvcomp.as_arrays`), built from Python lists, and a call's `buffer_sizes` copies the sizes back. At
Qwen3-8B and 1% a version has ~6,250 frames, and that host work took ~8 ms of a 14 ms inflate on an
H200 whose kernel ran 5.9 ms (`benchmarks/profile_stage.py`). Here a batch is four int64 columns
(source offset, source size, destination offset, destination size), copied to the device once; the
pointers are the two buffers' addresses plus the offsets, added there.

    sizes:       nvcompBatchedZstdGetDecompressSizeAsync(src_ptrs, src_bytes, content_bytes_out, n, stream)
    decompress:  nvcompBatchedZstdDecompressAsync(src_ptrs, src_bytes, dst_capacity, dst_bytes_out,
                                                  n, temp, temp_bytes, dst_ptrs, opts, statuses, stream)
    compress:    nvcompBatchedZstdCompressAsync(src_ptrs, src_bytes, max_src_bytes, n, temp, temp_bytes,
                                                dst_ptrs, dst_bytes_out, opts, statuses, stream)

`size_t` arrays are int64 tensors (sizes and addresses are below 2^63). Both calls are asynchronous on
the caller's current stream; the temporary space comes from torch's caching allocator. The signatures are those of
nvCOMP 6's `nvcomp/zstd.h` (the `nvidia-libnvcomp-cu13` wheel's headers); `load()` returns None where
the library or a symbol is missing, and callers keep nvCOMP's Python API then.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SUCCESS = 0  # nvcompSuccess
_SIZE_T = ctypes.c_size_t
_PTR = ctypes.c_void_p


class _DecompressOpts(ctypes.Structure):  # nvcompBatchedZstdDecompressOpts_t: backend + 60 zero bytes
    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class _CompressOpts(ctypes.Structure):  # nvcompBatchedZstdCompressOpts_t: 64 zero bytes
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Alignments(ctypes.Structure):  # nvcompAlignmentRequirements_t
    _fields_ = [("input", _SIZE_T), ("output", _SIZE_T), ("temp", _SIZE_T)]


class NvcompCError(RuntimeError):
    """A call of nvCOMP's C API returned an error status (the call launched nothing)."""


@dataclass(frozen=True)
class Batch:
    """A launched batch: per frame, nvCOMP's status and the bytes it produced (device tensors, valid
    once the stream reaches them)."""

    statuses: torch.Tensor  # int32
    sizes: torch.Tensor  # int64


class ZstdC:
    """The batched zstd entry points of one loaded libnvcomp."""

    def __init__(self, lib: Any):
        self._lib = lib
        size_p, align_p = ctypes.POINTER(_SIZE_T), ctypes.POINTER(_Alignments)
        sig = {
            "nvcompBatchedZstdDecompressGetTempSize": [_SIZE_T, _SIZE_T, _DecompressOpts, size_p, _SIZE_T, _PTR],
            "nvcompBatchedZstdDecompressAsync": [
                _PTR,
                _PTR,
                _PTR,
                _PTR,
                _SIZE_T,
                _PTR,
                _SIZE_T,
                _PTR,
                _DecompressOpts,
                _PTR,
                _PTR,
            ],
            "nvcompBatchedZstdDecompressGetRequiredAlignments": [_DecompressOpts, align_p],
            "nvcompBatchedZstdGetDecompressSizeAsync": [_PTR, _PTR, _PTR, _SIZE_T, _PTR],
            "nvcompBatchedZstdCompressGetTempSize": [_SIZE_T, _SIZE_T, _CompressOpts, size_p, _SIZE_T, _PTR],
            "nvcompBatchedZstdCompressGetMaxOutputChunkSize": [_SIZE_T, _CompressOpts, size_p],
            "nvcompBatchedZstdCompressAsync": [
                _PTR,
                _PTR,
                _SIZE_T,
                _SIZE_T,
                _PTR,
                _SIZE_T,
                _PTR,
                _PTR,
                _CompressOpts,
                _PTR,
                _PTR,
            ],
            "nvcompBatchedZstdCompressGetRequiredAlignments": [_CompressOpts, align_p],
        }
        for name, argtypes in sig.items():
            fn = getattr(lib, name)  # AttributeError: another nvCOMP (load() returns None)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self._dopts = _DecompressOpts()  # zeroed: the default backend
        self._copts = _CompressOpts()
        self.decompress_align = self._alignments(lib.nvcompBatchedZstdDecompressGetRequiredAlignments, self._dopts)
        self.compress_align = self._alignments(lib.nvcompBatchedZstdCompressGetRequiredAlignments, self._copts)

    @staticmethod
    def _alignments(fn: Any, opts: ctypes.Structure) -> _Alignments:
        out = _Alignments()
        _check(fn(opts, ctypes.byref(out)), "GetRequiredAlignments")
        return out

    def decompress(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        frames: np.ndarray,
    ) -> Batch:
        """Frames `src[frames[i, 0] : +frames[i, 1]]` into `dst[frames[i, 2] : +frames[i, 3]]` (uint8
        device tensors; `frames` int64 [n, 4] on the host), launched on the current stream. Waits only
        for the frames' content sizes: where one differs from its room, nothing is decompressed and the
        batch's sizes are the content sizes (the caller's size check reports the first)."""
        n = len(frames)
        _aligned(src, frames[:, 0], self.decompress_align.input, "compressed frames")
        _aligned(dst, frames[:, 2], self.decompress_align.output, "decompressed frames")
        stream = torch.cuda.current_stream(src.device).cuda_stream
        cols = _columns(frames, src.device)  # [4, n]: one copy of the batch's description
        src_ptrs = cols[0] + src.data_ptr()
        dst_ptrs = cols[2] + dst.data_ptr()
        max_out, total_out = int(frames[:, 3].max()), int(frames[:, 3].sum())
        # Each frame's content size from its header, checked against its room before any launch: a
        # frame larger than its room faults the decompression kernel on an H200 (nvCOMP 6.0.0.12; the
        # header promises an error status), and a fault ends the process's CUDA context. nvCOMP's
        # Python API makes the same check. One wait, for a kernel that reads the frames' headers.
        content = torch.empty(n, dtype=torch.int64, device=src.device)
        _check(
            self._lib.nvcompBatchedZstdGetDecompressSizeAsync(
                src_ptrs.data_ptr(), cols[1].data_ptr(), content.data_ptr(), n, _PTR(stream)
            ),
            "GetDecompressSizeAsync",
        )
        if not bool(torch.equal(content, cols[3])):
            return Batch(torch.zeros(n, dtype=torch.int32, device=src.device), content)  # launched nothing
        temp_bytes = _SIZE_T(0)
        _check(
            self._lib.nvcompBatchedZstdDecompressGetTempSize(
                n, max_out, self._dopts, ctypes.byref(temp_bytes), total_out, _PTR(stream)
            ),
            "DecompressGetTempSize",
        )
        temp = _temp(temp_bytes.value, self.decompress_align.temp, src.device)
        got = torch.empty(n, dtype=torch.int64, device=src.device)
        statuses = torch.empty(n, dtype=torch.int32, device=src.device)
        _check(
            self._lib.nvcompBatchedZstdDecompressAsync(
                src_ptrs.data_ptr(),
                cols[1].data_ptr(),
                cols[3].data_ptr(),
                got.data_ptr(),
                n,
                temp.data_ptr() if temp.numel() else None,
                temp_bytes.value,
                dst_ptrs.data_ptr(),
                self._dopts,
                statuses.data_ptr(),
                _PTR(stream),
            ),
            "DecompressAsync",
        )
        # The arrays and the temporary space may be freed when this returns: the caching allocator
        # hands their memory only to later work on this same stream, which runs after the kernel.
        return Batch(statuses, got)

    def max_compressed_bytes(self, max_in: int) -> int:
        out = _SIZE_T(0)
        _check(
            self._lib.nvcompBatchedZstdCompressGetMaxOutputChunkSize(max_in, self._copts, ctypes.byref(out)),
            "CompressGetMaxOutputChunkSize",
        )
        return int(out.value)

    def compress(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        frames: np.ndarray,
    ) -> Batch:
        """Frames `src[frames[i, 0] : +frames[i, 1]]` compressed into `dst[frames[i, 2] :]` (slots of at
        least `max_compressed_bytes(max size)` each; `frames[:, 3]` unused). Launched on the current
        stream."""
        n = len(frames)
        _aligned(src, frames[:, 0], self.compress_align.input, "frames to compress")
        _aligned(dst, frames[:, 2], self.compress_align.output, "compressed slots")
        stream = torch.cuda.current_stream(src.device).cuda_stream
        cols = _columns(frames, src.device)
        src_ptrs = cols[0] + src.data_ptr()
        dst_ptrs = cols[2] + dst.data_ptr()
        max_in, total_in = int(frames[:, 1].max()), int(frames[:, 1].sum())
        temp_bytes = _SIZE_T(0)
        _check(
            self._lib.nvcompBatchedZstdCompressGetTempSize(
                n, max_in, self._copts, ctypes.byref(temp_bytes), total_in, _PTR(stream)
            ),
            "CompressGetTempSize",
        )
        temp = _temp(temp_bytes.value, self.compress_align.temp, src.device)
        got = torch.empty(n, dtype=torch.int64, device=src.device)
        statuses = torch.empty(n, dtype=torch.int32, device=src.device)
        _check(
            self._lib.nvcompBatchedZstdCompressAsync(
                src_ptrs.data_ptr(),
                cols[1].data_ptr(),
                max_in,
                n,
                temp.data_ptr() if temp.numel() else None,
                temp_bytes.value,
                dst_ptrs.data_ptr(),
                got.data_ptr(),
                self._copts,
                statuses.data_ptr(),
                _PTR(stream),
            ),
            "CompressAsync",
        )
        return Batch(statuses, got)


def _columns(frames: np.ndarray, device: torch.device) -> torch.Tensor:
    """The batch's [n, 4] description as four device columns (one host-to-device copy)."""
    if frames.ndim != 2 or frames.shape[1] != 4 or not len(frames):
        raise ValueError(f"a batch is a non-empty [n, 4] array of frames, not {frames.shape}")
    host = torch.from_numpy(np.ascontiguousarray(frames.T, dtype=np.int64)).pin_memory()
    # asynchronous from pinned memory: torch's pinned allocator keeps `host` until the copy has run
    return host.to(device, non_blocking=True)


def _aligned(buf: torch.Tensor, offsets: np.ndarray, align: int, what: str) -> None:
    """nvCOMP's alignment rule for a batch's buffers (breaking it is undefined behaviour there)."""
    if align > 1 and ((buf.data_ptr() % align) or (offsets % align).any()):
        raise NvcompCError(f"{what} are not aligned to the {align} bytes nvCOMP requires")


def _temp(nbytes: int, align: int, device: torch.device) -> torch.Tensor:
    """nvCOMP's temporary space from torch's caching allocator (its blocks are 512-byte aligned)."""
    if nbytes and 512 % max(1, align):
        raise NvcompCError(f"nvCOMP asks for temporary space aligned to {align} bytes")
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _check(status: int, what: str) -> None:
    if status != SUCCESS:
        raise NvcompCError(f"nvCOMP {what} returned status {status}")


def load() -> tuple[ZstdC | None, str]:
    """(the C API of the installed libnvcomp, "") or (None, why not)."""
    try:
        from nvidia.libnvcomp import load_library  # the wheel's loader: its bundled libnvcomp.so.6
    except ImportError:
        return None, "nvidia-libnvcomp is not installed"
    try:
        lib = load_library()
        if lib is None:
            return None, "libnvcomp did not load"
        return ZstdC(lib), ""
    except (OSError, AttributeError, NvcompCError) as exc:
        return None, f"nvCOMP's C API is not usable ({type(exc).__name__}: {exc})"


__all__ = ["Batch", "NvcompCError", "ZstdC", "load"]
