"""The worker ranks as the API process knows them, with as few calls into them as possible.

Every call goes over rpc.Workers (vLLM's collective_rpc through the engine core: every rank answers).
What is known without asking them (`Served`): the served version and checksum as last read or
written, and the served version's per-tensor sums (the sums staged partials add to; they are those
of its header, so they stay valid while the ranks report the same version and checksum), and rank 0's
last status (coverage, tensors through vLLM's path). And the download cache the API process fills for
the ranks of its host: pruned after every update and prefetch (shared/cache_keep.py: the policy the
weight-transfer backend keeps too).

Every served version learnt here is told to the version gate (gating.py: it wakes requests waiting
for it) and to the metrics. A read that finds a version no update of this process wrote (one past
the plugin) is an outside change (`on_outside_change`: LiveChecks forgets the live sums then, which
are unknown until recomputed; it is their one writer).

Data parallelism: every read asks every rank of every engine core. The engines must serve the same
version; if they ever do not (a rollback that failed, a write past the plugin), the read is loud: an
error log, `engines_disagree` in status, the gauge `vllm_delta_engines_disagree`, the served version
taken as the lowest any engine serves (the version gate never admits a request on weights older
than its bound), an outside change (the live sums forgotten), and EnginesDisagreeError for the update that read it.
Live sums are per world (two_phase.worlds: the ranks that hold one copy of the weights).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...checksums import Sums, add_sums
from ...errors import DeltaError, EnginesDisagreeError
from ...format import VersionHeader
from ...server_api import EngineServed
from ..shared.cache_keep import PRUNE_FAILED, CacheKeeper
from ..shared.messages import WorkerStatus
from ..shared.plan import UpdatePlan
from ..shared.two_phase import worlds
from .api_process import ApiProcess
from .gating import VersionGate
from .live_sums import LiveCopy, live_copies
from .metrics import metrics

if TYPE_CHECKING:
    from ...store import DeltaStore

log = logging.getLogger(__name__)

SEEN_S = 30.0  # the follower's polls reuse the served version read from the workers this recently


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Served:
    """The served version as last read from the ranks (or written), and its recorded sums."""

    version: int | None = None
    checksum: str | None = None
    seen: float = float("-inf")  # time.monotonic() of the read or the update
    sums: Sums | None = None  # the served version's per-tensor sums (its header's), when known


class Ranks:
    """Reads the ranks (agreeing, or an error) and keeps what they serve."""

    def __init__(
        self,
        api: ApiProcess,
        store: Callable[[], DeltaStore],
        gate: VersionGate,
        cache: Callable[[], CacheKeeper],
    ) -> None:
        self.api = api
        self._store = store
        self._cache = cache
        self.gate = gate
        # Told when the weights changed in a way no update of this process made (LiveChecks: the live
        # sums are unknown then). Set by whoever keeps state that such a change invalidates.
        self.on_outside_change: Callable[[], None] = _nothing
        self.served = Served()
        self.view: WorkerStatus | None = None  # rank 0's last status: coverage, tensors through vLLM's path
        self.engines: list[EngineServed] = []  # every engine's served version at the last read ([]: one engine)
        self.disagreement: str | None = None  # how the engines differed at the last read (None: they agree)

    def seen_recently(self) -> bool:
        return time.monotonic() - self.served.seen < SEEN_S

    async def read(self, *, live_sums: bool = False, agree: bool = True) -> tuple[WorkerStatus, list[WorkerStatus]]:
        """Every rank's status (one RPC): rank 0's, and every rank's in (engine, rank) order, after checking
        that the ranks of each engine agree (DeltaError) and that the engines do: if not, loudly, and
        with `agree` (what an update needs) EnginesDisagreeError."""
        per_engine = (await self.api.workers.status(live_sums=live_sums)).per_engine()
        engines = []
        for index, ranks in enumerate(per_engine):
            versions = {(r.version, r.checksum) for r in ranks}
            if len(versions) != 1:
                of = f" of engine {index}" if len(per_engine) > 1 else ""
                raise DeltaError(f"worker ranks{of} disagree on the served version: {sorted(versions, key=str)}")
            engines.append(
                EngineServed(
                    engine=index, ranks=len(ranks), version=ranks[0].version, version_checksum=ranks[0].checksum
                )
            )
        self.engines = engines if len(engines) > 1 else []
        if len({(e.version, e.version_checksum) for e in engines}) > 1:
            self._engines_disagree(engines)
            if agree:
                raise EnginesDisagreeError(f"{self.disagreement}; restart the server")
            return per_engine[0][0], [r for engine in per_engine for r in engine]
        if self.disagreement is not None:
            self.disagreement = None
            self._gauge(0)
        rank0 = per_engine[0][0]
        ranks = [r for engine in per_engine for r in engine]
        known = self.served
        if known.seen > float("-inf") and (known.version, known.checksum) != (rank0.version, rank0.checksum):
            # Not an update of this process (one past the plugin): an outside change.
            log.warning(
                "vllm-delta: the workers serve version %s (%s), not %s (%s) as last known",
                rank0.version,
                rank0.checksum,
                known.version,
                known.checksum,
            )
            self.on_outside_change()
        self.view = rank0
        self.note_served(rank0.version, rank0.checksum)
        return rank0, ranks

    def _engines_disagree(self, engines: list[EngineServed]) -> None:
        """Loud: the engines serve different versions. Requests are gated on the lowest of them."""
        self.disagreement = "the data-parallel engines serve different versions: " + ", ".join(
            f"engine {e.engine}: version {e.version} ({e.version_checksum})" for e in engines
        )
        log.error("vllm-delta: %s; updates are refused: restart the server", self.disagreement)
        self._gauge(1)
        self.on_outside_change()
        known = [e.version for e in engines if e.version is not None]
        lowest = min(known) if len(known) == len(engines) else None
        self.note_served(lowest, None)

    @staticmethod
    def _gauge(value: int) -> None:
        m = metrics()
        if m is not None:
            m.engines_disagree.set(value)

    def note_served(self, version: int | None, checksum: str | None, sums: Sums | None = None) -> None:
        known = self.served
        if sums is None and (known.version, known.checksum) == (version, checksum):
            sums = known.sums  # the same version: its recorded sums still hold
        self.served = Served(version, checksum, time.monotonic(), sums)
        self.gate.note_served(version)  # wakes requests waiting for this version
        m = metrics()
        if m is not None and version is not None:
            m.served_version.set(version)

    def written(self, plan: UpdatePlan, header: VersionHeader) -> Sums:
        """An update wrote `plan`: the target is served, with its header's sums (returned) and chain."""
        recorded = dict(zip(header.tensors.names, header.tensors.sum_values()))
        self.note_served(plan.target, header.checksum, recorded)
        if plan.undo_to is not None:
            self._cache().undone(plan.target)
        else:
            self._cache().applied(plan.versions, plan.reanchor)
        return recorded

    async def prune_cache(self, served: int | None, staged: list[int]) -> None:
        """The download cache after an update or a prefetch (CacheKeeper.prune, bounded by the running
        operation's deadline). Never fails either: a cache that can't be pruned now is pruned next time."""
        if served is None or self._store().is_local:
            return
        in_thread = self.api.deadline.in_thread
        try:
            await in_thread(functools.partial(self._cache().prune, served, staged))
            m = metrics()
            if m is not None:
                m.cache_bytes.set(await in_thread(self._store().cache.total_bytes))
        except Exception as exc:  # noqa: BLE001
            log.warning(PRUNE_FAILED, exc)

    async def served_sums(self, served: WorkerStatus) -> Sums:
        """The per-tensor sums staged partials add to: the served version's recorded sums (known since
        the last update, else asked once), or the live sums when the served version is unknown (those
        of every engine's copy of the weights, which must be the same)."""
        if served.version is None:
            ranks = (await self.api.workers.live_sums()).all()
            copies = [add_sums(ranks[i].sums for i in world) for world in worlds(ranks)]
            if any(c != copies[0] for c in copies[1:]):
                raise EnginesDisagreeError("the data-parallel engines hold different weights (no store version)")
            return copies[0]
        known = self.served
        if (known.version, known.checksum) == (served.version, served.checksum) and known.sums is not None:
            return known.sums
        sums = (await self.api.workers.served_sums()).all()[0].sums
        self.note_served(served.version, served.checksum, sums)
        return sums

    async def live_state(self) -> tuple[WorkerStatus, list[LiveCopy]]:
        """Rank 0's status and the live per-tensor sums of every copy of the weights (one per world: each
        engine's, or every engine's at once), in one RPC (two the first time, when the layout has to be
        probed)."""
        served, ranks = await self.read(live_sums=True, agree=False)  # engines that disagree: each one's sums
        if await self._ensure_probed(served):
            served, ranks = await self.read(live_sums=True, agree=False)
        copies = live_copies(ranks, self.api.engines)
        if copies is None:
            raise DeltaError("a worker rank did not report its live sums")
        return served, copies

    async def _ensure_probed(self, served: WorkerStatus) -> bool:
        """Probe the layout if no rank has yet; True if it had to."""
        if served.probed:
            return False
        api = self.api
        until = time.monotonic() + api.spec.update_timeout_s
        target = served.version
        if target is None:
            target = await api.deadline.in_thread(functools.partial(self._store().resolve, "latest"), until)
        (await api.workers.probe(api.spec, target)).all()
        return True
