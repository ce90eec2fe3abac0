"""A prefetched update (POST /v1/delta/stage): staged and verified on every rank, held until an update to
the same target from the same served version writes it (then no pause waits for staging). One is held
at a time; a prefetch or update of another plan releases it first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...server_api import Method, PrefetchResult
from ..shared import rpc
from ..shared.messages import WorkerStatus
from ..shared.plan import UpdatePlan
from ..shared.two_phase import Staged
from .worker_update import WorkerUpdate


@dataclass(frozen=True)
class Prefetched:
    """A staged, verified update, with the protocol that staged it (which writes it)."""

    served: int | None  # the version served when it was staged
    plan: UpdatePlan
    staged: Staged
    steps: WorkerUpdate

    @property
    def ticket(self) -> str:
        return self.staged.update.ticket

    def result(self) -> PrefetchResult:
        return PrefetchResult(
            version=self.served,
            staged=self.plan.versions,
            target=self.plan.target,
            stage_ms=self.staged.stage_ms,
            nnz=self.plan.nnz,
            bytes=self.plan.bytes,
            decoded_per_rank=[s.decoded for s in self.staged.summaries],
        )


class PrefetchSlot:
    """The one prefetched update held (or none)."""

    def __init__(self, workers: rpc.Workers) -> None:
        self.workers = workers
        self.held: Prefetched | None = None

    @property
    def versions(self) -> list[int]:
        """The versions held staged (kept in the download cache; shown in status)."""
        return self.held.plan.versions if self.held is not None else []

    def take(self, served: WorkerStatus, plan: UpdatePlan, method: Method) -> Prefetched | None:
        """The held update if it is this plan's, from the same served version (then no longer held)."""
        p = self.held
        if (
            p is not None
            and p.served == served.version
            and p.plan.versions == plan.versions
            and p.plan.target == plan.target
            and [r.to_json() for r in p.plan.files] == [r.to_json() for r in plan.files]
            and p.staged.update.method == method
        ):
            self.held = None
            return p
        return None

    async def drop(self) -> None:
        """Release the held update on every rank."""
        if self.held is not None:
            ticket, self.held = self.held.ticket, None
            await self.workers.release(ticket)
