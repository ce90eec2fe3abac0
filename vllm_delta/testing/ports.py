"""A free TCP port on 127.0.0.1 for a test server (vLLM, rclone's S3, torch.distributed's rendezvous)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on now (the OS picks it; a race with another process is possible, rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = ["free_port"]
