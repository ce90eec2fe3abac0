"""The update protocol, written once: stage every rank -> verify -> patch every rank (its in-place writes)
-> roll every rank back if one failed -> release. (Words, docs/VLLM.md: "apply" is the whole update,
"patch" its in-place writes of the weights, "write" is a file's, "commit" the store's commit protocol,
vllm_delta/store/.)

    TwoPhaseUpdate.apply(update, options)   the whole order (this class owns it; subclasses fill in the
                                            steps for the process they run in, like vLLM's
                                            BaseModelLoader.load_model)
      .stage(update)                        stage + verify: nothing is written; on failure nothing is
                                            held and a 422 drops the versions' cached copies
      .patch(staged, options)               patch every rank (rolled back everywhere if one failed),
                                            then release
    patch_all(ranks, ...)                   patch every rank; if any failed, roll every rank back

Who runs what (the transport differs, never the order; rpc.py):

    API process    TwoPhaseUpdate (api_server/worker_update.py): staging on the workers' background
                   threads, polled over RPC; its patch step is patch_all over the engine cores, ONE
                   engine-core call each (rpc.PATCH_ALL; rpc.ROLLBACK_ALL undoes an engine's writes
                   when another engine failed)
    engine core    patch_all over model_executor.collective_rpc, inside the API's pause or between
                   two engine steps (engine_core/calls.py), with the label change as its after-patch step
    worker ranks   TwoPhaseUpdate (the weight-transfer backend): every rank runs the whole protocol,
                   exchanging its replies with the other ranks (the same replies, in rank order;
                   worker/backend.py)

The steps are coroutines so that the API process never blocks its event loop; where the transport is
synchronous (engine core, worker ranks) `run_sync` drives them without an event loop: nothing in
them suspends.

Data parallelism: every engine core holds the weights with its own ranks, so an update spans every
rank of every engine. Staging and verification: every rank of every engine stages; the partials are
verified per world (`worlds`: the ranks that together hold one copy of the weights) against the same
served sums and target header, so no engine writes unless every engine's copy would come out right.
Patching: patch_all at two levels, one protocol: each engine core patches its ranks and rolls them
back if one failed; the API process patches every engine and rolls every engine back if one failed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

from ...checksums import Sums, verify_partials
from ...errors import DeltaError, error_type, http_status
from ...format import VersionHeader
from ...server_api import Method, UpdateMode
from .messages import ErrorPayload, StageSummary
from .rpc import Replies

T = TypeVar("T")
Out = TypeVar("Out")


def run_sync(step: Coroutine[Any, Any, T]) -> T:
    """Run a protocol coroutine whose transport is synchronous (it completes without suspending)."""
    try:
        step.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    step.close()
    raise RuntimeError("a synchronous transport suspended: run this protocol step in an event loop")


@dataclass(frozen=True)
class Update:
    """What to stage: versions in order (a chain), under one ticket on every rank."""

    ticket: str
    versions: list[int]
    target: int
    method: Method = "delta"
    fault: str | None = None  # test hook (server_api.fault_hits): "stage@..." fails a rank's staging


@dataclass(frozen=True)
class Staged:
    """An update staged and verified on every rank: nothing written yet, buffers held by the ticket."""

    update: Update
    summaries: list[StageSummary]  # one per rank of every engine, in (engine, rank) order
    stage_ms: float

    def one_world(self) -> list[StageSummary]:
        """The summaries of the ranks that hold one copy of the weights (their partials add up to the
        update's change of the live sums; every world's are verified to be the same change)."""
        return [self.summaries[i] for i in worlds(self.summaries)[0]] if self.summaries else []


class RankOfWorld(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def worlds(ranks: Sequence[RankOfWorld]) -> list[range]:
    """The indices of the ranks that together hold one copy of the weights (vLLM's world group): each
    engine core's own ranks without data parallelism and with independent (dense) engines; every
    engine's ranks at once where the engines share one world (MoE data parallelism splits experts
    across engines). Replies come in (engine, rank) order, so a world is a run of ranks 0..size-1."""
    out: list[range] = []
    i = 0
    while i < len(ranks):
        size = max(ranks[i].world_size, 1)
        run = ranks[i : i + size]
        if [r.rank for r in run] != list(range(size)) or any(r.world_size != size for r in run):
            seen = [(r.rank, r.world_size) for r in ranks]
            raise DeltaError(f"the worker ranks (rank, world size) {seen} do not form whole worlds")
        out.append(range(i, i + size))
        i += size
    return out


@dataclass(frozen=True)
class PatchOptions:
    mode: UpdateMode = "keep"  # how requests ride through it (the API process pauses, or not)
    fault: str | None = None  # test hook (messages.FAULTS_ENV)


# -- patch every rank, roll every rank back --------------------------------------------------------
class Timed(Protocol):
    @property
    def apply_ms(self) -> float: ...


W = TypeVar("W", bound=Timed)


class PatchingRanks(Protocol[W]):
    """Every rank at once (replies in order): rpc.Workers, a worker rank and its peers, or every engine
    core of the API process (each writing all its ranks)."""

    async def patch(self, ticket: str, method: Method = "delta", fault: str | None = None) -> Replies[W]: ...

    async def rollback(self, ticket: str) -> Replies[Any]: ...


@dataclass(frozen=True)
class AllPatched(Generic[T]):
    apply_ms: float  # the in-place writes, slowest rank
    after: T  # what the after-patch step returned


@dataclass(frozen=True)
class AllRolledBack:
    """A rank failed (it restored itself) or the after-patch step did; every rank was rolled back."""

    failure: str  # "rank R: Type: message" of the first failure
    error: ErrorPayload | None = None  # the first failure itself (its class name, HTTP status, message)


@dataclass(frozen=True)
class RollbackFailed:
    """A rank failed, and rolling every rank back failed too: the ranks may hold different weights."""

    failure: str
    rollback_failure: str
    error: ErrorPayload | None = None


PatchOutcome = AllPatched[T] | AllRolledBack | RollbackFailed


async def patch_all(
    ranks: PatchingRanks[W],
    ticket: str,
    *,
    method: Method = "delta",
    fault: str | None = None,
    after_patch: Callable[[list[W]], T],
) -> PatchOutcome[T]:
    """Write `ticket` in place on every rank. If a rank failed (or the transport did: a worker died), or then
    `after_patch(every rank's reply)` failed, roll every rank back before anything else runs on the ranks."""
    error: ErrorPayload | None
    try:
        replies = await ranks.patch(ticket, method, fault)
    except Exception as exc:  # noqa: BLE001 - e.g. a worker died: roll back what can be
        failure, error = f"{error_type(exc)}: {exc}", ErrorPayload.from_exception(exc)
    else:
        failure = replies.failure() or ""
        error = replies.errors[0][1] if replies.errors else None
        if replies.ok:
            written = replies.all()
            apply_ms = max((r.apply_ms for r in written), default=0.0)
            try:
                return AllPatched(apply_ms, after_patch(written))
            except Exception as exc:  # noqa: BLE001 - after the writes: undo them, the caller sees the failure
                failure, error = f"after the writes: {error_type(exc)}: {exc}", ErrorPayload.from_exception(exc)
    try:
        rolled = await ranks.rollback(ticket)
        rollback_failure = None if rolled.ok else rolled.failures()
    except Exception as exc:  # noqa: BLE001 - becomes the inconsistent outcome
        rollback_failure = f"{error_type(exc)}: {exc}"
    if rollback_failure is not None:
        return RollbackFailed(failure, rollback_failure, error)
    return AllRolledBack(failure, error)


# -- the whole order -------------------------------------------------------------------------------
class TwoPhaseUpdate(ABC, Generic[Out]):
    """Owns the order of an update; subclasses fill in the steps where they run. `Out`: what a write
    returns there (the API process: its timings; the weight-transfer backend: nothing)."""

    async def apply(self, update: Update, options: PatchOptions) -> Out:
        return await self.patch(await self.stage(update), options)

    async def stage(self, update: Update) -> Staged:
        """Stage on every rank, then verify the ranks' partials against the target's header before
        anything is written. On failure the ticket is released on every rank, and an integrity
        failure (422) drops the cached copies of the versions: the next try fetches them again."""
        t0 = time.perf_counter()
        try:
            try:
                replies = await self.stage_ranks(update)
                summaries = replies.all()
                current, target = await self.verification_basis(update)
                for world in worlds(summaries):  # each engine's copy of the weights (module doc)
                    who = replies.who(world[0]).engine if replies.engines > 1 else None
                    verify_partials(current, [summaries[i].partials for i in world], target, engine=who)
            except BaseException:
                await self.release(update.ticket)
                raise
        except Exception as exc:
            if http_status(exc) == 422:
                await self.drop_cached(update.versions)
            raise
        return Staged(update, summaries, (time.perf_counter() - t0) * 1e3)

    async def patch(self, staged: Staged, options: PatchOptions) -> Out:
        """Write every rank in place (every rank rolled back if one failed), then release the ticket."""
        try:
            return await self.patch_ranks(staged, options)
        finally:
            await self.release(staged.update.ticket)

    # -- the steps -------------------------------------------------------------------------------
    @abstractmethod
    async def stage_ranks(self, update: Update) -> Replies[StageSummary]:
        """Every rank stages its share; its summary holds its checksum partials."""

    @abstractmethod
    async def verification_basis(self, update: Update) -> tuple[Sums, VersionHeader]:
        """(the served per-tensor sums the partials add to, the header of the target version)."""

    @abstractmethod
    async def patch_ranks(self, staged: Staged, options: PatchOptions) -> Out:
        """patch_all, here or in the engine core; raises unless every rank wrote."""

    @abstractmethod
    async def release(self, ticket: str) -> None:
        """Drop the ticket's buffers on every rank (best effort)."""

    @abstractmethod
    async def drop_cached(self, versions: list[int]) -> None:
        """Drop the download cache's copies of these versions."""
