"""The update protocol, run in the API server process against every worker rank (collective_rpc).

    plan      which versions to apply (plan.py: successor rule, 404 / 409)
    prepare   probe the layout on every rank, once
    stage     every rank decodes its share on a background thread; the server keeps generating
    verify    the ranks' checksum partials added to the served version's sums must give the target
              header's sums, per tensor (422 on mismatch: nothing has been written)
    pause     pause scheduling (mode keep | wait | abort)
    commit    every rank writes in place; if any rank fails, every rank rolls back
    reset     the prefix cache (its KV was computed with the old weights), only after a commit
    resume    always (finally)

Updates, prefetches and status reads are serialized by one asyncio.Lock, so a status never sees
a half-applied update and two updates never interleave. The follower (follower.py, follow mode)
updates through `follow_update`, the same steps under the same lock as /v1/delta/update_weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..checksums import Sums, add_sums, combine, to_hex, verify_partials
from ..errors import DeltaError
from .messages import (
    Committed,
    FollowStatus,
    Prepared,
    RankSums,
    ServerStatus,
    StagePoll,
    StageRequest,
    StageResult,
    StageStarted,
    StageSummary,
    UpdateRequest,
    UpdateResult,
    WorkerStatus,
    reply_error,
)
from .options import StoreSpec
from .plan import UpdatePlan, plan_update

if TYPE_CHECKING:
    from ..store import DeltaStore

log = logging.getLogger(__name__)

POLL_S = 0.005  # staging poll interval: each poll is one cheap RPC between forward passes
RPC_TIMEOUT_S = float(os.environ.get("VLLM_DELTA_RPC_TIMEOUT_S", "600"))

R = TypeVar("R")


@dataclass
class Prefetched:
    served: int | None
    plan: UpdatePlan
    ticket: str
    method: str
    summaries: list[StageSummary]  # one per rank
    stage_ms: float
    from_prefetch: bool = False  # staged by an earlier /v1/delta/stage


class DeltaService:
    def __init__(self, engine_client: Any, spec: StoreSpec):
        self.engine = engine_client
        self.spec = spec
        self._store: DeltaStore | None = None
        self.lock = asyncio.Lock()
        self.prefetched: Prefetched | None = None
        self.last_update: tuple[UpdateResult, float] | None = None  # and when it was applied
        self.follow_status: Callable[[], FollowStatus] | None = None  # set when a follower runs beside

    @property
    def store(self) -> DeltaStore:
        if self._store is None:
            self._store = self.spec.open()
        return self._store

    # -- RPC helpers ----------------------------------------------------------------------------
    async def _replies(self, _name: str, **kwargs: Any) -> list[Any]:
        """Every rank's raw reply (a result's wire form or an error reply), in rank order."""
        return await self.engine.collective_rpc(_name, timeout=RPC_TIMEOUT_S, kwargs=kwargs)

    async def _call(self, _name: str, reply: Callable[[Mapping[str, Any]], R], **kwargs: Any) -> list[R]:
        """Every rank's result, typed by `reply` (a from_wire); the first rank's error is raised as WorkerError."""
        replies = await self._replies(_name, **kwargs)
        for rank, r in enumerate(replies):
            error = reply_error(r)
            if error is not None:
                raise error.to_error(rank)
        return [reply(r) for r in replies]

    async def _release(self, ticket: str) -> None:
        await self._replies("delta_release", ticket=ticket)  # best effort: errors are the workers' to log

    async def _served(self) -> WorkerStatus:
        ranks = await self._call("delta_status", WorkerStatus.from_wire)
        versions = {(r.version, r.checksum) for r in ranks}
        if len(versions) != 1:
            raise DeltaError(f"worker ranks disagree on the served version: {sorted(versions, key=str)}")
        return ranks[0]

    async def _prepare(self, served: WorkerStatus, version: int) -> None:
        if not served.prepared:
            await self._call("delta_prepare", Prepared.from_wire, store=self.spec.to_dict(), version=version)

    async def _in_thread(self, fn: Callable[..., R], *args: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- staging --------------------------------------------------------------------------------
    async def _stage(self, served: WorkerStatus, request: StageRequest | UpdateRequest) -> Prefetched | None:
        plan: UpdatePlan = await self._in_thread(
            plan_update, self.store, served.version, served.checksum, request.version, request.allow_reanchor
        )
        if not plan.versions:
            return None
        method = request.method
        p = self.prefetched
        if p is not None and p.served == served.version and p.plan.versions == plan.versions and p.method == method:
            self.prefetched = None
            p.from_prefetch = True
            return p
        await self._drop_prefetched()
        t0 = time.perf_counter()
        # Download once here (a cache shared with the workers of this host), off the event loop.
        for v in plan.versions:
            await self._in_thread(self.store.local_path, v)
        await self._prepare(served, plan.target)
        ticket = uuid.uuid4().hex
        await self._call(
            "delta_stage_start",
            StageStarted.from_wire,
            store=self.spec.to_dict(),
            ticket=ticket,
            versions=plan.versions,
            method=method,
        )
        try:
            summaries = await self._wait_staged(ticket)
            await self._verify(served, plan, summaries)
        except BaseException:
            await self._release(ticket)
            raise
        return Prefetched(served.version, plan, ticket, method, summaries, (time.perf_counter() - t0) * 1e3)

    async def _wait_staged(self, ticket: str) -> list[StageSummary]:
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while True:
            polls = await self._call("delta_stage_poll", StagePoll.from_wire, ticket=ticket)
            summaries = [p.summary for p in polls if p.summary is not None]
            if len(summaries) == len(polls):
                return summaries
            if time.monotonic() > deadline:
                raise DeltaError(f"staging did not finish within {RPC_TIMEOUT_S:.0f} s")
            await asyncio.sleep(POLL_S)

    async def _verify(self, served: WorkerStatus, plan: UpdatePlan, summaries: list[StageSummary]) -> None:
        target = await self._in_thread(lambda: self.store.open(plan.target).header)
        if served.version is not None:
            # The served version's sums as the workers hold them (the store may have retired it).
            current = (await self._call("delta_served_sums", RankSums.from_wire))[0].sums
        else:
            current = await self._live_sums()
        verify_partials(current, [s.partials for s in summaries], target)

    async def _drop_prefetched(self) -> None:
        if self.prefetched is not None:
            ticket, self.prefetched = self.prefetched.ticket, None
            await self._release(ticket)

    # -- public operations ----------------------------------------------------------------------
    async def stage(self, request: StageRequest) -> StageResult:
        async with self.lock:
            served = await self._served()
            staged = await self._stage(served, request)
            if staged is None:
                return StageResult(served.version, [])
            self.prefetched = staged
            return StageResult(
                served.version,
                staged.plan.versions,
                staged.stage_ms,
                target=staged.plan.target,
                nnz=staged.plan.nnz,
                bytes=staged.plan.bytes,
            )

    async def update(self, request: UpdateRequest) -> UpdateResult:
        async with self.lock:
            return await self._update(await self._served(), request)

    async def follow_update(self, version: int, mode: str) -> UpdateResult | None:
        """The follower's update: as /v1/delta/update_weights, unless the server already serves `version`
        or a newer one (a client's update got there first between the follower's poll and this lock):
        then None, and nothing is staged or applied. A follower never moves a server backwards."""
        async with self.lock:
            served = await self._served()
            if served.version is not None and served.version >= version:
                return None
            return await self._update(served, UpdateRequest(version, mode=mode))

    async def served_version(self) -> int | None:
        async with self.lock:
            return (await self._served()).version

    async def checksums(self) -> tuple[str, str | None]:
        """(live checksum over all ranks, the served version's recorded checksum), for ledger reports."""
        async with self.lock:
            served = await self._served()
            await self._ensure_prepared(served)
            return to_hex(combine((await self._live_sums()).items())), served.checksum

    async def _update(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        """One update from `served` (read under the lock, which the caller holds)."""
        previous = served.version
        staged = await self._stage(served, request)
        if staged is None:
            target = await self._in_thread(self.store.resolve, request.version)
            return UpdateResult(target, previous, 0.0, 0.0, 0.0, 0, 0, [], request.mode, request.method)
        try:
            pause_ms, apply_ms = await self._commit(staged, request)
        finally:
            await self._release(staged.ticket)
        out = UpdateResult(
            version=staged.plan.target,
            previous_version=previous,
            pause_ms=pause_ms,
            apply_ms=apply_ms,
            stage_ms=staged.stage_ms,
            nnz=staged.plan.nnz,
            bytes=staged.plan.bytes,
            applied=staged.plan.versions,
            mode=request.mode,
            method=request.method,
            reanchored=staged.plan.reanchor,
            prefetched=staged.from_prefetch,
            elements_written=sum(s.nnz for s in staged.summaries),
            staged_bytes=sum(s.bytes for s in staged.summaries),
            timings=staged.summaries[0].timings,
        )
        self.last_update = (out, time.time())
        return out

    async def _commit(self, staged: Prefetched, request: UpdateRequest) -> tuple[float, float]:
        t0 = time.perf_counter()
        # Caches are reset after a successful commit only: a failed update leaves them valid.
        await self.engine.pause_generation(mode=request.mode, clear_cache=False)
        try:
            replies = await self._replies(
                "delta_commit", ticket=staged.ticket, method=request.method, fault=request.fault
            )
            failed = [(rank, e) for rank, e in enumerate(map(reply_error, replies)) if e is not None]
            if failed:
                await self._replies("delta_rollback", ticket=staged.ticket)
                rank, payload = failed[0]
                err = payload.to_error(rank)
                raise DeltaError(
                    f"update to version {staged.plan.target} failed and was rolled back on every rank: {err}"
                ) from err
            await self._reset_prefix_cache()
            apply_ms = max(Committed.from_wire(r).apply_ms for r in replies)
        finally:
            await self.engine.resume_generation()
        return (time.perf_counter() - t0) * 1e3, apply_ms

    async def _reset_prefix_cache(self) -> None:
        for _ in range(50):
            if await self.engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
                return
            await asyncio.sleep(0.01)
        log.warning("vllm-delta: the prefix cache could not be reset after an update")

    async def _live_sums(self) -> Sums:
        return add_sums(p.sums for p in await self._call("delta_live_sums", RankSums.from_wire))

    async def _ensure_prepared(self, served: WorkerStatus) -> None:
        if not served.prepared:
            version = served.version
            target = version if version is not None else await self._in_thread(self.store.resolve, "latest")
            await self._prepare(served, target)

    async def status(self) -> ServerStatus:
        async with self.lock:
            served = await self._served()
            version = served.version
            await self._ensure_prepared(served)
            sums = await self._live_sums()
            fallback = (await self._call("delta_status", WorkerStatus.from_wire))[0].fallback
            last, when = self.last_update if self.last_update is not None else (None, None)
            return ServerStatus(
                version=version,
                store=self.spec.uri,
                checksum=to_hex(combine(sums.items())),
                version_checksum=served.checksum,
                staged=self.prefetched.plan.versions if self.prefetched else [],
                last_update=last,
                last_update_time=when,
                tensors_via_vllm_path=fallback,
                follow=self.follow_status() if self.follow_status is not None else None,
            )
