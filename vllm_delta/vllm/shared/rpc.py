"""The worker and engine-core calls, declared once: name, argument type, reply type.

Every call the plugin makes across vLLM's process boundary is declared here as a `Call` and nowhere
else spells its name:

    worker calls (vLLM Worker methods, every rank answers)      engine-core calls (reserved names the
                                                                engine core answers itself, engine_core/)
    STATUS       what the rank serves (+ live sums)             COMMIT_ALL      commit every rank, roll
    PREPARE      probe the layout (collective)                                  every rank back if one
    LIVE_SUMS    this rank's share of the live sums                             failed, label (inside a
    SERVED_SUMS  the served version's recorded sums                             pause or between steps)
    STAGE_START  stage on the rank's background thread          SET_LABEL       the weight-version label
    STAGE_POLL   the staging summary once done                  ENGINE_TIMELINE the label history
    COMMIT       write in place                                 PREFIX_STATE    prefix-cache counts
    ROLLBACK     undo a commit                                  PROMPT_VERSIONS which label computed
                                                                                each prompt's KV
    RELEASE      drop a staged update

The caller's side is a typed client over a transport: `Workers` (one method per worker call, every
rank's reply as `Replies`) and `EngineCore`. Two transports carry them: the API process's
`EngineClient.collective_rpc` (`engine_client_transport`) and the engine core's
`model_executor.collective_rpc` (`executor_transport`). The callee's side is registered from the same
declarations with `serve(call, implementation)` (worker methods: worker/methods.py; reserved names:
engine_core/reserved.py). Arguments and replies cross as plain values (server_api.to_wire /
from_wire); a callee never raises across the boundary: it answers an `ErrorReply` with the
exception's HTTP status, and `Replies` tells results from errors in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Generic, Protocol, TypeVar

from ...errors import (
    CommitFailedError,
    DeltaError,
    EplbRefusedError,
    InflightRefusedError,
    RollbackFailedError,
)
from ...server_api import LabelCause, Method, Timeline, UpdateMode, WeightSpan, from_wire, to_wire
from .heap import HeapAction
from .messages import (
    Committed,
    CommittedAll,
    ErrorPayload,
    ErrorReply,
    HeapReport,
    LabelSet,
    PrefixState,
    Prepared,
    PromptVersions,
    RankSums,
    Released,
    RolledBack,
    StagePoll,
    StageStarted,
    TestWritten,
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
class PrepareArgs(Args):
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


@dataclass(frozen=True)
class TicketArgs(Args):
    ticket: str


@dataclass(frozen=True)
class CommitArgs(Args):
    ticket: str
    method: Method = "delta"
    fault: str | None = None  # test hook (messages.FAULTS_ENV)


@dataclass(frozen=True)
class CommitAllArgs(Args):
    ticket: str
    version: int
    method: Method = "delta"
    fault: str | None = None
    mode: UpdateMode = "inflight"  # a pause mode: the caller paused; "inflight": between two engine steps


@dataclass(frozen=True)
class PromptIdsArgs(Args):
    ids: list[str]  # generate() ids (n > 1: "<k>_<id>"), without vLLM's random suffix


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
PREPARE = Call("delta_prepare", PrepareArgs, Prepared)
LIVE_SUMS = Call("delta_live_sums", NoArgs, RankSums)
SERVED_SUMS = Call("delta_served_sums", NoArgs, RankSums)
STAGE_START = Call("delta_stage_start", StageArgs, StageStarted)
STAGE_POLL = Call("delta_stage_poll", TicketArgs, StagePoll)
COMMIT = Call("delta_commit", CommitArgs, Committed)
ROLLBACK = Call("delta_rollback", TicketArgs, RolledBack)
RELEASE = Call("delta_release", TicketArgs, Released)

COMMIT_ALL = Call("delta_commit_all", CommitAllArgs, CommittedAll)
SET_LABEL = Call("delta_set_label", LabelArgs, LabelSet)
ENGINE_TIMELINE = Call("delta_engine_timeline", NoArgs, Timeline)
PREFIX_STATE = Call("delta_prefix_state", NoArgs, PrefixState)
PROMPT_VERSIONS = Call("delta_prompt_versions", PromptIdsArgs, PromptVersions)

WORKER_CALLS: tuple[Call[Any, Any], ...] = (
    STATUS,
    PREPARE,
    LIVE_SUMS,
    SERVED_SUMS,
    STAGE_START,
    STAGE_POLL,
    COMMIT,
    ROLLBACK,
    RELEASE,
)
ENGINE_CORE_CALLS: tuple[Call[Any, Any], ...] = (COMMIT_ALL, SET_LABEL, ENGINE_TIMELINE, PREFIX_STATE, PROMPT_VERSIONS)

# Test hook, a worker method only with VLLM_DELTA_TEST_FAULTS=1 (reached through vLLM's dev-mode
# /collective_rpc, past the plugin's API process): flip one live bit, to prove that a verification
# of the live checksum catches a weight changed behind the plugin's back.
TEST_WRITE = Call("delta_test_write", NoArgs, TestWritten)


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
class Replies(Generic[R]):
    """Every rank's reply to one call, in rank order: its result, or the error it reported."""

    results: list[R | None]  # None where the rank failed
    errors: list[tuple[int, ErrorPayload]]  # (rank, error), in rank order

    @classmethod
    def decode(cls, reply: type[R], raw: Sequence[Any]) -> Replies[R]:
        results: list[R | None] = []
        errors: list[tuple[int, ErrorPayload]] = []
        for rank, r in enumerate(raw):
            error = reply_error(r)
            if error is not None:
                errors.append((rank, error))
            results.append(None if error is not None else from_wire(reply, r))
        return cls(results, errors)

    @property
    def ok(self) -> bool:
        return not self.errors

    def all(self) -> list[R]:
        """Every rank's result; the first failed rank's error is raised (a WorkerError with its status)."""
        if self.errors:
            rank, error = self.errors[0]
            raise error.to_error(rank)
        return [r for r in self.results if r is not None]

    def failure(self) -> str | None:
        """ "rank R: Type: message" of the first failed rank; None when every rank succeeded."""
        return self.errors[0][1].describe(self.errors[0][0]) if self.errors else None

    def failures(self) -> str:
        return "; ".join(e.describe(rank) for rank, e in self.errors)


# -- transports ------------------------------------------------------------------------------------
class Transport(Protocol):
    """Sends one call to every rank: its plain replies, in rank order."""

    def __call__(self, name: str, kwargs: dict[str, Any]) -> Awaitable[list[Any]]: ...


def engine_client_transport(engine_client: Any, timeout_s: float) -> Transport:
    """The API process: vLLM's `EngineClient.collective_rpc` (through the engine core to the workers)."""

    async def send(name: str, kwargs: dict[str, Any]) -> list[Any]:
        return list(await engine_client.collective_rpc(name, timeout=timeout_s, kwargs=kwargs))

    return send


def executor_transport(executor: Any) -> Transport:
    """The engine core: `model_executor.collective_rpc`, synchronous (it never suspends: see
    commit.run_sync)."""

    async def send(name: str, kwargs: dict[str, Any]) -> list[Any]:
        return list(executor.collective_rpc(name, kwargs=kwargs))

    return send


class Workers:
    """The worker calls, typed: every rank's reply to each."""

    def __init__(self, transport: Transport):
        self._send = transport

    async def call(self, call: Call[A, R], args: A) -> Replies[R]:
        return Replies.decode(call.reply, await self._send(call.name, to_wire(args)))

    async def status(self, *, live_sums: bool = False) -> Replies[WorkerStatus]:
        return await self.call(STATUS, StatusArgs(live_sums))

    async def prepare(self, store: StoreSpec, version: int) -> Replies[Prepared]:
        return await self.call(PREPARE, PrepareArgs(store, version))

    async def live_sums(self) -> Replies[RankSums]:
        return await self.call(LIVE_SUMS, NoArgs())

    async def served_sums(self) -> Replies[RankSums]:
        return await self.call(SERVED_SUMS, NoArgs())

    async def stage_start(self, args: StageArgs) -> Replies[StageStarted]:
        return await self.call(STAGE_START, args)

    async def stage_poll(self, ticket: str) -> Replies[StagePoll]:
        return await self.call(STAGE_POLL, TicketArgs(ticket))

    async def commit(self, ticket: str, method: Method = "delta", fault: str | None = None) -> Replies[Committed]:
        return await self.call(COMMIT, CommitArgs(ticket, method, fault))

    async def rollback(self, ticket: str) -> Replies[RolledBack]:
        return await self.call(ROLLBACK, TicketArgs(ticket))

    async def release(self, ticket: str) -> Replies[Released]:
        return await self.call(RELEASE, TicketArgs(ticket))


# Errors of the engine core's calls that keep their class in the API process (their HTTP answer names it).
_ENGINE_ERRORS: dict[str, type[DeltaError]] = {
    cls.__name__: cls for cls in (InflightRefusedError, EplbRefusedError, CommitFailedError, RollbackFailedError)
}


class EngineCore:
    """The engine core's own calls (one reply each), typed; its errors are raised in this process."""

    def __init__(self, transport: Transport):
        self._workers = Workers(transport)

    async def _one(self, call: Call[A, R], args: A) -> R:
        replies = await self._workers.call(call, args)
        if replies.errors:
            error = replies.errors[0][1]
            known = _ENGINE_ERRORS.get(error.type)
            raise known(error.message) if known is not None else error.to_error(None)
        return replies.all()[0]

    async def commit_all(self, args: CommitAllArgs) -> CommittedAll:
        return await self._one(COMMIT_ALL, args)

    async def set_label(self, version: int | None, mode: LabelCause) -> LabelSet:
        return await self._one(SET_LABEL, LabelArgs(version=version, mode=mode))

    async def timeline(self) -> Timeline:
        return await self._one(ENGINE_TIMELINE, NoArgs())

    async def prompt_versions(self, ids: list[str]) -> dict[str, list[WeightSpan]]:
        return (await self._one(PROMPT_VERSIONS, PromptIdsArgs(list(ids)))).spans


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
