"""The (device, backend) parametrization of the apply tests: CPU pairs here, GPU pairs marked `gpu`."""

from __future__ import annotations

import pytest
import torch

from vllm_delta.apply import scatter as scatter_ops


def cases():
    """(device, backend) pairs: CPU ones that can run here, GPU ones marked `gpu`."""
    out = [pytest.param("cpu", b, id=f"cpu-{b}") for b in scatter_ops.available_backends("cpu")]
    out += [pytest.param("cuda", b, id=f"cuda-{b}", marks=pytest.mark.gpu) for b in ("cuda", "triton", "torch")]
    return out


def need(device: str, backend: str) -> None:
    """Skip (or, for a failed CUDA build on a GPU machine, fail) when the pair can't run here."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        if backend == "cuda":
            from vllm_delta.apply import _cuda

            if not _cuda.available():
                pytest.fail(f"CUDA fused scatter did not build: {_cuda.error()}")
        if backend == "triton" and scatter_ops.triton is None:
            pytest.skip("no Triton")
