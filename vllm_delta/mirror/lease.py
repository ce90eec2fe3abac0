"""The destination store's lease: one mirror writes a store, never two.

`mirror/lease.json` in the destination store names the mirror that writes it (owner, host, pid,
source, region) and its heartbeat. A mirror takes the lease when there is none, when the one there
is its own (same `owner`: a restarted mirror takes its lease back at once, and the old incarnation, if it still
runs, stops at its next check: each incarnation writes a token of its own), or when the holder's
heartbeat is older than `ttl_s` (the holder died); otherwise it stops with MirrorLeaseError naming the
holder. It renews the heartbeat every pass and checks that the lease is still its own before every
record it commits, and deletes it when it stops cleanly.

**The guarantee.** Object stores here have no conditional write (S3's If-None-Match is not used:
s3fs does not pass it, and not every S3-compatible server honours it). Taking the lease is therefore
read, write, wait `settle_s`, read again: of two mirrors that start together, the one whose write
lands last keeps the lease and the other sees it and stops. Two mirrors can both pass only if one's
read and write straddle the other's whole write-wait-read (a pause of more than `settle_s` between
a read and a write); then the check before every commit stops one of them before its next record,
and records are write-once (local stores: `link`, which never replaces; S3: checked before the
PUT), so at most one version of the loser can land: the same bytes when both mirror the same source.
Heartbeats compare clocks of two hosts: keep `ttl_s` well above their skew.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import ClassVar

from ..errors import DeltaError, FormatError, MirrorLeaseError
from ..store import DeltaStore
from ..wire import Document, Number

log = logging.getLogger(__name__)

LEASE_FOLDER = "mirror"
LEASE_NAME = "lease.json"
LEASE_FORMAT = "vllm-delta-mirror-lease"
LEASE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class LeaseDoc(Document):
    """What `mirror/lease.json` says."""

    FORMAT: ClassVar[str] = LEASE_FORMAT
    FORMAT_VERSIONS: ClassVar[tuple[int, ...]] = (LEASE_FORMAT_VERSION,)
    DESCRIPTION: ClassVar[str] = "mirror lease"

    owner: str
    token: str  # this incarnation of the owner: a restarted mirror (same owner) has a new one
    host: str
    pid: int
    src: str  # the source store's URI
    region: str
    acquired: Number  # unix times
    heartbeat: Number

    def describe(self, now: float) -> str:
        return (
            f"{self.owner} (host {self.host}, pid {self.pid}, mirroring {self.src} as region {self.region!r}, "
            f"heartbeat {max(0.0, now - self.heartbeat):.0f} s ago)"
        )


class Lease:
    def __init__(
        self,
        dst: DeltaStore,
        owner: str,
        *,
        src: str,
        region: str,
        ttl_s: float,
        settle_s: float = 1.0,
    ):
        self.dst = dst
        self.owner = owner
        self.src = src
        self.region = region
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self._acquired: float | None = None
        self.token = secrets.token_hex(8)

    def read(self) -> LeaseDoc | None:
        """The lease as the store has it now (None: no lease; an unreadable one is treated as none)."""
        try:
            return LeaseDoc.from_json(self.dst.objects.read(LEASE_FOLDER, LEASE_NAME))
        except FileNotFoundError:
            return None
        except FormatError as exc:
            log.warning("%s: %s: taking it over", self.dst.uri, exc)
            return None

    def acquire(self) -> None:
        """Take the lease, or raise MirrorLeaseError naming the live holder."""
        now = time.time()
        held = self.read()
        if held is not None and held.owner != self.owner and now - held.heartbeat < self.ttl_s:
            raise MirrorLeaseError(
                f"store {self.dst.uri} is written by another mirror: {held.describe(now)}; one mirror per "
                f"destination (a dead holder's lease expires {self.ttl_s:.0f} s after its last heartbeat)"
            )
        if held is not None and held.owner != self.owner:
            log.warning("%s: taking over the lease of a mirror that stopped: %s", self.dst.uri, held.describe(now))
        self._acquired = now
        self._write()
        time.sleep(self.settle_s)  # a mirror that wrote at the same moment: the last write wins, the other sees it
        self.check()

    def renew(self) -> None:
        """The heartbeat, after checking the lease is still this mirror's."""
        self.check()
        self._write()

    def check(self) -> None:
        """MirrorLeaseError unless the store's lease is this mirror's, this incarnation's (before every
        commit: a restart of the same owner took it over, or another mirror did after our TTL)."""
        held = self.read()
        if held is None or (held.owner, held.token) != (self.owner, self.token):
            now = time.time()
            who = held.describe(now) if held is not None else "nobody (the lease was deleted)"
            raise MirrorLeaseError(f"this mirror ({self.owner}) lost the lease of store {self.dst.uri} to {who}")

    def release(self) -> None:
        """Delete the lease if it is still this mirror's (a clean stop); best effort."""
        try:
            held = self.read()
            if held is not None and (held.owner, held.token) == (self.owner, self.token):
                self.dst.objects.delete(LEASE_FOLDER, LEASE_NAME)
        except (OSError, DeltaError) as exc:
            log.warning("%s: could not release the mirror lease: %s", self.dst.uri, exc)

    def _write(self) -> None:
        now = time.time()
        doc = LeaseDoc(
            owner=self.owner,
            token=self.token,
            host=socket.gethostname(),
            pid=os.getpid(),
            src=self.src,
            region=self.region,
            acquired=self._acquired or now,
            heartbeat=now,
        )
        self.dst.objects.write(LEASE_FOLDER, LEASE_NAME, doc.to_json().encode())


__all__ = ["LEASE_FOLDER", "LEASE_NAME", "Lease", "LeaseDoc"]
