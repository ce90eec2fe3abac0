"""Replica reports: what one server writes about itself into the store it follows, and reading them.

A report is one small JSON object, `replicas/<replica id>.json` (docs/FORMAT.md, "Replica reports").
This module is the report's schema and the reading every consumer shares: the ledger's fleet view
(`ledger.py`) and retention (`DeltaStore.retain` protects what live replicas serve). It reaches the
store through the small-object calls alone (`ReportObjects`), so the store can use it without a
cycle. Reports are advisory: a garbage or foreign object is skipped with a warning (it must never
hide the other replicas or break a trainer).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from ..errors import FormatError
from ..wire import Document, Number

log = logging.getLogger(__name__)

REPLICAS_DIR = "replicas"
REPORT_FORMAT = "vllm-delta-replica"
REPORT_FORMAT_VERSION = 1
STALE_AFTER_S = 60.0  # a heartbeat older than this: the replica is stale
EXPIRE_AFTER_S = 24 * 3600.0  # older than this: the report is deleted
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def valid_replica_id(replica_id: object) -> bool:
    """1-128 letters, digits, '.', '_' or '-', not starting with a punctuation mark (a safe object name)."""
    return isinstance(replica_id, str) and _ID.match(replica_id) is not None


def valid_region(region: object) -> bool:
    """A region's name: like a replica id, at most 32 characters and without '.' (the separator of
    forwarded replica ids, `<region>.<replica id>`)."""
    return isinstance(region, str) and valid_replica_id(region) and len(region) <= 32 and "." not in region


@dataclass(frozen=True)
class ReplicaReport(Document):
    """What one server says about itself (one JSON object under `replicas/`)."""

    FORMAT: ClassVar[str] = REPORT_FORMAT
    FORMAT_VERSIONS: ClassVar[tuple[int, ...]] = (REPORT_FORMAT_VERSION,)
    DESCRIPTION: ClassVar[str] = "replica report"

    replica_id: str
    host: str
    served_version: int | None
    checksum: str | None  # the live checksum of the served weights (what /v1/delta/status reports)
    version_checksum: str | None  # what the served version's header records
    newest_seen: int | None  # the newest version the replica has seen in the store
    last_pause_ms: Number | None
    last_error: str | None
    heartbeat: Number  # unix time of this report
    started: Number  # unix time the replica started
    # The region of a replica whose report a mirror forwarded from a regional store (vllm_delta.mirror);
    # None for a replica that reports to this store itself. Optional: reports without it parse as None.
    region: str | None = None

    @property
    def lag(self) -> int | None:
        """Versions between the newest seen and the served one."""
        if self.newest_seen is None or self.served_version is None:
            return None
        return max(0, self.newest_seen - self.served_version)

    def validate(self) -> None:
        if not valid_replica_id(self.replica_id):
            raise ValueError(f"bad replica id {self.replica_id!r:.80}")
        for name in ("served_version", "newest_seen"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer or null")
        for name in ("heartbeat", "started"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{name} must be a number")
        if self.region is not None and not valid_region(self.region):
            raise ValueError(f"bad region {self.region!r:.80}")
        for name in ("host", "checksum", "version_checksum", "last_error"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name} must be a string or null")


class ReportObjects(Protocol):
    """What the reports are read and deleted with: a store's small objects (`DeltaStore.objects`)."""

    @property
    def uri(self) -> str: ...

    def read(self, folder: str, name: str) -> bytes: ...

    def names(self, folder: str) -> list[str]: ...

    def delete(self, folder: str, name: str) -> None: ...


def read_reports(objects: ReportObjects) -> list[ReplicaReport]:
    """Every readable report; garbage is skipped with a warning."""
    out = []
    for name in objects.names(REPLICAS_DIR):
        if not name.endswith(".json"):
            continue
        try:
            out.append(ReplicaReport.from_json(objects.read(REPLICAS_DIR, name), where=name))
        except FileNotFoundError:
            continue  # expired or replaced between the listing and the read
        except FormatError as exc:
            log.warning("%s: ignoring %s/%s: %s", objects.uri, REPLICAS_DIR, name, exc)
    return out


def is_live(report: ReplicaReport, *, now: float, stale_after_s: float = STALE_AFTER_S) -> bool:
    """Whether the report's heartbeat is fresh."""
    return now - report.heartbeat <= stale_after_s


def live_versions(reports: Iterable[ReplicaReport], *, now: float, stale_after_s: float = STALE_AFTER_S) -> set[int]:
    """Versions that live replicas serve (retention keeps them)."""
    return {
        r.served_version
        for r in reports
        if r.served_version is not None and is_live(r, now=now, stale_after_s=stale_after_s)
    }


def expire_reports(
    objects: ReportObjects,
    reports: Iterable[ReplicaReport],
    *,
    now: float,
    expire_after_s: float = EXPIRE_AFTER_S,
) -> list[str]:
    """Delete the reports older than `expire_after_s`; returns their replica ids."""
    gone = [r.replica_id for r in reports if now - r.heartbeat > expire_after_s]
    for replica_id in gone:
        objects.delete(REPLICAS_DIR, f"{replica_id}.json")
    return gone


__all__ = [
    "EXPIRE_AFTER_S",
    "REPLICAS_DIR",
    "STALE_AFTER_S",
    "ReplicaReport",
    "ReportObjects",
    "expire_reports",
    "is_live",
    "live_versions",
    "read_reports",
    "valid_region",
    "valid_replica_id",
]
