"""The checks of the live sums: when the API process recomputes them, and what it does with a recomputation.

The live sums (the value: live_sums.py) are kept current at every update, so a status never calls a
worker. `LiveChecks` is their one writer: it makes them (`LiveSums`), adds an update's partials to them
(`applied`), forgets them on an outside change (the ranks found a version no update of this process
made: `Ranks.on_outside_change`), and recomputes them from every rank's parameters (a full pass,
`Ranks.live_state`):

    at start-up             before the first request (the service's `startup`)
    on request              GET /v1/delta/status?verify=true (under the update lock: waits up to
                            VERIFY_WAIT_S for a running update, then 503)
    by the audit            every `delta_audit_s` seconds, skipping a round while an update runs
    when unknown            a status or a ledger report while they are unknown (a server whose layout
                            was not probed yet, or after an update past the plugin): outside the update
                            lock, kept only if no update started meanwhile (what was read could be torn)
    after vLLM's own routes (vllm_routes.py) the ranks are re-read once before the next status, and
                            soon in the background; a different version forgets the live sums. After
                            a route that wrote the weights with the ranks' record unchanged (vLLM's
                            /weight_checker reset) the next status recomputes (trigger "outside"),
                            naming the tensors that changed

A recomputation is compared with what was kept current; a mismatch is logged, counted on /metrics
and shown in status (`verification`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ...checksums import Sums
from ...errors import ServerBusyError
from ...server_api import Verification, VerifyTrigger
from ..shared.messages import WorkerStatus
from .live_sums import LiveCopy, LiveSums, live_copies
from .metrics import metrics
from .operations import Operations
from .ranks import Ranks

log = logging.getLogger(__name__)

VERIFY_WAIT_S = 60.0  # ?verify=true waits this long for a running update to end, then answers 503


class LiveChecks:
    """Recomputes the live sums when they must be, keeps the last `verification`."""

    def __init__(self, ranks: Ranks, operations: Operations) -> None:
        self.live = LiveSums()  # written here only (read it, never set it, elsewhere)
        self.ranks = ranks
        ranks.on_outside_change = self._outside_change
        self.operations = operations
        self.verification: Verification | None = None  # the last recomputation of the live sums
        self._learning = asyncio.Lock()  # recomputations outside the update lock, one at a time
        self._audit: asyncio.Task[None] | None = None
        self._stale = False  # vLLM's own routes may have changed the weights: re-read once
        self._reverify = False  # one of them wrote the weights, the ranks' record unchanged: recompute once
        self._resyncing: asyncio.Task[None] | None = None

    def current(self) -> tuple[str | None, float | None]:
        """(the live checksum, since when) if known for the served version, else (None, None)."""
        if not self.live.known_for(self.ranks.served.version):
            return None, None
        return self.live.checksum, self.live.as_of

    async def before_status(self, verify: bool) -> None:
        """What a status does first: re-read the ranks after vLLM's own routes; recompute with `verify`
        (waits for a running update), or when the live sums are unknown and no update runs."""
        if self._stale and not self.operations.busy:
            await self._resync()
        if verify:
            await self.verify("request")
        elif self._reverify and not self.operations.busy:
            self._reverify = False
            await self.verify("outside")
        elif (
            not self.live.known_for(self.ranks.served.version)
            and not self.operations.busy
            and self.ranks.disagreement is None  # engines that disagree: status says so, ?verify=true re-reads
        ):
            await self.learn()

    async def verify(self, trigger: VerifyTrigger) -> Verification:
        """Recompute the live sums from every rank's parameters and compare them with those kept current
        (and the served version's recorded checksum). Holds the update lock: waits up to VERIFY_WAIT_S for
        a running update (then ServerBusyError, 503)."""
        lock = self.operations.lock
        try:
            await asyncio.wait_for(lock.acquire(), VERIFY_WAIT_S)
        except asyncio.TimeoutError:
            raise ServerBusyError(f"an update has held the lock for over {VERIFY_WAIT_S:.0f} s: verify later") from None
        try:
            t0 = time.perf_counter()
            served, live = await self.ranks.live_state()
            return self.recomputed(served, live, trigger, (time.perf_counter() - t0) * 1e3)
        finally:
            lock.release()

    async def learn(self) -> None:
        """Recompute the live sums outside the update lock, once, when they are unknown; kept only if no
        update started meanwhile (what was read could be torn)."""
        async with self._learning:
            if self.live.known_for(self.ranks.served.version) or self.operations.busy:
                return
            started, t0 = self.operations.started, time.perf_counter()
            served, live = await self.ranks.live_state()
            if self.operations.started == started and not self.operations.busy:
                self.recomputed(served, live, "startup", (time.perf_counter() - t0) * 1e3)

    async def learnt(self) -> str | None:
        """The live checksum kept current, recomputed first if unknown (ledger reports: no worker call
        otherwise); None while it stays unknown (an update started meanwhile)."""
        if not self.live.known_for(self.ranks.served.version):
            await self.learn()
        return self.current()[0]

    async def at_startup(self) -> WorkerStatus:
        """Read what the ranks serve with their live sums (one pass over the weights; a server whose
        layout is not probed yet learns them at its first status); rank 0's status. Under the lock."""
        t0 = time.perf_counter()
        served, ranks = await self.ranks.read(live_sums=True, agree=False)
        copies = live_copies(ranks, self.ranks.api.engines)
        if copies is not None:
            self.recomputed(served, copies, "startup", (time.perf_counter() - t0) * 1e3)
        return served

    def _outside_change(self) -> None:
        """The ranks serve a version no update of this process made: the live sums are unknown until
        recomputed (a status or a ledger report learns them again)."""
        self.live.forget()

    def applied(self, served: int | None, target: int, partials: list[Sums], target_sums: Sums) -> None:
        """An update from `served` to `target` was patched with these partials (one world's, every copy's
        the same: two_phase.worlds): the sums kept current move with it (LiveSums.applied)."""
        self.live.applied(served, target, partials, target_sums)

    def off_version_sums(self, served: WorkerStatus) -> Sums | None:
        """The live sums when the last verification found the weights are not the served version's any
        more (something wrote them past the plugin, e.g. vLLM's /weight_checker reset), else None. An
        update stages against them: a re-anchor then restores the version, verified against what the
        weights really are, without a restart."""
        v = self.verification
        if served.version is None or v is None or v.ok or v.version != served.version:
            return None
        if not self.live.known_for(served.version):
            return None
        assert self.live.sums is not None
        return dict(self.live.sums)

    async def staged_against(self, served: WorkerStatus) -> Sums:
        """The sums staged partials add to: the served version's recorded sums (Ranks.served_sums), or the
        live ones when the last verification found the weights are not that version's."""
        live = self.off_version_sums(served)
        return live if live is not None else await self.ranks.served_sums(served)

    def recomputed(
        self, served: WorkerStatus, live: Sums | list[LiveCopy], trigger: VerifyTrigger, ms: float
    ) -> Verification:
        v = self.live.recomputed(served.version, live, version_checksum=served.checksum, trigger=trigger, ms=ms)
        self.verification = v
        m = metrics()
        if m is not None:
            m.verified(v)
        if not v.ok:
            log.error(
                "vllm-delta: LIVE CHECKSUM MISMATCH (%s): the live weights have checksum %s, version %s records %s, "
                "kept current %s; tensors that changed behind the plugin's back: %s%s",
                trigger,
                v.checksum,
                served.version,
                served.checksum,
                v.expected,
                v.mismatched or "none found (the weights differ from the version's since before)",
                "; per engine: " + ", ".join(f"engine {e.engine}: {e.checksum}" for e in v.engines)
                if v.engines
                else "",
            )
        return v

    # -- after vLLM's own weight routes -------------------------------------------------------------
    def past_the_plugin(self, *, weights_reset: bool = False) -> None:
        """One of vLLM's own routes may have changed the weights (vllm_routes.py): re-read what the ranks
        serve before the next status answers, and soon in the background (so the gate learns it). After a
        reset (the weights written, the ranks' record unchanged) the next status also recomputes the live
        sums (a verification: the tensors that changed are named)."""
        self._stale = True
        if weights_reset:
            self._reverify = True
        if self._resyncing is None or self._resyncing.done():
            self._resyncing = asyncio.get_running_loop().create_task(self._resync_quietly(), name="vllm-delta-resync")

    async def _resync_quietly(self) -> None:
        try:
            await self._resync()
        except Exception as exc:  # noqa: BLE001 - the next status tries again
            log.warning("vllm-delta: could not re-read the workers after one of vLLM's own routes: %s", exc)

    async def _resync(self) -> None:
        async with self._learning:
            if not self._stale or self.operations.busy:
                return  # an update reads the ranks itself; a status after it re-reads if still stale
            self._stale = False
            try:
                await self.ranks.read(agree=False)  # a different version or checksum forgets the live sums
            except Exception:
                self._stale = True
                raise

    # -- the background audit -----------------------------------------------------------------------
    def start_audit(self, period_s: float) -> None:
        """Recompute the live sums every `period_s` seconds, skipping a round while an update runs."""
        if self._audit is None and period_s > 0:
            self._audit = asyncio.get_running_loop().create_task(self._audit_loop(period_s), name="vllm-delta-audit")

    async def _audit_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            if self.operations.lock.locked():
                continue
            try:
                await self.verify("audit")
            except Exception as exc:  # noqa: BLE001 - the audit never dies: the next round tries again
                log.warning("vllm-delta: the live-checksum audit failed: %s", exc)

    async def stop(self) -> None:
        """Stop the audit and a re-read in progress (the app shuts down)."""
        for task in (self._audit, self._resyncing):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._audit = self._resyncing = None
