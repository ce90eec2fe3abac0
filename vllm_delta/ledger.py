"""The replica ledger: where a fleet of servers stands, written into the store they follow.

A server started with `"delta_report": true` (it needs write access to the store) writes one small
JSON object, `replicas/<replica id>.json`, when its served version changes and as a heartbeat. A
trainer that cannot reach any server reads the ledger through the store alone: `vllm-delta fleet
URI`, `Publisher(max_staleness=K, min_replicas=R)`, and `retain`, which never deletes a version a
live replica serves. Layout and fields: docs/FORMAT.md ("Replica ledger").

Reports are advisory: a garbage or foreign object is skipped with a warning (it must never hide the
other replicas or break a trainer), and a report whose heartbeat is older than `stale_after_s` is
stale (the replica may be dead, or cut off from the store); older than `expire_after_s`, it is
deleted by `expire` (run by `retain` and by reporting servers).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

from .errors import FormatError, VersionNotFoundError
from .store import DeltaStore

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


@dataclass(frozen=True)
class ReplicaReport:
    """What one server says about itself (one JSON object under `replicas/`)."""

    replica_id: str
    host: str
    served_version: int | None
    checksum: str | None  # the live checksum of the served weights (what /v1/delta/status reports)
    version_checksum: str | None  # what the served version's header records
    newest_seen: int | None  # the newest version the replica has seen in the store
    last_pause_ms: float | None
    last_error: str | None
    heartbeat: float  # unix time of this report
    started: float  # unix time the replica started

    @property
    def lag(self) -> int | None:
        """Versions between the newest seen and the served one."""
        if self.newest_seen is None or self.served_version is None:
            return None
        return max(0, self.newest_seen - self.served_version)

    def to_json(self) -> bytes:
        doc = {"format": REPORT_FORMAT, "format_version": REPORT_FORMAT_VERSION, **asdict(self)}
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, where: str = "report") -> ReplicaReport:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != REPORT_FORMAT:
                raise ValueError(f"not a {REPORT_FORMAT} document")
            if doc.get("format_version") != REPORT_FORMAT_VERSION:
                raise ValueError(f"unknown format version {doc.get('format_version')!r}")
            report = cls(**{f.name: doc[f.name] for f in fields(cls)})
            report.validate()
        except (ValueError, TypeError, KeyError) as exc:
            raise FormatError(f"unreadable replica report {where}: {str(exc)[:200]}") from None
        return report

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
        for name in ("host", "checksum", "version_checksum", "last_error"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name} must be a string or null")


@dataclass(frozen=True)
class ReplicaState:
    """A report as the ledger's reader sees it now."""

    report: ReplicaReport
    age_s: float  # since the last heartbeat
    stale: bool
    lag: int | None  # versions behind the store's newest
    checksum_ok: bool | None  # live checksum == the store's record of the served version (None: unknown)


class Ledger:
    def __init__(
        self, store: DeltaStore, *, stale_after_s: float = STALE_AFTER_S, expire_after_s: float = EXPIRE_AFTER_S
    ):
        self.store = store
        self.stale_after_s = stale_after_s
        self.expire_after_s = expire_after_s

    def report(self, report: ReplicaReport) -> None:
        """Write (replace) one replica's report."""
        report.validate()
        self.store.write_object(REPLICAS_DIR, f"{report.replica_id}.json", report.to_json())

    def remove(self, replica_id: str) -> None:
        self.store.delete_object(REPLICAS_DIR, f"{replica_id}.json")

    def reports(self) -> list[ReplicaReport]:
        """Every readable report; garbage is skipped with a warning."""
        out = []
        for name in self.store.list_objects(REPLICAS_DIR):
            if not name.endswith(".json"):
                continue
            try:
                out.append(ReplicaReport.from_json(self.store.read_object(REPLICAS_DIR, name), where=name))
            except FileNotFoundError:
                continue  # expired or replaced between the listing and the read
            except FormatError as exc:
                log.warning("%s: ignoring %s/%s: %s", self.store.uri, REPLICAS_DIR, name, exc)
        return out

    def states(self, *, now: float | None = None, newest: int | None = None) -> list[ReplicaState]:
        """Reports with their age, staleness, lag behind `newest` (default: the store's latest) and
        whether the live checksum matches the store's record of the served version."""
        now = time.time() if now is None else now
        newest = self.store.latest() if newest is None else newest
        out = []
        for r in sorted(self.reports(), key=lambda r: r.replica_id):
            age = max(0.0, now - r.heartbeat)
            lag = None if newest is None or r.served_version is None else max(0, newest - r.served_version)
            out.append(ReplicaState(r, age, age > self.stale_after_s, lag, self._checksum_ok(r)))
        return out

    def _checksum_ok(self, r: ReplicaReport) -> bool | None:
        if r.served_version is None or r.checksum is None:
            return None
        try:
            return self.store.record(r.served_version).checksum == r.checksum
        except VersionNotFoundError:
            return None

    def live(self, *, now: float | None = None) -> list[ReplicaReport]:
        """Reports whose heartbeat is fresh."""
        now = time.time() if now is None else now
        return [r for r in self.reports() if now - r.heartbeat <= self.stale_after_s]

    def live_versions(self, *, now: float | None = None) -> set[int]:
        """Versions that live replicas serve (`retain` keeps them)."""
        return {r.served_version for r in self.live(now=now) if r.served_version is not None}

    def expire(self, *, now: float | None = None) -> list[str]:
        """Delete reports older than `expire_after_s`; returns their replica ids."""
        now = time.time() if now is None else now
        gone = [r.replica_id for r in self.reports() if now - r.heartbeat > self.expire_after_s]
        for replica_id in gone:
            self.remove(replica_id)
        return gone


def count_within(reports: Iterable[ReplicaReport], version: int, max_staleness: int) -> int:
    """How many replicas serve a version within `max_staleness` of `version` (>= version - K)."""
    return sum(1 for r in reports if r.served_version is not None and r.served_version >= version - max_staleness)


__all__ = ["Ledger", "ReplicaReport", "ReplicaState", "count_within", "REPLICAS_DIR"]
