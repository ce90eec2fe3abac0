"""Follow mode: a server that follows its store on its own, and reports to the store's ledger.

    --model-loader-extra-config '{"delta_store": URI, "delta_follow": true, "delta_poll_s": 2,
                                  "delta_report": true}'

Beside the DeltaService, in the API process's event loop, the follower polls the store's newest
version (one small read per poll: `DeltaStore.latest`), and when it is newer than the served one
applies it through the service's own `update` (the same lock as /v1/delta/update_weights, so an
update from a client and one from the follower never interleave or apply twice). The plan (plan.py)
catches up in one pause: the deltas after the served version, or the newest anchor's chain when the
served version is not on the target's chain. A chain longer than `chain_cap` versions is walked in
several updates of at most `chain_cap` versions each (there is no shorter path: a version's chain is
unique, and its anchor comes before the served version).

A version that fails its checks (404/409/422) is never applied: the follower logs it, keeps serving,
reports it in status and in the ledger, and does not retry that target; it moves on when a newer
version appears (whose chain may avoid the bad one, e.g. after the trainer's next anchor). Store
faults (timeouts, an unreachable store: 5xx) are retried at the next poll.

Versions marked bad in the store (`vllm_delta.store.marks`, `vllm-delta mark-bad`) are never applied, nor
any version whose chain passes through one: the follower reads the marks (one listing of `bad/`)
whenever it is about to update, moves along the newest version's chain up to the version before the
first mark, and otherwise waits for a version whose chain avoids every mark (the trainer's next
anchor), showing the blocked version under `skipped`.

A served version that becomes marked (itself, or a version on its chain since its anchor) is left by
itself (`delta_leave_marked`, on by default): at every poll the follower reads the marks, and when no
newer usable version takes it elsewhere, it moves back to the newest unmarked version on its chain by a
backward update (shared/plan.py: the marked deltas undone, O(changes); where no backward path exists,
that version's chain is replayed), at most `chain_cap` versions per update. It logs it, counts it
(`vllm_delta_marked_left_total`) and shows it in status (`follow.last_left`). The min-version gate
treats the server as one that is behind: from the moment it decides to leave, requests bounded above
the version it goes back to wait (then 409) as on any replica serving it, and the move waits (retried
at the next poll) while requests bounded above it still run. Its anchor marked, with no version to go
back to, it keeps serving and says so (`last_error`, the gauge `vllm_delta_served_marked`) until a
newer usable version appears.

With `"delta_report": true` the follower writes this replica's report to the store's ledger
(`vllm_delta.store.ledger`) when its version changes and every `delta_report_s` as a heartbeat. A store
it cannot write to disables reporting with one warning (read-only followers simply don't report).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ...errors import (
    DeltaError,
    EngineSleepingError,
    MissingBaseError,
    VersionBoundConflictError,
    VersionNotFoundError,
    error_type,
    http_status,
)
from ...server_api import FollowStatus, LeftMarked, Readiness
from ...store import DeltaStore
from ...store.ledger import Ledger, ReplicaReport
from ...store.marks import BadMark, Marks, blocked_by, describe, reachable_prefix
from ..shared.options import FollowOptions
from .metrics import metrics

__all__ = ["FollowOptions", "FollowState", "Follower", "default_replica_id", "next_target", "readiness"]

log = logging.getLogger(__name__)


@dataclass
class FollowState:
    """The follower's own bookkeeping; `snapshot()` is what status shows (server_api.FollowStatus)."""

    store: str
    newest_seen: int | None = None
    served: int | None = None
    last_error: str | None = None
    last_error_version: int | None = None
    last_error_time: float | None = None
    skipped: dict[int, str] = field(default_factory=dict)  # bad targets (bounded): version -> why
    polls: int = 0
    updates: int = 0
    last_pause_ms: float | None = None
    reporting: bool = False
    replica_id: str | None = None
    last_left: LeftMarked | None = None  # the last time the follower left a marked version

    @property
    def lag(self) -> int | None:
        if self.newest_seen is None or self.served is None:
            return None
        return max(0, self.newest_seen - self.served)

    def snapshot(self, options: FollowOptions) -> FollowStatus:
        return FollowStatus(
            following=options.follow,
            store=self.store,
            served=self.served,
            newest_seen=self.newest_seen,
            lag=self.lag,
            last_error=self.last_error,
            last_error_version=self.last_error_version,
            last_error_time=self.last_error_time,
            skipped=dict(sorted(self.skipped.items())),
            polls=self.polls,
            updates=self.updates,
            last_pause_ms=self.last_pause_ms,
            reporting=self.reporting,
            replica_id=self.replica_id,
            poll_s=options.poll_s,
            mode=options.mode,
            leave_marked=options.follow and options.leave_marked,
            last_left=self.last_left,
        )


MAX_SKIPPED = 32  # remembered bad targets (older ones are forgotten: they are behind anyway)
# Refusals that are not the target's fault: the next poll tries again (never `skipped`)
NOT_NOW = (VersionBoundConflictError, EngineSleepingError)

Back = Callable[[int, int], Awaitable["float | None"]]  # (from, to) -> pause_ms, or None: not served any more


class Follower:
    """Polls the store and applies new versions.

    The server is reached through three coroutines of the service, injected so that the follower
    is testable without vLLM: `served()` -> the served version, `apply(version)` -> pause_ms of one
    update under the service's lock, or None when the server already serves that version or a newer
    one (a client's /v1/delta/update_weights got there first), `checksums()` -> (live checksum, the
    served version's recorded checksum), read only for ledger reports; and `back(served, target)` ->
    pause_ms of one update from `served` back to the older `target` (a backward update where the store
    allows one, else a replay of target's chain), or None when the server no longer serves `served`
    (without it, a marked version is not left).

    With `follow` off and `report` on, the loop only reports (a pushed server in the ledger)."""

    def __init__(
        self,
        store: DeltaStore,
        options: FollowOptions,
        *,
        served: Callable[[], Awaitable[int | None]],
        apply: Callable[[int], Awaitable[float | None]],
        checksums: Callable[[], Awaitable[tuple[str | None, str | None]]],
        back: Back | None = None,
    ):
        self.store = store
        self.options = options
        self._served = served
        self._apply = apply
        self._checksums = checksums
        self._back = back
        self._stuck: tuple[int, int] | None = None  # (served, marked version) told once: nowhere to go back to
        self.state = FollowState(store=store.uri, reporting=options.report)
        if options.report:
            self.state.replica_id = options.replica_id or default_replica_id()
        self._started = time.time()
        self._last_report = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-delta-follower")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass

    @property
    def status(self) -> FollowStatus:
        return self.state.snapshot(self.options)

    async def _run(self) -> None:
        period = self.options.poll_s if self.options.follow else self.options.report_s
        while not self._stop.is_set():
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the loop never dies: report and poll again
                self._error(None, exc)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass

    # -- one poll ---------------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        st = self.state
        st.polls += 1
        newest = await asyncio.to_thread(self.store.latest)
        st.newest_seen = newest
        served = st.served = await self._served()
        changed = False
        if self.options.follow:
            changed = await self._follow(served, newest)
            if changed:
                st.served = await self._served()
        await self._maybe_report(changed)

    async def _follow(self, served: int | None, newest: int | None) -> bool:
        """One update, forward to a newer usable version, or else back from a marked one; True if the
        served version changed (by us or a client). The marks are read once (one listing of `bad/`)."""
        ahead = newest is not None and (served is None or newest > served) and newest not in self.state.skipped
        leave = self.options.leave_marked and self._back is not None and served is not None
        if not (ahead or leave):
            return False
        marks = await asyncio.to_thread(self.store.marks)
        if ahead and newest is not None and await self._advance(served, newest, marks):
            return True
        if leave and served is not None:
            return await self._leave_marked(served, marks)
        return False

    async def _advance(self, served: int | None, newest: int, marks: Marks) -> bool:
        """One update on the way to `newest`; True if the served version changed (by us or a client)."""
        st = self.state
        # -- bad-version marks: never apply a version whose chain passes through a marked one --
        target = await asyncio.to_thread(next_target, self.store, served, newest, self.options.chain_cap, marks)
        if target is None:  # every step forward passes through a marked version: wait for a newer one
            mark = await asyncio.to_thread(lambda: blocked_by(self.store.chain(newest), marks))
            st.skipped[newest] = f"blocked: {describe(mark) if mark else 'a version on its chain is marked bad'}"
            log.warning(
                "vllm-delta: following %s: not applying version %d: %s", self.store.uri, newest, st.skipped[newest]
            )
            self._trim_skipped()
            return False
        # -- end of the bad-version rule --
        if target in st.skipped:  # an intermediate step of a long chain that already failed
            return False
        try:
            pause_ms = await self._apply(target)
        except DeltaError as exc:
            self._error(target, exc)
            if http_status(exc) < 500 and not isinstance(exc, NOT_NOW):  # the version is bad: never retried
                st.skipped[target] = str(exc)[:300]
                self._trim_skipped()
            return False
        if pause_ms is not None:
            st.last_pause_ms = pause_ms
            st.updates += 1
            log.info("vllm-delta: following %s: now serving version %d", self.store.uri, target)
        return True

    async def _leave_marked(self, served: int, marks: Marks) -> bool:
        """Back from `served` when a mark lies on its chain: to the newest unmarked version of that chain (at
        most `chain_cap` versions back per update). True if the served version changed."""
        if not marks:
            self._served_marked(False)
            return False
        try:
            chain = await asyncio.to_thread(self.store.chain, served)
        except (VersionNotFoundError, MissingBaseError):  # its chain left the store (retention): nothing to undo
            return False
        mark = blocked_by(chain, marks)
        self._served_marked(mark is not None)
        if mark is None:
            return False
        usable = reachable_prefix(chain, marks)
        if not usable:  # its anchor is marked: nothing on this chain to go back to
            if self._stuck != (served, mark.version):
                self._stuck = (served, mark.version)
                why = f"serving version {served}, and {describe(mark)}: no unmarked version on its chain to go back to"
                self._error(None, DeltaError(f"{why}; waiting for a newer usable version"))
            return False
        versions = [r.version for r in chain]
        target = max(usable[-1].version, versions[max(0, versions.index(served) - self.options.chain_cap)])
        if target in self.state.skipped:
            return False
        assert self._back is not None
        try:
            pause_ms = await self._back(served, target)
        except DeltaError as exc:
            self._error(target, exc)
            if http_status(exc) < 500 and not isinstance(exc, NOT_NOW):
                self.state.skipped[target] = str(exc)[:300]
                self._trim_skipped()
            return False
        if pause_ms is None:
            return True  # a client moved the server meanwhile: decide again at the next poll
        self._left(served, target, mark, pause_ms)
        return True

    def _left(self, served: int, target: int, mark: BadMark, pause_ms: float) -> None:
        st = self.state
        st.last_pause_ms = pause_ms
        st.updates += 1
        st.last_left = LeftMarked(
            version=served, to=target, marked=mark.version, reason=mark.reason[:300], time=time.time()
        )
        log.warning(
            "vllm-delta: following %s: left version %d (%s): now serving version %d",
            self.store.uri,
            served,
            describe(mark),
            target,
        )
        if (m := metrics()) is not None:
            m.marked_left.inc()

    def _served_marked(self, marked: bool) -> None:
        if not marked:
            self._stuck = None
        if (m := metrics()) is not None:
            m.served_marked.set(1 if marked else 0)

    def _trim_skipped(self) -> None:
        skipped = self.state.skipped
        while len(skipped) > MAX_SKIPPED:
            del skipped[min(skipped)]

    async def _maybe_report(self, changed: bool) -> None:
        st = self.state
        due = changed or time.monotonic() - self._last_report >= self.options.report_s
        if st.reporting and due:
            checksum, version_checksum = await self._checksums()
            await asyncio.to_thread(self._report, checksum, version_checksum)

    def _error(self, version: int | None, exc: BaseException) -> None:
        st = self.state
        st.last_error = f"{error_type(exc)}: {exc}"[:500]
        st.last_error_version = version
        st.last_error_time = time.time()
        log.warning("vllm-delta: following %s: %s", self.store.uri, st.last_error)

    def _report(self, checksum: str | None, version_checksum: str | None) -> None:
        st = self.state
        self._last_report = time.monotonic()
        if not st.reporting or st.replica_id is None:
            return
        report = ReplicaReport(
            replica_id=st.replica_id,
            host=socket.gethostname(),
            served_version=st.served,
            checksum=checksum,
            version_checksum=version_checksum,
            newest_seen=st.newest_seen,
            last_pause_ms=st.last_pause_ms,
            last_error=st.last_error,
            heartbeat=time.time(),
            started=self._started,
        )
        try:
            Ledger(self.store).report(report)
        except PermissionError as exc:
            st.reporting = False
            log.warning("vllm-delta: no write access to %s: not reporting to its ledger (%s)", self.store.uri, exc)
        except Exception as exc:  # noqa: BLE001 - a store fault: the next heartbeat tries again
            log.warning("vllm-delta: could not write the replica report to %s: %s", self.store.uri, exc)


def next_target(
    store: DeltaStore, served: int | None, newest: int, chain_cap: int, marks: Marks | None = None
) -> int | None:
    """The version to apply next on the way to `newest`: `newest` itself, unless the served version
    lies on its chain more than `chain_cap` deltas back (then the version `chain_cap` steps on). With
    bad-version `marks`, only the part of `newest`'s chain before its first mark counts: its last
    version, or None when that is not newer than the served version (wait for a newer version)."""
    if served is None and not marks:
        return newest
    chain = [r.version for r in reachable_prefix(store.chain(newest), marks or {})]
    if not chain:
        return None
    if served in chain:
        i = chain.index(served)
        return chain[min(len(chain) - 1, i + chain_cap)] if i < len(chain) - 1 else None
    return chain[-1] if served is None or chain[-1] > served else None


def default_replica_id() -> str:
    """Host, process and a random suffix: unique per server process, stable while it runs."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def readiness(served: int | None, min_version: int | None, follower: Follower | None) -> Readiness:
    """GET /v1/delta/ready: whether to route traffic to a server serving `served`. With `min_version`: the
    served version reaches it. Without: a version is served and, in follow mode, it is the newest version
    the follower saw (or that one was skipped as bad): a server that starts or recovers behind is not ready."""
    following = follower if follower is not None and follower.options.follow else None
    newest = following.state.newest_seen if following is not None else None
    reason = None
    if served is None:
        reason = "the server serves no store version"
    elif min_version is not None:
        if served < min_version:
            reason = f"the server serves version {served}, below {min_version}"
    elif following is not None:
        if newest is None:
            reason = "its follower has not read the store yet"
        elif served < newest and newest not in following.state.skipped:
            reason = f"the server serves version {served}; its follower saw version {newest} in the store"
    return Readiness(ready=reason is None, version=served, min_version=min_version, newest_seen=newest, reason=reason)
