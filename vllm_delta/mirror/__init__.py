"""Regions: a mirror follows one store into another, verified and atomic (issue 20).

    from vllm_delta.mirror import Mirror, MirrorOptions
    from vllm_delta import DeltaStore

    src = DeltaStore("s3://trainer-bucket/run1", storage_options={...})
    dst = DeltaStore("s3://eu-bucket/run1", storage_options={...})     # another endpoint, other keys
    Mirror(src, dst, MirrorOptions(region="eu")).follow()             # until stopped

    vllm-delta mirror s3://trainer-bucket/run1 s3://eu-bucket/run1 --follow --region eu \\
        --src-storage-options '{...}' --dst-storage-options '{...}'

Each version is read once from the source, verified (sha256 of every file, headers) and made
visible in the destination only whole (records last); assets and marks follow; the regional
replicas' reports flow back into the source's ledger (marked with the region); one mirror per
destination (a lease). runner.py has the pass, copy.py the copying, forward.py the ledger, lease.py
the lease; docs/DEPLOY.md ("Regions") the deployment.
"""

from __future__ import annotations

import threading
from typing import Any

from ..store import DeltaStore
from .copy import Copied, Corrupt
from .forward import forwarded_id
from .lease import LEASE_FOLDER, LEASE_NAME, Lease, LeaseDoc
from .options import MirrorOptions
from .runner import Mirror, MirrorPass


def mirror(
    src: str | DeltaStore,
    dst: str | DeltaStore,
    *,
    options: MirrorOptions | None = None,
    follow: bool = False,
    stop: threading.Event | None = None,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
) -> MirrorPass | None:
    """Mirror `src` into `dst`: one pass (returned), or, with `follow`, passes until `stop` is set."""
    source = src if isinstance(src, DeltaStore) else DeltaStore(src, storage_options=src_storage_options)
    dest = dst if isinstance(dst, DeltaStore) else DeltaStore(dst, storage_options=dst_storage_options)
    m = Mirror(source, dest, options)
    if follow:
        m.follow(stop)
        return None
    try:
        return m.run_once()
    finally:
        m.close()


__all__ = [
    "LEASE_FOLDER",
    "LEASE_NAME",
    "Copied",
    "Corrupt",
    "Lease",
    "LeaseDoc",
    "Mirror",
    "MirrorOptions",
    "MirrorPass",
    "forwarded_id",
    "mirror",
]
