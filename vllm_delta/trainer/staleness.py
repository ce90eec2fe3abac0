"""Bounded staleness through the store alone: `Publisher(max_staleness=K, min_replicas=R)`.

Before version N is published, at least R replicas that report to the store's ledger
(`vllm_delta.ledger`, servers started with `"delta_report": true`) must serve a version >= N - K,
with a fresh heartbeat. `publish` blocks until then, or raises StalenessTimeoutError after
`timeout_s`. Versions N <= first + K (the first version this Publisher published) never wait: no
replica can be more than K behind before K versions exist, and the servers usually start from the
first one. This is the knob RL frameworks expose as `max_staleness` / `max_staleness_steps`,
enforced with no network path from the trainer to the servers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..errors import StalenessTimeoutError
from ..ledger import Ledger, count_within
from ..store import DeltaStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StalenessPolicy:
    max_staleness: int
    min_replicas: int = 1
    timeout_s: float = 600.0
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if self.min_replicas < 1:
            raise ValueError("min_replicas must be >= 1")
        if self.timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError("timeout_s and poll_s must be positive")


class StalenessGate:
    def __init__(self, store: DeltaStore, policy: StalenessPolicy, *, stale_after_s: float | None = None):
        self.policy = policy
        self.ledger = Ledger(store) if stale_after_s is None else Ledger(store, stale_after_s=stale_after_s)
        self.first: int | None = None
        self.waited_s = 0.0  # total time publish spent waiting here

    def wait(self, version: int) -> float:
        """Block until `version` may be published; returns the seconds waited."""
        if self.first is None:
            self.first = version
        p = self.policy
        if version <= self.first + p.max_staleness:
            return 0.0
        t0 = time.monotonic()
        next_log = t0 + 10.0
        while True:
            live = self.ledger.live()
            have = count_within(live, version, p.max_staleness)
            if have >= p.min_replicas:
                waited = time.monotonic() - t0
                self.waited_s += waited
                return waited
            now = time.monotonic()
            served = sorted(r.served_version for r in live if r.served_version is not None)
            if now - t0 > p.timeout_s:
                raise StalenessTimeoutError(
                    f"{have} of {p.min_replicas} required replicas serve a version >= {version - p.max_staleness} "
                    f"after {p.timeout_s:.0f} s (live replicas serve {served or 'nothing'}; servers report to the "
                    f'store\'s ledger only with "delta_report": true)',
                    version=version,
                )
            if now >= next_log:
                log.info(
                    "publish %d waits for %d replica(s) within %d versions; live: %s",
                    version,
                    p.min_replicas,
                    p.max_staleness,
                    served,
                )
                next_log = now + 10.0
            time.sleep(p.poll_s)
