"""What a mirror is told (`vllm-delta mirror` flags, `Mirror(..., options=MirrorOptions(...))`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..store.replicas import valid_region, valid_replica_id


@dataclass(frozen=True)
class MirrorOptions:
    region: str = "mirror"  # names the destination's replicas in the source's ledger: `<region>.<replica id>`
    poll_s: float = 2.0  # seconds between passes when following
    everything: bool = False  # the first pass copies every version the source holds (default: from its newest anchor)
    keep_anchors: int | None = None  # the destination's own retention, after each mirrored anchor (None: keep all)
    owner: str | None = (
        None  # the lease's owner (default host-pid-random); a restart with the same owner resumes at once
    )
    lease_ttl_s: float = 30.0  # a holder silent this long is dead: its lease may be taken
    forward_ledger: bool = True  # forward the destination's replica reports to the source's ledger
    mark_source: bool = True  # a version corrupt in the source is also marked bad there (the trainer's gate)
    backoff_max_s: float = 30.0  # a store that is down: retried after poll_s, doubling up to this

    def __post_init__(self) -> None:
        if not valid_region(self.region):
            raise ValueError(f"region: 1-32 letters, digits, '_' or '-', not {self.region!r:.60}")
        if not self.poll_s > 0 or not self.lease_ttl_s > 0 or not self.backoff_max_s > 0:
            raise ValueError("poll_s, lease_ttl_s and backoff_max_s must be positive")
        if self.keep_anchors is not None and self.keep_anchors < 1:
            raise ValueError(f"keep_anchors must be >= 1 (or None), not {self.keep_anchors}")
        if self.owner is not None and not valid_replica_id(self.owner):
            raise ValueError(f"owner: 1-128 letters, digits, '.', '_' or '-', not {self.owner!r:.60}")


__all__ = ["MirrorOptions"]
