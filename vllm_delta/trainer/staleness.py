"""Bounded staleness through the store alone: `Publisher(max_staleness=K, min_replicas=R)`.

Before version N is published, at least R replicas that report to the store's ledger
(`vllm_delta.store.ledger`, servers started with `"delta_report": true`) must serve a version >= N - K,
with a fresh heartbeat. `publish` blocks until then, or raises StalenessTimeoutError after
`timeout_s`. Versions N <= first + K (the first version this Publisher published) never wait: no
replica can be more than K behind before K versions exist, and the servers usually start from the
first one. This is the knob RL frameworks expose as `max_staleness` / `max_staleness_steps`,
enforced with no network path from the trainer to the servers.

Bad-version marks (`vllm_delta.store.marks`): a replica that cannot get closer to N - K because of them
counts as caught up. Precisely, a live replica serving s counts for N when s >= N - K, or when the
committed versions in (s, N - K] are all *blocked* (a marked version lies on the chain of each) and
there is at least one: every step it could take within the bound passes through a bad version, and
only the trainer's next anchor can move it (so a marked version frees a gated trainer at once, and
the Publisher makes its next version an anchor). The marks are read (one listing of `bad/`) only
while the gate waits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..errors import DeltaError, StalenessTimeoutError, http_status
from ..store import DeltaStore
from ..store.ledger import Ledger, ReplicaReport, count_within
from ..store.marks import BadMark, blocked_by

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


@dataclass
class _MarkView:
    """What one wait remembers while marks matter: the committed versions up to the floor (listed once
    per set of marks: they do not change while the trainer waits)."""

    versions: list[int] | None = None
    marks: frozenset[int] = frozenset()


class StalenessGate:
    def __init__(self, store: DeltaStore, policy: StalenessPolicy, *, stale_after_s: float | None = None):
        self.policy = policy
        self.store = store
        self.ledger = Ledger(store) if stale_after_s is None else Ledger(store, stale_after_s=stale_after_s)
        self.first: int | None = None
        self.waited_s = 0.0  # total time publish spent waiting here
        self.released_by: frozenset[int] = frozenset()  # marked versions that let the last wait end

    def wait(self, version: int) -> float:
        """Block until `version` may be published; returns the seconds waited. `released_by` then names
        the marked versions that let replicas count although they serve less than `version - K`. A
        store fault while reading the ledger (5xx) counts as no replica this poll, not as an error."""
        if self.first is None:
            self.first = version
        p = self.policy
        self.released_by = frozenset()
        if version <= self.first + p.max_staleness:
            return 0.0
        floor = version - p.max_staleness
        t0 = time.monotonic()
        next_log = t0 + 10.0
        view = _MarkView()
        while True:
            try:
                live, have, released = self._count(version, floor, view)
            except DeltaError as exc:
                if http_status(exc) < 500:
                    raise
                log.warning("publish %d: could not read the ledger (%s); trying again", version, exc)
                live, have, released = [], 0, set()
            if have >= p.min_replicas:
                waited = time.monotonic() - t0
                self.waited_s += waited
                self.released_by = frozenset(released)
                return waited
            now = time.monotonic()
            served = sorted(r.served_version for r in live if r.served_version is not None)
            if now - t0 > p.timeout_s:
                raise StalenessTimeoutError(
                    f"{have} of {p.min_replicas} required replicas serve a version >= {floor} "
                    f"after {p.timeout_s:.0f} s (live replicas serve {served or 'nothing'}; servers report to the "
                    f'store\'s ledger only with "delta_report": true; a version every replica skips can be '
                    "marked bad: vllm-delta mark-bad)",
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

    def _count(self, version: int, floor: int, view: _MarkView) -> tuple[list[ReplicaReport], int, set[int]]:
        """The live replicas, how many count for `version`, and the marks that let some of them count."""
        p = self.policy
        live = self.ledger.live()
        have = count_within(live, version, p.max_staleness)
        released: set[int] = set()
        if have >= p.min_replicas:
            return live, have, released
        marks = self.store.marks()
        if not marks:
            return live, have, released
        if view.versions is None or frozenset(marks) != view.marks:
            view.versions, view.marks = [v for v in self.store.versions() if v <= floor], frozenset(marks)
        for r in live:
            if r.served_version is not None and r.served_version < floor:
                stuck = self._stuck_on(r, view.versions, floor, marks)
                if stuck:
                    have += 1
                    released |= stuck
        return live, have, released

    def _stuck_on(self, replica: ReplicaReport, versions: list[int], floor: int, marks: dict[int, BadMark]) -> set[int]:
        """The marks that block every committed version in (served, floor], if they all are (and there
        is one); else the empty set: the replica can still get closer on its own."""
        assert replica.served_version is not None
        ahead = [v for v in versions if replica.served_version < v <= floor]
        found: set[int] = set()
        for v in ahead:
            mark = self._blocking(v, marks)
            if mark is None:
                return set()
            found.add(mark.version)
        return found

    def _blocking(self, version: int, marks: dict[int, BadMark]) -> BadMark | None:
        """The first mark on `version`'s chain, if any (records come from the store's cache after the
        first read). A chain that cannot be read counts as unblocked: the gate keeps waiting."""
        try:
            return blocked_by(self.store.chain(version), marks)
        except DeltaError:
            return None
