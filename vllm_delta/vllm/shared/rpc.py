"""The worker and engine-core calls, declared once: name, argument type, reply type.

Every call the plugin makes across vLLM's process boundary is declared here as a `Call` and nowhere
else spells its name:

    worker calls (vLLM Worker methods, every rank answers)      engine-core calls (reserved names the
                                                                engine core answers itself, engine_core/)
    STATUS       what the rank serves (+ live sums)             PATCH_ALL       write every rank, roll
    PROBE        probe the layout (collective)                                  every rank back if one
    LIVE_SUMS    this rank's share of the live sums                             failed, label (inside a
    SERVED_SUMS  the served version's recorded sums                             pause or between steps)
    STAGE_START  stage on the rank's background thread          ROLLBACK_ALL    undo a PATCH_ALL that
    STAGE_POLL   the staging summary once done                                  landed (another engine
    PATCH        write in place                                                 failed), label back
    ROLLBACK     undo the writes                                SET_LABEL       the weight-version label
    RELEASE      drop a staged update                           ENGINE_TIMELINE the label history
                                                                PREFIX_STATE    prefix-cache counts
                                                                PROMPT_VERSIONS which label computed
                                                                                each prompt's KV

The caller's side is a typed client over a transport: `Workers` (one method per worker call, every
rank's reply as `Replies`) and `EngineCore` (one reply per engine core). Two transports carry them:
the API process's (`engine_client_transport`: every engine core, and through each its workers) and
the engine core's `model_executor.collective_rpc` (`executor_transport`: its own workers). The
callee's side is registered from the same declarations with `serve(call, implementation)` (worker
methods: worker/methods.py; reserved names: engine_core/calls.py). Arguments and replies cross as
plain values (server_api.to_wire / from_wire); a callee never raises across the boundary: it answers
an `ErrorReply` with the exception's HTTP status, and `Replies` tells results from errors in one place.

Data parallelism (`--data-parallel-size N`): one API process fronts N engine cores, each with its own
workers. A transport answers per engine, each engine's replies in rank order, and `Replies` keeps
who answered (`Where`: engine, rank). vLLM's own `EngineClient.collective_rpc` cannot be the
transport there: its data-parallel client (`DPLBAsyncMPClient.call_utility_async`) sends the call to
every engine but returns engine 0's replies only, so a failure on another engine would go unseen.
The API process asks vLLM's client for every engine's replies (`call_utility_all_async`, the method
vLLM itself uses for `reset_prefix_cache` and `wake_up`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Protocol, TypeVar

from ...errors import (
    DeltaError,
    EngineSleepingError,
    EplbRefusedError,
    InflightRefusedError,
    PatchFailedError,
    RollbackFailedError,
    error_type,
)
from ...server_api import LabelCause, Method, Timeline, UpdateMode, WeightSpan, from_wire, to_wire
from .heap import HeapAction
from .messages import (
    ErrorPayload,
    ErrorReply,
    HeapReport,
    LabelSet,
    Patched,
    PatchedAll,
    PrefixState,
    Probed,
    PromptVersions,
    RankSums,
    Released,
    RolledBack,
    RolledBackAll,
    StagePoll,
    StageStarted,
    TestPatched,
    WorkerStatus,
)
from .options import StoreSpec

log = logging.getLogger(__name__)

A = TypeVar("A")
R = TypeVar("R")
T = TypeVar("T")


# -- arguments -------------------------------------------------------------------------------------
class Args:
    """Base of the argument types: an unknown keyword is a caller's mistake (as for a Python call)."""

    @classmethod
    def check_wire(cls, data: Any) -> None:
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]  # subclasses are dataclasses
        unknown = set(data) - known if isinstance(data, dict) else set()
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown arguments {sorted(unknown)} (known: {sorted(known)})")


@dataclass(frozen=True)
class NoArgs(Args):
    pass


@dataclass(frozen=True)
class StatusArgs(Args):
    live_sums: bool = False  # also this rank's share of the live per-tensor sums (a pass over the weights)


@dataclass(frozen=True)
class ProbeArgs(Args):
    store: StoreSpec
    version: int  # the layout is probed from this version's tensor shapes


@dataclass(frozen=True)
class StageArgs(Args):
    ticket: str
    store: StoreSpec
    versions: list[int]
    method: Method = "delta"
    # The versions' commit records (JSON) as the API process read them for this update's decision; each
    # file is opened and checked against them (None: read the records afresh).
    records: list[str] | None = None
    fault: str | None = None  # test hook (server_api.fault_hits)
    # A backward update: the files of `versions` but the last are deltas undone, newest first, down to the
    # last, the target (its header only: what the result must match).
    undo: bool = False


@dataclass(frozen=True)
class TicketArgs(Args):
    ticket: str


@dataclass(frozen=True)
class PatchArgs(Args):
    ticket: str
    method: Method = "delta"
    fault: str | None = None  # test hook (messages.FAULTS_ENV)


@dataclass(frozen=True)
class PatchAllArgs(Args):
    ticket: str
    version: int
    method: Method = "delta"
    fault: str | None = None
    mode: UpdateMode = "inflight"  # a pause mode: the caller paused; "inflight": between two engine steps


@dataclass(frozen=True)
class RollbackAllArgs(Args):
    ticket: str
    version: int  # the version whose writes are undone (the engine's label goes back to the one before)


@dataclass(frozen=True)
class PromptIdsArgs(Args):
    ids: list[str]  # generate() ids (n > 1: "<k>_<id>"), without vLLM's random suffix


@dataclass(frozen=True)
class TestPatchArgs(Args):
    engine: int = 0  # the data-parallel engine whose rank 0 changes a weight


@dataclass(frozen=True)
class LabelArgs(Args):
    version: int | None = None
    label: str | None = None  # instead of the version's label
    mode: LabelCause = "pause"


# -- the declarations ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call(Generic[A, R]):
    """One call across vLLM's process boundary: its collective_rpc name, argument and reply types."""

    name: str
    args: type[A]
    reply: type[R]


STATUS = Call("delta_status", StatusArgs, WorkerStatus)
PROBE = Call("delta_probe", ProbeArgs, Probed)
LIVE_SUMS = Call("delta_live_sums", NoArgs, RankSums)
SERVED_SUMS = Call("delta_served_sums", NoArgs, RankSums)
STAGE_START = Call("delta_stage_start", StageArgs, StageStarted)
STAGE_POLL = Call("delta_stage_poll", TicketArgs, StagePoll)
PATCH = Call("delta_patch", PatchArgs, Patched)
ROLLBACK = Call("delta_rollback", TicketArgs, RolledBack)
RELEASE = Call("delta_release", TicketArgs, Released)

PATCH_ALL = Call("delta_patch_all", PatchAllArgs, PatchedAll)
ROLLBACK_ALL = Call("delta_rollback_all", RollbackAllArgs, RolledBackAll)
SET_LABEL = Call("delta_set_label", LabelArgs, LabelSet)
ENGINE_TIMELINE = Call("delta_engine_timeline", NoArgs, Timeline)
PREFIX_STATE = Call("delta_prefix_state", NoArgs, PrefixState)
PROMPT_VERSIONS = Call("delta_prompt_versions", PromptIdsArgs, PromptVersions)

WORKER_CALLS: tuple[Call[Any, Any], ...] = (
    STATUS,
    PROBE,
    LIVE_SUMS,
    SERVED_SUMS,
    STAGE_START,
    STAGE_POLL,
    PATCH,
    ROLLBACK,
    RELEASE,
)
ENGINE_CORE_CALLS: tuple[Call[Any, Any], ...] = (
    PATCH_ALL,
    ROLLBACK_ALL,
    SET_LABEL,
    ENGINE_TIMELINE,
    PREFIX_STATE,
    PROMPT_VERSIONS,
)

# Test hook, a worker method only with VLLM_DELTA_TEST_FAULTS=1 (reached through vLLM's dev-mode
# /collective_rpc, past the plugin's API process): flip one live bit, to prove that a verification
# of the live checksum catches a weight changed behind the plugin's back.
TEST_PATCH = Call("delta_test_patch", TestPatchArgs, TestPatched)


@dataclass(frozen=True)
class HeapArgs(Args):
    action: HeapAction = "report"


# Test hook, the same way: trace the worker's allocations and report what vllm_delta keeps alive (heap.py).
TEST_HEAP = Call("delta_test_heap", HeapArgs, HeapReport)


# -- replies ---------------------------------------------------------------------------------------
def error_reply(exc: BaseException) -> Any:
    """What a callee answers instead of raising: the exception's type, HTTP status and message."""
    return to_wire(ErrorReply(ErrorPayload.from_exception(exc)))


def reply_error(reply: Any) -> ErrorPayload | None:
    """The error a reply carries, or None for a result."""
    try:
        return from_wire(ErrorReply, reply).error
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Where:
    """Who answered a call: an engine core (vLLM's data-parallel rank; 0 without data parallelism) and one
    of its worker ranks (None: the engine core itself answered, a reserved engine-core call)."""

    engine: int
    rank: int | None = None

    def describe(self, engines: int) -> str:
        """ "rank R", "engine E" or "engine E rank R": the engine is named only when there are several."""
        if self.rank is None:
            return f"engine {self.engine}"
        return f"engine {self.engine} rank {self.rank}" if engines > 1 else f"rank {self.rank}"


@dataclass(frozen=True)
class Replies(Generic[R]):
    """Every reply to one call, in (engine, rank) order: its result, or the error it reported."""

    results: list[R | None]  # None where the callee failed
    errors: list[tuple[int, ErrorPayload]]  # (index into results, error), in order
    where: list[Where] = field(default_factory=list)  # who answered each result ([]: ranks 0.. of engine 0)

    @classmethod
    def decode(cls, reply: type[R], raw: Sequence[Any]) -> Replies[R]:
        """One engine's replies, in rank order."""
        return cls.of_engines(reply, [raw])

    @classmethod
    def of_engines(cls, reply: type[R], raw: Sequence[Sequence[Any]], *, engine_calls: bool = False) -> Replies[R]:
        """Every engine's replies (engine order, each in rank order); `engine_calls`: one reply per engine
        core (a reserved engine-core call), told apart from a worker rank's."""
        results: list[R | None] = []
        errors: list[tuple[int, ErrorPayload]] = []
        where: list[Where] = []
        for engine, replies in enumerate(raw):
            for rank, r in enumerate(replies):
                error = reply_error(r)
                if error is not None:
                    errors.append((len(results), error))
                results.append(None if error is not None else from_wire(reply, r))
                where.append(Where(engine, None if engine_calls else rank))
        return cls(results, errors, where)

    @property
    def engines(self) -> int:
        """How many engine cores answered."""
        return 1 + max((w.engine for w in self.where), default=0)

    def who(self, index: int) -> Where:
        return self.where[index] if self.where else Where(0, index)

    def describe(self, index: int) -> str:
        return self.who(index).describe(self.engines)

    @property
    def ok(self) -> bool:
        return not self.errors

    def all(self) -> list[R]:
        """Every result; the first failure's error is raised (a WorkerError with its status, naming who)."""
        if self.errors:
            index, error = self.errors[0]
            raise error.to_error(self.describe(index))
        return [r for r in self.results if r is not None]

    def per_engine(self) -> list[list[R]]:
        """Every result, grouped by engine (engine order); raises as `all`."""
        out: list[list[R]] = [[] for _ in range(self.engines)]
        for i, r in enumerate(self.all()):
            out[self.who(i).engine].append(r)
        return out

    def failure(self) -> str | None:
        """ "rank R: Type: message" (with several engines "engine E rank R: ...") of the first failure;
        None when every callee succeeded."""
        return self.errors[0][1].describe(self.describe(self.errors[0][0])) if self.errors else None

    def failures(self) -> str:
        return "; ".join(e.describe(self.describe(i)) for i, e in self.errors)

    def failed_with(self, error: type[BaseException]) -> bool:
        """Some callee failed with this exception class (by name: errors cross processes as text)."""
        return any(e.type == error_type(error) for _, e in self.errors)


# -- transports ------------------------------------------------------------------------------------
class Transport(Protocol):
    """Sends one call to every rank of every engine core: the plain replies per engine (engine order),
    each engine's in rank order."""

    def __call__(self, name: str, kwargs: dict[str, Any]) -> Awaitable[list[list[Any]]]: ...


def engine_client_transport(engine_client: Any, timeout_s: float) -> Transport:
    """The API process: vLLM's `collective_rpc` on every engine core (through each to its workers).

    vLLM's AsyncLLM keeps its engine-core client as `engine_client.engine_core`; its
    `call_utility_all_async` (vLLM 0.32 and 0.33, `AsyncMPClient` and the data-parallel clients) sends
    the utility call to every engine core it manages and answers one result per engine. An engine
    client without it (another EngineClient, a test's) fronts one engine: its `collective_rpc`."""
    every_engine = getattr(getattr(engine_client, "engine_core", None), "call_utility_all_async", None)

    async def send(name: str, kwargs: dict[str, Any]) -> list[list[Any]]:
        if every_engine is not None:
            per_engine = await every_engine("collective_rpc", name, timeout_s, (), kwargs)
            return [list(replies) for replies in per_engine]
        return [list(await engine_client.collective_rpc(name, timeout=timeout_s, kwargs=kwargs))]

    return send


def executor_transport(executor: Any) -> Transport:
    """The engine core: `model_executor.collective_rpc` to its own workers, synchronous (it never
    suspends: see two_phase.run_sync)."""

    async def send(name: str, kwargs: dict[str, Any]) -> list[list[Any]]:
        return [list(executor.collective_rpc(name, kwargs=kwargs))]

    return send


class Workers:
    """The worker calls, typed: every rank's reply to each."""

    def __init__(self, transport: Transport):
        self._send = transport

    async def call(self, call: Call[A, R], args: A) -> Replies[R]:
        return Replies.of_engines(call.reply, await self._send(call.name, to_wire(args)))

    async def status(self, *, live_sums: bool = False) -> Replies[WorkerStatus]:
        return await self.call(STATUS, StatusArgs(live_sums))

    async def probe(self, store: StoreSpec, version: int) -> Replies[Probed]:
        return await self.call(PROBE, ProbeArgs(store, version))

    async def live_sums(self) -> Replies[RankSums]:
        return await self.call(LIVE_SUMS, NoArgs())

    async def served_sums(self) -> Replies[RankSums]:
        return await self.call(SERVED_SUMS, NoArgs())

    async def stage_start(self, args: StageArgs) -> Replies[StageStarted]:
        return await self.call(STAGE_START, args)

    async def stage_poll(self, ticket: str) -> Replies[StagePoll]:
        return await self.call(STAGE_POLL, TicketArgs(ticket))

    async def patch(self, ticket: str, method: Method = "delta", fault: str | None = None) -> Replies[Patched]:
        return await self.call(PATCH, PatchArgs(ticket, method, fault))

    async def rollback(self, ticket: str) -> Replies[RolledBack]:
        return await self.call(ROLLBACK, TicketArgs(ticket))

    async def release(self, ticket: str) -> Replies[Released]:
        return await self.call(RELEASE, TicketArgs(ticket))


# What a callee refuses before doing anything (409: nothing written), by the name its reply carries.
REFUSALS: dict[str, type[DeltaError]] = {
    error_type(cls): cls for cls in (InflightRefusedError, EplbRefusedError, EngineSleepingError)
}
# Errors of the engine core's calls that keep their class in the API process (their HTTP answer names it).
_ENGINE_ERRORS: dict[str, type[DeltaError]] = {
    **REFUSALS,
    **{error_type(cls): cls for cls in (PatchFailedError, RollbackFailedError)},
}


class EngineCore:
    """The engine cores' own calls (one reply per engine core), typed. `every` keeps each engine's error;
    the others raise the first, keeping the classes the HTTP answer names."""

    def __init__(self, transport: Transport):
        self._send = transport

    async def every(self, call: Call[A, R], args: A) -> Replies[R]:
        """Every engine core's reply, in engine order (errors kept, as `Replies`)."""
        return Replies.of_engines(call.reply, await self._send(call.name, to_wire(args)), engine_calls=True)

    async def _all(self, call: Call[A, R], args: A) -> list[R]:
        replies = await self.every(call, args)
        if replies.errors:
            index, error = replies.errors[0]
            known = _ENGINE_ERRORS.get(error.type)
            who = replies.describe(index) if replies.engines > 1 else None
            if known is not None:
                raise known(f"{who}: {error.message}" if who else error.message)
            raise error.to_error(who)
        return replies.all()

    async def patch_all(self, args: PatchAllArgs) -> Replies[PatchedAll]:
        return await self.every(PATCH_ALL, args)

    async def rollback_all(self, args: RollbackAllArgs) -> Replies[RolledBackAll]:
        return await self.every(ROLLBACK_ALL, args)

    async def set_label(self, version: int | None, mode: LabelCause) -> list[LabelSet]:
        return await self._all(SET_LABEL, LabelArgs(version=version, mode=mode))

    async def timelines(self) -> list[Timeline]:
        """Every engine core's label history, in engine order."""
        return await self._all(ENGINE_TIMELINE, NoArgs())

    async def prompt_versions(self, ids: list[str]) -> dict[str, list[WeightSpan]]:
        """The prompt spans of these requests, from whichever engine core ran each (an engine answers only
        the ids it holds; with data parallelism a request runs on one engine)."""
        found: dict[str, list[WeightSpan]] = {}
        for reply in await self._all(PROMPT_VERSIONS, PromptIdsArgs(list(ids))):
            found.update(reply.spans)
        return found


class EnginePatches:
    """Every engine core as the ranks of two_phase.patch_all (the API process): writing is one PATCH_ALL per
    engine (each writes all its ranks, rolled back there if one failed); rolling back is ROLLBACK_ALL on
    every engine, which undoes the writes of an engine whose PATCH_ALL landed (and its label)."""

    def __init__(self, engine_core: EngineCore, args: PatchAllArgs):
        self.engine_core = engine_core
        self.args = args

    async def patch(self, ticket: str, method: Method = "delta", fault: str | None = None) -> Replies[PatchedAll]:
        assert (ticket, method, fault) == (self.args.ticket, self.args.method, self.args.fault)
        return await self.engine_core.patch_all(self.args)

    async def rollback(self, ticket: str) -> Replies[RolledBackAll]:
        return await self.engine_core.rollback_all(RollbackAllArgs(ticket, self.args.version))


# -- the callee's side -----------------------------------------------------------------------------
def answer(what: str, fn: Callable[[], Any]) -> Any:
    """`fn()`'s reply in plain form, or the error reply of what it raised (a callee never raises)."""
    try:
        return to_wire(fn())
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller with its status
        log.warning("vllm-delta: %s failed: %s", what, exc)
        return error_reply(exc)


def serve(call: Call[A, R], implementation: Callable[[T, A], R]) -> Callable[..., Any]:
    """The function vLLM calls by `call.name` (a Worker method, or a reserved engine-core name): keyword
    arguments in plain form, the reply (or an error reply) out. `implementation(owner, args)`."""

    def method(owner: T, **kwargs: Any) -> Any:
        return answer(call.name, lambda: implementation(owner, from_wire(call.args, kwargs)))

    method.__name__ = method.__qualname__ = call.name
    method.__doc__ = implementation.__doc__
    return method
