"""Loader of the CUDA C++ fused scatter (csrc/fused_scatter.{cu,cpp}), built on demand.

Built with `torch.utils.cpp_extension.load` the first time a CUDA engine asks for it (once per
machine: torch caches the build under TORCH_EXTENSIONS_DIR). Where there is no CUDA toolchain, or
the build fails, `available()` is False and the Triton kernels are used; installing the package
never needs a compiler. VLLM_DELTA_NO_CUDA_EXT=1 skips the build.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_EXT = None
_ERROR: str | None = None
_TRIED = False
VEC = 1  # slots per thread per step in the block kernels (1, 4 or 8): 1 measured fastest (H200)


def source_dir() -> Path | None:
    here = Path(__file__).resolve()
    # installed: vllm_delta/_csrc (setup.py maps the repository's csrc/ there); editable: ../../csrc
    for d in (here.parents[1] / "_csrc", here.parents[2] / "csrc"):
        if (d / "fused_scatter.cu").is_file() and (d / "fused_scatter.cpp").is_file():
            return d
    return None


def load():
    """The extension module, building it if needed; None where it can't be built (see `error()`)."""
    global _EXT, _ERROR, _TRIED
    if _TRIED:
        return _EXT
    with _LOCK:
        if _TRIED:
            return _EXT
        try:
            if os.environ.get("VLLM_DELTA_NO_CUDA_EXT") == "1":
                raise RuntimeError("disabled by VLLM_DELTA_NO_CUDA_EXT=1")
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            src = source_dir()
            if src is None:
                raise RuntimeError("csrc/fused_scatter.{cu,cpp} not found next to the package")
            from torch.utils.cpp_extension import load as build

            _EXT = build(
                name="vllm_delta_fused_scatter",
                sources=[str(src / "fused_scatter.cpp"), str(src / "fused_scatter.cu")],
                extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
                verbose=os.environ.get("VLLM_DELTA_VERBOSE_BUILD") == "1",
            )
        except Exception as exc:  # noqa: BLE001 - any failure means: use Triton instead
            _ERROR = f"{type(exc).__name__}: {exc}"
            log.info("CUDA fused scatter unavailable (%s); using Triton", _ERROR)
            _EXT = None
        _TRIED = True
    return _EXT


def available() -> bool:
    return load() is not None


def error() -> str | None:
    load()
    return _ERROR


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _vec(plan, bits) -> int:
    vec = VEC
    while vec > 1 and (
        plan.block % vec
        or plan.rel.data_ptr() % (vec * plan.rel.element_size())
        or bits.data_ptr() % (vec * bits.element_size())
    ):
        vec //= 2 if vec == 8 else 4
    return vec


def _blocks(plan, bits: torch.Tensor, write: bool) -> None:
    ext = load()
    if ext is None:
        raise RuntimeError(f"CUDA fused scatter unavailable: {_ERROR}")
    n_blocks = plan.block_base.numel()
    if not n_blocks:
        return
    ext.blocks(
        plan.base.data_ptr(),
        plan.block_base.data_ptr(),
        plan.rel.data_ptr(),
        bits.data_ptr(),
        n_blocks,
        plan.block,
        bits.element_size(),
        plan.rel.element_size(),
        _vec(plan, bits),
        write,
        _stream(bits.device),
    )


def scatter_blocks(plan, bits: torch.Tensor) -> None:
    _blocks(plan, bits, True)


def gather_blocks(plan, out: torch.Tensor) -> None:
    _blocks(plan, out, False)


def gather_addr(base: torch.Tensor, addresses: torch.Tensor, out: torch.Tensor) -> None:
    ext = load()
    if ext is None:
        raise RuntimeError(f"CUDA fused scatter unavailable: {_ERROR}")
    addr = addresses.to(torch.int64).contiguous()
    ext.gather_addr(
        base.data_ptr(), addr.data_ptr(), out.data_ptr(), addr.numel(), out.element_size(), _stream(out.device)
    )
