"""Follow mode's updates through the service's request flow (service.py), under the same lock as
/v1/delta/update_weights: forward to a newer version (`forward`), or back from a version marked bad
(`back`: the follower leaving it, follower.py). An engine that refuses in-flight updates makes this and
every later follower update fall back to keep mode (logged once), instead of skipping a good version."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from ...errors import InflightRefusedError
from ...server_api import UpdateMode, UpdateRequest, UpdateResult
from ...store import DeltaStore
from ..shared.messages import WorkerStatus
from ..shared.options import FollowOptions
from .follower import Follower
from .gating import VersionGate
from .operations import Operations
from .ranks import Ranks

log = logging.getLogger(__name__)

Update = Callable[[WorkerStatus, UpdateRequest], Awaitable[UpdateResult]]  # the service's update, under the lock


class FollowUpdates:
    """The follower's two kinds of update, each one update of the service under its lock."""

    def __init__(self, operations: Operations, ranks: Ranks, gate: VersionGate, update: Update) -> None:
        self.operations = operations
        self.ranks = ranks
        self.gate = gate
        self._update = update
        self._inflight_refused: str | None = None  # why this engine refused an in-flight update

    async def forward(self, version: int, mode: UpdateMode) -> UpdateResult | None:
        """As /v1/delta/update_weights, unless the server already serves `version` or a newer one (a client's
        update got there first between the follower's poll and the lock): then None, nothing staged."""
        async with self.operations.run("update", version):
            served, _ = await self.ranks.read()
            if served.version is not None and served.version >= version:
                return None
            return await self._with_fallback(served, UpdateRequest(version, mode=mode))

    async def back(self, from_version: int, version: int, mode: UpdateMode) -> UpdateResult | None:
        """From `from_version` (marked bad) back to the older `version`: a backward update where the store has
        the path, else `version`'s chain replayed (allow_reanchor). None, nothing staged, when the server no
        longer serves `from_version` (a client moved it). From now on the gate admits requests as if
        `version` were served (gating.hold_at): one bounded above it that still runs refuses the move (409;
        the follower tries again at its next poll)."""
        async with self.operations.run("update", version):
            served, _ = await self.ranks.read()
            if served.version != from_version:
                return None
            self.gate.hold_at(version)
            return await self._with_fallback(served, UpdateRequest(version, mode=mode, allow_reanchor=True))

    async def _with_fallback(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        if request.mode == "inflight" and self._inflight_refused is not None:
            request = dataclasses.replace(request, mode="keep")
        try:
            return await self._update(served, request)
        except InflightRefusedError as exc:
            # This engine can't take in-flight updates (the reason does not change while it runs).
            log.warning("vllm-delta: follow mode falls back from inflight to keep: %s", exc)
            self._inflight_refused = str(exc)
            served, _ = await self.ranks.read()
            return await self._update(served, dataclasses.replace(request, mode="keep"))

    def follower(
        self,
        store: DeltaStore,
        options: FollowOptions,
        served: Callable[[], Awaitable[int | None]],
        checksums: Callable[[], Awaitable[tuple[str | None, str | None]]],
    ) -> Follower:
        """A Follower (not started) whose updates are these."""

        async def apply(version: int) -> float | None:
            result = await self.forward(version, options.mode)
            return None if result is None else result.pause_ms

        async def back(from_version: int, version: int) -> float | None:
            result = await self.back(from_version, version, options.mode)
            return None if result is None else result.pause_ms

        return Follower(store, options, served=served, apply=apply, checksums=checksums, back=back)
