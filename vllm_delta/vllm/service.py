"""The update protocol, run in the API server process against every worker rank (collective_rpc).

    plan      which versions to apply (plan.py: successor rule, 404 / 409)
    prepare   probe the layout on every rank, once
    stage     every rank decodes its share on a background thread; the server keeps generating
    verify    the ranks' checksum partials added to the served version's sums must give the target
              header's sums, per tensor (422 on mismatch: nothing has been written)
    pause     pause scheduling (mode keep | wait | abort)
    commit    every rank writes in place; if any rank fails, every rank rolls back
    reset     the prefix cache (its KV was computed with the old weights), only after a commit
    label     vLLM's weight-version label := the new version (enginecore.SET_LABEL)
    resume    always (finally)

Mode "inflight" replaces pause .. resume by ONE engine-core call (enginecore.INFLIGHT_COMMIT) that
runs between two engine steps: commit on every rank, roll back every rank if one failed, drop the
prefix-cache hashes and taint running requests, set the label. No pause, nothing preempted.

Updates and prefetches are serialized by one asyncio.Lock, so two updates never interleave. Status
reads never take it: during an update a status answers at once from the last state it read, and says
what is in progress since when (a hung store must not hang the control plane); a status that an
update overtook while it read the workers answers the same way.

Deadlines: every store operation is bounded by the store's `timeout_s` (store.py), and everything an
update does before its pause by `update_timeout_s`; past it the update fails with StoreTimeoutError
(504) and nothing is written. After an applied update the download cache keeps the served version's
chain (and a prefetched one) and drops the rest; a staging that failed an integrity check drops the
cached copies of its versions, so the next try fetches them again. The follower (follower.py, follow mode)
updates through `follow_update`: the same steps under the same lock as /v1/delta/update_weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..checksums import Sums, add_sums, combine, to_hex, verify_partials
from ..errors import DeltaError, InflightRefusedError, StoreTimeoutError, WorkerError, http_status
from . import enginecore
from .messages import (
    INFLIGHT,
    Committed,
    Failure,
    FollowStatus,
    InflightCommitted,
    InProgress,
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
from .metrics import metrics
from .options import StoreSpec
from .plan import UpdatePlan, plan_update

if TYPE_CHECKING:
    from ..store import DeltaStore

log = logging.getLogger(__name__)

SEEN_S = 30.0  # the follower's polls and reports reuse what was read from the workers this recently

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
        self.in_progress: InProgress | None = None
        self.last_failure: Failure | None = None
        self._last_status: ServerStatus | None = None  # what status answers while an update runs
        self._chain: list[int] | None = None  # the served version's chain (kept in the cache)
        self._deadline = float("inf")  # time.monotonic() by which the running update must reach its pause
        self._operations = 0  # updates and prefetches started (a status read notices one starting)
        self._status_lock = asyncio.Lock()  # status reads, one at a time (never the update lock)
        self._served_seen: tuple[int | None, float] | None = None  # (version, when: monotonic) last read or applied
        self._checksums_seen: tuple[int | None, str, str | None, float] | None = None  # for ledger reports
        self._inflight_refused: str | None = None  # why this engine refused an in-flight update (follow mode)
        self.follow_status: Callable[[], FollowStatus] | None = None  # set when a follower runs beside

    @property
    def store(self) -> DeltaStore:
        if self._store is None:
            self._store = self.spec.open()
        return self._store

    # -- one operation at a time, with a deadline ---------------------------------------------
    @contextlib.asynccontextmanager
    async def _operation(self, name: str, version: int | str) -> AsyncIterator[None]:
        """Hold the lock for one update or prefetch: its deadline, in-progress state and metrics."""
        async with self.lock:
            self._operations += 1
            self.in_progress = InProgress(name, version, time.time())
            self._deadline = time.monotonic() + self.spec.update_timeout_s
            m = metrics()
            if m is not None:
                m.in_progress.set(1)
            try:
                yield
            except Exception as exc:
                type_name = exc.type_name if isinstance(exc, WorkerError) else type(exc).__name__
                self.last_failure = Failure(name, version, type_name, http_status(exc), str(exc)[:2000], time.time())
                if m is not None:
                    m.failed(name, type_name, http_status(exc))
                raise
            finally:
                self.in_progress = None
                self._deadline = float("inf")
                if m is not None:
                    m.in_progress.set(0)

    def _left(self, what: str, deadline: float | None = None) -> float:
        """Seconds left before the running update's deadline (or `deadline`); StoreTimeoutError when none are."""
        left = (self._deadline if deadline is None else deadline) - time.monotonic()
        if left <= 0:
            raise StoreTimeoutError(
                f"the update did not reach its pause within {self.spec.update_timeout_s:.0f} s "
                f"(update_timeout_s; store {self.spec.uri}, while {what}): nothing was written"
            )
        return left

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
        m = metrics()
        if m is not None and ranks[0].version is not None:
            m.served_version.set(ranks[0].version)
        self._served_seen = (ranks[0].version, time.monotonic())
        return ranks[0]

    async def _prepare(self, served: WorkerStatus, version: int) -> None:
        if not served.prepared:
            await self._call("delta_prepare", Prepared.from_wire, store=self.spec.to_dict(), version=version)

    async def _in_thread(self, fn: Callable[..., R], *args: Any, deadline: float | None = None) -> R:
        """`fn(*args)` on a thread (store I/O stays off the event loop), bounded by the running update's
        deadline (or `deadline`, a time.monotonic()). A call past it is abandoned (its own store timeout
        ends it) and StoreTimeoutError is raised."""
        what = getattr(fn, "__name__", "a store operation")
        until = self._deadline if deadline is None else deadline
        future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        try:
            return await asyncio.wait_for(future, self._left(what, until) if until != float("inf") else None)
        except asyncio.TimeoutError:
            self._left(what, until)  # raises: the deadline has passed
            raise

    # -- staging --------------------------------------------------------------------------------
    async def _stage(self, served: WorkerStatus, request: StageRequest | UpdateRequest) -> Prefetched | None:
        plan: UpdatePlan = await self._in_thread(
            plan_update, self.store, served.version, served.checksum, request.version, request.allow_reanchor
        )
        if not plan.versions:
            return None
        method = request.method
        p = self.prefetched
        if (
            p is not None
            and p.served == served.version
            and p.plan.versions == plan.versions
            and [r.to_json() for r in p.plan.records] == [r.to_json() for r in plan.records]
            and p.method == method
        ):
            self.prefetched = None
            p.from_prefetch = True
            return p
        await self._drop_prefetched()
        t0 = time.perf_counter()
        try:
            # Download once here (a cache shared with the workers of this host), off the event loop,
            # each file checked against the record this plan was decided on.
            for rec in plan.records:
                await self._in_thread(functools.partial(self.store.local_paths, rec.version, record=rec))
            await self._prepare(served, plan.target)
            ticket = uuid.uuid4().hex
            await self._call(
                "delta_stage_start",
                StageStarted.from_wire,
                store=self.spec.to_dict(),
                ticket=ticket,
                versions=plan.versions,
                method=method,
                records=[r.to_json() for r in plan.records],
            )
            try:
                summaries = await self._wait_staged(ticket)
                await self._verify(served, plan, summaries)
            except BaseException:
                await self._release(ticket)
                raise
        except Exception as exc:
            if http_status(exc) == 422:
                # A damaged or partial copy must not outlive this failure: the next try fetches again.
                await self._in_thread(functools.partial(self.store.prune_cache, versions=plan.versions))
            raise
        return Prefetched(served.version, plan, ticket, method, summaries, (time.perf_counter() - t0) * 1e3)

    async def _wait_staged(self, ticket: str) -> list[StageSummary]:
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while True:
            polls = await self._call("delta_stage_poll", StagePoll.from_wire, ticket=ticket)
            summaries = [p.summary for p in polls if p.summary is not None]
            if len(summaries) == len(polls):
                return summaries
            self._left("the workers staged")
            if time.monotonic() > deadline:
                raise DeltaError(f"staging did not finish within {RPC_TIMEOUT_S:.0f} s")
            await asyncio.sleep(POLL_S)

    async def _verify(self, served: WorkerStatus, plan: UpdatePlan, summaries: list[StageSummary]) -> None:
        rec = plan.records[-1]
        target = await self._in_thread(lambda: self.store.open(rec.version, record=rec).header)
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
        async with self._operation("stage", request.version):
            served = await self._served()
            staged = await self._stage(served, request)
            if staged is None:
                return StageResult(served.version, [])
            self.prefetched = staged
            await self._prune_cache(served.version)
            return StageResult(
                served.version,
                staged.plan.versions,
                staged.stage_ms,
                target=staged.plan.target,
                nnz=staged.plan.nnz,
                bytes=staged.plan.bytes,
            )

    async def update(self, request: UpdateRequest) -> UpdateResult:
        async with self._operation("update", request.version):
            return await self._update(await self._served(), request)

    async def follow_update(self, version: int, mode: str) -> UpdateResult | None:
        """The follower's update: as /v1/delta/update_weights, unless the server already serves `version`
        or a newer one (a client's update got there first between the follower's poll and this lock):
        then None, and nothing is staged or applied. A follower never moves a server backwards."""
        async with self._operation("update", version):
            served = await self._served()
            if served.version is not None and served.version >= version:
                return None
            if mode == INFLIGHT and self._inflight_refused is not None:
                mode = "keep"
            try:
                return await self._update(served, UpdateRequest(version, mode=mode))
            except InflightRefusedError as exc:
                # This engine can't take in-flight updates (the reason does not change while it runs):
                # the follower goes on in keep mode, instead of skipping a good version as refused.
                log.warning("vllm-delta: follow mode falls back from inflight to keep: %s", exc)
                self._inflight_refused = str(exc)
                return await self._update(await self._served(), UpdateRequest(version, mode="keep"))

    async def served_version(self) -> int | None:
        """The served version, for the follower's polls: as last read or applied, re-read from the workers
        at most every SEEN_S. Every RPC keeps vLLM's worker message queue spinning for a second (its
        idle mode starts after 1 s without messages): asking the workers at every 0.5-2 s poll would
        keep a core per worker busy. What a poll decides is re-read under the lock by follow_update."""
        seen = self._served_seen
        if seen is not None and time.monotonic() - seen[1] < SEEN_S:
            return seen[0]
        async with self.lock:
            return (await self._served()).version

    async def checksums(self) -> tuple[str, str | None]:
        """(live checksum over all ranks, the served version's recorded checksum), for ledger reports:
        computed when the served version changed, else at most every SEEN_S (see served_version)."""
        known = self._checksums_seen
        version = self._served_seen[0] if self._served_seen is not None else None
        if known is not None and known[0] == version and time.monotonic() - known[3] < SEEN_S:
            return known[1], known[2]
        async with self.lock:
            served = await self._served()
            await self._ensure_prepared(served)
            live = to_hex(combine((await self._live_sums()).items()))
            self._checksums_seen = (served.version, live, served.checksum, time.monotonic())
            return live, served.checksum

    async def _update(self, served: WorkerStatus, request: UpdateRequest) -> UpdateResult:
        """One update from `served` (read under the lock, which the caller holds through _operation)."""
        previous = served.version
        staged = await self._stage(served, request)
        if staged is None:
            target = await self._in_thread(self.store.resolve, request.version)
            m = metrics()
            if m is not None:
                m.updates.labels(outcome="unchanged").inc()
            return UpdateResult(target, previous, 0.0, 0.0, 0.0, 0, 0, [], request.mode, request.method)
        self._deadline = float("inf")  # the pause is not cut short: commit and roll back run to the end
        inflight = None
        try:
            if request.mode == INFLIGHT:
                inflight = await self.commit_inflight(staged, fault=request.fault)
                pause_ms, apply_ms = inflight.engine_ms, inflight.apply_ms
            else:
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
            inflight=inflight,
        )
        self.last_update = (out, time.time())
        self._served_seen = (out.version, time.monotonic())
        if staged.plan.reanchor:
            self._chain = list(staged.plan.versions)
        elif self._chain is not None:
            self._chain += staged.plan.versions
        if self._last_status is not None:
            # What the commit verified: the target's sums (status reads the live ones when idle).
            verified = staged.plan.records[-1].checksum
            self._last_status = dataclasses.replace(
                self._last_status,
                version=out.version,
                checksum=verified,
                version_checksum=verified,
                as_of=time.time(),
            )
        m = metrics()
        if m is not None:
            m.applied(out)
        await self._prune_cache(out.version)
        return out

    async def _prune_cache(self, served: int | None) -> None:
        """Keep the served version's chain and the prefetched versions in the download cache, drop the
        rest (and a dead process's partial downloads); then apply the size cap. Never fails an update."""
        if served is None or self.store.is_local:
            return
        try:
            if self._chain is None or self._chain[-1] != served:
                self._chain = [r.version for r in await self._in_thread(self.store.chain, served)]
            staged = self.prefetched.plan.versions if self.prefetched else []
            keep = set(self._chain) | set(staged)
            await self._in_thread(
                functools.partial(
                    self.store.prune_cache, keep, max_bytes=self.spec.cache_max_bytes, protect=set(staged)
                )
            )
            m = metrics()
            if m is not None:
                m.cache_bytes.set(await self._in_thread(self.store.cache_bytes))
        except Exception as exc:  # noqa: BLE001 - a cache that can't be pruned now is pruned next time
            log.warning("vllm-delta: pruning the download cache failed: %s", exc)

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
            await self._set_label(staged.plan.target, request.mode)
            apply_ms = max(Committed.from_wire(r).apply_ms for r in replies)
        finally:
            await self.engine.resume_generation()
        return (time.perf_counter() - t0) * 1e3, apply_ms

    async def commit_inflight(self, staged: Prefetched, fault: str | None = None) -> InflightCommitted:
        """Apply a staged, verified update between two engine steps, with no pause (one engine-core
        call: enginecore.inflight_commit). Call it under `self.lock` (update() does; so will follow
        mode). Raises InflightRefusedError (409) when the engine cannot take it safely, a DeltaError
        (500, "rolled back") when a rank failed, and nothing has changed in either case."""
        replies = await self._replies(
            enginecore.INFLIGHT_COMMIT,
            ticket=staged.ticket,
            version=staged.plan.target,
            method=staged.method,
            fault=fault,
        )
        error = reply_error(replies[0])
        if error is not None:
            if error.type == InflightRefusedError.__name__:
                raise InflightRefusedError(error.message)
            raise error.to_error(None)
        return InflightCommitted.from_wire(replies[0])

    async def _set_label(self, version: int, mode: str) -> None:
        """vLLM's weight-version label := `version` (stamped on every step's outputs from now on)."""
        try:
            reply = (await self._replies(enginecore.SET_LABEL, version=version, mode=mode))[0]
            if reply_error(reply) is not None:
                log.warning("vllm-delta: the weight-version label was not set: %s", reply)
        except Exception as exc:  # noqa: BLE001 - the weights are committed; the label is bookkeeping
            log.warning("vllm-delta: the weight-version label was not set: %s", exc)

    async def sync_label(self) -> None:
        """At start-up: label outputs with the version the workers serve (vLLM says "default")."""
        async with self.lock:
            served = await self._served()
            if served.version is not None:
                await self._set_label(served.version, "startup")

    async def engine_timeline(self) -> dict[str, Any]:
        """The engine core's label history (no lock: it waits only for the current step to end)."""
        reply = (await self._replies(enginecore.ENGINE_TIMELINE))[0]
        error = reply_error(reply)
        if error is not None:
            raise error.to_error(None)
        return dict(reply)

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
            until = time.monotonic() + self.spec.update_timeout_s
            version = served.version
            target = (
                version if version is not None else await self._in_thread(self.store.resolve, "latest", deadline=until)
            )
            await self._prepare(served, target)

    async def status(self) -> ServerStatus:
        if self.in_progress is not None:
            return self._status_while_busy()
        async with self._status_lock:
            started = self._operations
            served = await self._served()
            version = served.version
            await self._ensure_prepared(served)
            sums = await self._live_sums()
            rank0 = (await self._call("delta_status", WorkerStatus.from_wire))[0]
            if self._operations != started or self.in_progress is not None:
                return self._status_while_busy()  # an update started meanwhile: what was read may be torn
            last, when = self.last_update if self.last_update is not None else (None, None)
            self._last_status = ServerStatus(
                version=version,
                store=self.spec.uri,
                checksum=to_hex(combine(sums.items())),
                version_checksum=served.checksum,
                staged=self.prefetched.plan.versions if self.prefetched else [],
                last_update=last,
                last_update_time=when,
                tensors_via_vllm_path=rank0.fallback,
                coverage=rank0.coverage,
                as_of=time.time(),
                last_failure=self.last_failure,
                follow=self.follow_status() if self.follow_status is not None else None,
            )
            m = metrics()
            if m is not None and version is not None:
                m.served_version.set(version)
            return self._last_status

    def _status_while_busy(self) -> ServerStatus:
        """The last state read, marked with what runs now: never waits for the running update."""
        last, when = self.last_update if self.last_update is not None else (None, None)
        known = self._last_status
        return ServerStatus(
            version=known.version if known else (last.version if last else None),
            store=self.spec.uri,
            checksum=known.checksum if known else None,
            version_checksum=known.version_checksum if known else None,
            staged=self.prefetched.plan.versions if self.prefetched else [],
            last_update=last,
            last_update_time=when,
            tensors_via_vllm_path=known.tensors_via_vllm_path if known else [],
            as_of=known.as_of if known else None,
            update_in_progress=self.in_progress,
            last_failure=self.last_failure,
            coverage=known.coverage if known else None,
            follow=self.follow_status() if self.follow_status is not None else None,
        )
