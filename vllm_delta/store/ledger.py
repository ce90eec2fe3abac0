"""The replica ledger: where a fleet of servers stands, written into the store they follow.

A server started with `"delta_report": true` (it needs write access to the store) writes one small
JSON object, `replicas/<replica id>.json`, when its served version changes and as a heartbeat. A
trainer that cannot reach any server reads the ledger through the store alone: `vllm-delta fleet
URI`, `Publisher(max_staleness=K, min_replicas=R)`, and `retain`, which never deletes a version a
live replica serves. Layout and fields: docs/FORMAT.md ("Replica reports").

Reports are advisory: a garbage or foreign object is skipped with a warning (it must never hide the
other replicas or break a trainer), and a report whose heartbeat is older than `stale_after_s` is
stale (the replica may be dead, or cut off from the store); older than `expire_after_s`, it is
deleted by `expire` (run by `retain` and by reporting servers). The report's schema and the reading
that retention shares live in `replicas.py`; this module is the fleet view over a `DeltaStore`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import DeltaError, VersionNotFoundError
from .delta_store import DeltaStore
from .marks import BadMark, blocked_by
from .replicas import (
    EXPIRE_AFTER_S,
    REPLICAS_DIR,
    STALE_AFTER_S,
    ReplicaReport,
    expire_reports,
    is_live,
    live_versions,
    read_reports,
    valid_replica_id,
)


@dataclass(frozen=True)
class ReplicaState:
    """A report as the ledger's reader sees it now."""

    report: ReplicaReport
    age_s: float  # since the last heartbeat
    stale: bool
    lag: int | None  # versions behind the store's newest
    checksum_ok: bool | None  # live checksum == the store's record of the served version (None: unknown)
    marked_bad: str | None = None  # the served version is marked bad: the mark's reason
    blocked_by: int | None = None  # behind the newest version, which lies past this marked version


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
        self.store.objects.write(REPLICAS_DIR, f"{report.replica_id}.json", report.to_json().encode())

    def remove(self, replica_id: str) -> None:
        self.store.objects.delete(REPLICAS_DIR, f"{replica_id}.json")

    def reports(self) -> list[ReplicaReport]:
        """Every readable report; garbage is skipped with a warning."""
        return read_reports(self.store.objects)

    def states(self, *, now: float | None = None, newest: int | None = None) -> list[ReplicaState]:
        """Reports with their age, staleness, lag behind `newest` (default: the store's latest) and
        whether the live checksum matches the store's record of the served version."""
        now = time.time() if now is None else now
        newest = self.store.latest() if newest is None else newest
        marks = self.store.marks()
        blocking = self._mark_on_chain(newest, marks)
        out = []
        for r in sorted(self.reports(), key=lambda r: r.replica_id):
            age = max(0.0, now - r.heartbeat)
            lag = None if newest is None or r.served_version is None else max(0, newest - r.served_version)
            served = r.served_version
            blocked = blocking is not None and lag and served is not None and blocking.version > served
            state = ReplicaState(
                r,
                age,
                age > self.stale_after_s,
                lag,
                self._checksum_ok(r),
                marked_bad=self._marked(r, marks),
                blocked_by=blocking.version if blocked and blocking is not None else None,
            )
            out.append(state)
        return out

    def _mark_on_chain(self, newest: int | None, marks: dict[int, BadMark]) -> BadMark | None:
        if newest is None or not marks:
            return None
        try:
            return blocked_by(self.store.chain(newest), marks)
        except DeltaError:
            return None

    def _marked(self, r: ReplicaReport, marks: dict[int, BadMark]) -> str | None:
        mark = marks.get(r.served_version) if r.served_version is not None else None
        if mark is None:
            return None
        try:
            return mark.reason if mark.matches(self.store.record(mark.version)) else None
        except VersionNotFoundError:
            return None

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
        return [r for r in self.reports() if is_live(r, now=now, stale_after_s=self.stale_after_s)]

    def live_versions(self, *, now: float | None = None) -> set[int]:
        """Versions that live replicas serve (`retain` keeps them)."""
        now = time.time() if now is None else now
        return live_versions(self.reports(), now=now, stale_after_s=self.stale_after_s)

    def expire(self, *, now: float | None = None) -> list[str]:
        """Delete reports older than `expire_after_s`; returns their replica ids."""
        now = time.time() if now is None else now
        return expire_reports(self.store.objects, self.reports(), now=now, expire_after_s=self.expire_after_s)


def count_within(reports: Iterable[ReplicaReport], version: int, max_staleness: int) -> int:
    """How many replicas serve a version within `max_staleness` of `version` (>= version - K)."""
    return sum(1 for r in reports if r.served_version is not None and r.served_version >= version - max_staleness)


__all__ = ["Ledger", "ReplicaReport", "ReplicaState", "count_within", "REPLICAS_DIR", "valid_replica_id"]
