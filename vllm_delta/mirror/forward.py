"""The ledger flowing back: the destination's replica reports, forwarded to the source's ledger.

Replicas in a region report to the regional (destination) store. Each pass, the mirror copies every
report that changed into the source's `replicas/` as `<region>.<replica id>.json`, with `region` set
and everything else as the replica wrote it, its heartbeat included: a mirror that stops forwarding
lets the forwarded reports go stale, and the trainer's `max_staleness` gate stops counting them,
exactly as for a replica that stopped. A forwarded report whose regional original is gone (expired,
deleted) is deleted from the source. `vllm-delta fleet SRC` then shows the whole fleet, and
`Publisher(max_staleness=K)` waits on the replicas of every region.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

from ..store import DeltaStore
from ..store.replicas import REPLICAS_DIR, read_reports

log = logging.getLogger(__name__)

MAX_ID = 128  # replica ids (replicas.valid_replica_id)


def forwarded_id(region: str, replica_id: str) -> str:
    """`<region>.<replica id>`, shortened with a hash of the original when it would be too long."""
    fid = f"{region}.{replica_id}"
    if len(fid) <= MAX_ID:
        return fid
    digest = hashlib.sha256(replica_id.encode()).hexdigest()[:12]
    return f"{fid[: MAX_ID - 13]}-{digest}"


class LedgerForwarder:
    def __init__(self, src: DeltaStore, dst: DeltaStore, region: str):
        self.src = src
        self.dst = dst
        self.region = region
        self._sent: dict[str, float] = {}  # forwarded id -> the heartbeat forwarded last
        self.enabled = True

    def forward(self) -> int:
        """Forward the reports that changed; returns how many were written."""
        if not self.enabled:
            return 0
        live: set[str] = set()
        written = 0
        try:
            for report in read_reports(self.dst.objects):
                fid = forwarded_id(self.region, report.replica_id)
                live.add(fid)
                if self._sent.get(fid) == report.heartbeat:
                    continue
                out = dataclasses.replace(report, replica_id=fid, region=report.region or self.region)
                self.src.objects.write(REPLICAS_DIR, f"{fid}.json", out.to_json().encode())
                self._sent[fid] = report.heartbeat
                written += 1
            prefix = f"{self.region}."
            for name in self.src.objects.names(REPLICAS_DIR):
                if name.startswith(prefix) and name.endswith(".json") and name[: -len(".json")] not in live:
                    self.src.objects.delete(REPLICAS_DIR, name)
                    self._sent.pop(name[: -len(".json")], None)
        except PermissionError as exc:
            self.enabled = False
            log.warning(
                "mirror: no write access to %s: the ledger is not forwarded (its max_staleness gate does not see "
                "region %r): %s",
                self.src.uri,
                self.region,
                exc,
            )
        return written


__all__ = ["LedgerForwarder", "forwarded_id"]
