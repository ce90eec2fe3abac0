"""The typed boundary between the API process, the engine core and the workers, and the HTTP bodies.

Every value that crosses a process boundary or leaves as JSON is one of these dataclasses, and every
one converts through the generic codec (wire.py) with the two functions of this module:

    to_wire(message)       -> plain values (RPC: vLLM's msgpack boundary; HTTP: the JSON answer)
    from_wire(cls, data)   -> the message, checked against its type hints

* HTTP: the requests (`StageRequest`, `UpdateRequest`: a 400 names the first problem, `check_wire`)
  and the answers (`StageResult`, `UpdateResult`, `ServerStatus`, `Timeline`).
* RPC: what a worker rank answers (`WorkerStatus`, `StageSummary`, ...; the calls are declared in
  rpc.py) and what the engine core answers (`CommittedAll`, `LabelSet`, `Timeline`).
  64-bit checksum sums are ints in Python and 16 hex digits on the wire (`HexSums`). A failing rank
  answers `ErrorReply` instead (rpc.py tells the two apart).

The vocabularies (update modes, commit methods, operations) are `Literal` aliases defined here once.
Nothing outside this module reads a payload by key.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args

from ...errors import BadRequestError, WorkerError, http_status, short
from . import wire
from .wire import HexSums, Millis, omit_none

PauseMode = Literal["keep", "wait", "abort"]  # vLLM's pause modes
UpdateMode = Literal["keep", "wait", "abort", "inflight"]  # "inflight": no pause (engine_core/reserved.py)
Method = Literal["delta", "vllm"]  # our scatter | vLLM's load_checkpoint_weight_patches (vllm_path.py)
Operation = Literal["update", "stage"]
LabelCause = Literal["keep", "wait", "abort", "inflight", "startup", "pause"]  # why the label changed

UPDATE_MODES: tuple[UpdateMode, ...] = get_args(UpdateMode)
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
METHODS: tuple[Method, ...] = get_args(Method)

# Test hook: with VLLM_DELTA_TEST_FAULTS=1 an update may name a fault ("commit@<rank>") that makes
# that rank fail right after its writes, to prove the cross-rank rollback on a real server.
FAULTS_ENV = "VLLM_DELTA_TEST_FAULTS"

Json = dict[str, Any]
M = TypeVar("M")


def to_wire(message: Any) -> Any:
    """The plain form of a message: what crosses vLLM's msgpack boundary, or the HTTP answer's JSON."""
    return wire.encode(message)


def from_wire(cls: type[M], data: Any) -> M:
    """A message from its plain form (an RPC reply or argument, an HTTP body, a client's JSON)."""
    return wire.decode(cls, data)


# -- HTTP requests ---------------------------------------------------------------------------------
def _check_body(body: Any, known: set[str]) -> None:
    """The request's fields, checked in a fixed order (the first problem is the 400's message)."""
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    unknown = set(body) - known
    if unknown:
        raise BadRequestError(f"unknown fields {short(sorted(map(str, unknown)))} (known: {sorted(known)})")
    if "version" not in body:
        raise BadRequestError('"version" is required: a version number or "latest"')
    version = body["version"]
    if isinstance(version, bool) or not (version == "latest" or (isinstance(version, int) and version >= 0)):
        raise BadRequestError(f'"version" must be a non-negative integer or "latest", not {short(version)}')
    if not isinstance(body.get("allow_reanchor", False), bool):
        raise BadRequestError('"allow_reanchor" must be true or false')
    mode = body.get("mode", "keep")
    if mode not in UPDATE_MODES:
        raise BadRequestError(f'"mode" must be one of {", ".join(UPDATE_MODES)}, not {short(mode)}')
    method = body.get("method", "delta")
    if method not in METHODS:
        raise BadRequestError(f'"method" must be one of {", ".join(METHODS)}, not {short(method)}')
    if body.get("fault") is not None and os.environ.get(FAULTS_ENV) != "1":
        raise BadRequestError(f'"fault" is a test hook, enabled only with {FAULTS_ENV}=1')


@dataclass(frozen=True)
class StageRequest:
    """POST /v1/delta/stage: stage now, apply later (no pause)."""

    version: int | str  # a version number or "latest"
    allow_reanchor: bool = False
    method: Method = "delta"

    @classmethod
    def check_wire(cls, body: Any) -> None:
        _check_body(body, {f.name for f in fields(cls)})


@dataclass(frozen=True)
class UpdateRequest:
    """POST /v1/delta/update_weights."""

    version: int | str  # a version number or "latest"
    allow_reanchor: bool = False
    mode: UpdateMode = "keep"
    method: Method = "delta"
    fault: str | None = None  # test hook (FAULTS_ENV)

    @classmethod
    def check_wire(cls, body: Any) -> None:
        _check_body(body, {f.name for f in fields(cls)})


# -- HTTP answers ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StageResult:
    """200 answer of /v1/delta/stage. `target`, `nnz` and `bytes` only when something was staged."""

    version: int | None  # the served version
    staged: list[int]
    target: int | None = omit_none()
    stage_ms: Millis = 0.0
    nnz: int | None = omit_none()
    bytes: int | None = omit_none()


@dataclass(frozen=True, kw_only=True)
class InflightAnswer:
    """The `inflight` part of an in-flight update's answer: what the engine core did (CommittedAll
    without the per-request switch indices, which are in the timeline)."""

    label: str
    previous_label: str
    engine_step: int
    engine_ms: Millis
    apply_ms: Millis
    dropped_blocks: int
    dropped_blocks_in_use: int
    tainted: int
    batches_in_flight: int
    requests_running: int


@dataclass(frozen=True, kw_only=True)
class UpdateResult:
    """200 answer of /v1/delta/update_weights (docs/VLLM.md). The fields after `method` are present only
    when versions were applied: an update to the version already served answers without them."""

    version: int
    previous_version: int | None
    pause_ms: Millis
    apply_ms: Millis
    stage_ms: Millis
    nnz: int  # changed elements the applied versions record
    bytes: int  # file bytes of the applied versions
    applied: list[int]
    mode: UpdateMode
    method: Method
    reanchored: bool | None = omit_none()
    prefetched: bool | None = omit_none()
    elements_written: int | None = omit_none()  # summed over ranks
    staged_bytes: int | None = omit_none()  # summed over ranks
    timings: dict[str, float] | None = omit_none()  # staging stages of rank 0, ms
    inflight: InflightAnswer | None = omit_none()  # mode "inflight": what the engine core did


@dataclass(frozen=True, kw_only=True)
class AppliedUpdate(UpdateResult):
    """The last applied update in GET /v1/delta/status: its answer, and when it was applied."""

    time: float

    @classmethod
    def of(cls, result: UpdateResult, when: float) -> AppliedUpdate:
        return cls(**{f.name: getattr(result, f.name) for f in fields(result)}, time=when)


@dataclass(frozen=True)
class InProgress:
    """An update or prefetch running now (GET /v1/delta/status answers without waiting for it)."""

    operation: Operation
    version: int | str  # as requested: a number or "latest"
    since: float  # unix time it started
    seconds: Millis = 0.0  # how long it has run, as of the answer

    def as_of_now(self) -> InProgress:
        return InProgress(self.operation, self.version, self.since, max(0.0, time.time() - self.since))


@dataclass(frozen=True)
class Failure:
    """The last update or prefetch that failed (what it answered)."""

    operation: Operation
    version: int | str
    type: str
    status: int
    message: str
    time: float


@dataclass(frozen=True, kw_only=True)
class FollowStatus:
    """The `follow` part of GET /v1/delta/status: where a following (or reporting) server stands.
    Clients (the example, tests) read it with `from_wire(FollowStatus, status["follow"])`."""

    following: bool  # delta_follow: the server applies new versions on its own
    store: str
    served: int | None
    newest_seen: int | None  # the store's newest version at the last poll
    lag: int | None  # newest_seen - served
    last_error: str | None
    last_error_version: int | None  # the version that failed (None: a store fault, not a version)
    last_error_time: float | None
    skipped: dict[int, str]  # bad versions never applied (and not retried): version -> why
    polls: int
    updates: int  # updates the follower applied
    last_pause_ms: Millis | None
    reporting: bool  # writing this replica's report to the store's ledger
    replica_id: str | None
    poll_s: float
    mode: UpdateMode


# -- the coverage report (DeltaReplica.coverage, in WorkerStatus and GET /v1/delta/status) ---------
@dataclass(frozen=True)
class Counted:
    tensors: int
    elements: int


@dataclass(frozen=True)
class ViaVllm:
    """Tensors through vLLM's sparse path: O(tensor size) per update, with the probe's reason."""

    tensors: int
    elements: int
    names: list[str]
    reasons: dict[str, str]


@dataclass(frozen=True)
class Recomputed:
    """vLLM-side tensors a handler rebuilds after every update."""

    tensors: int
    elements: int
    names: list[str]
    handlers: list[str]


@dataclass(frozen=True)
class HandlerInfo:
    name: str
    cost: str


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """How the served model's tensors take updates: in place, through vLLM's sparse path, recomputed."""

    tensors: int
    elements: int
    in_place: Counted
    vllm_path: ViaVllm
    recomputed: Recomputed
    fully_in_place: bool
    handlers: list[HandlerInfo]
    post_processing: dict[str, int] | None  # what vLLM's post-processing did, by category


@dataclass(frozen=True, kw_only=True)
class ServerStatus:
    """200 answer of GET /v1/delta/status. While an update runs, the answer is the state known before it
    (`as_of`: when that was read from the workers) and `update_in_progress` says what runs. `follow` is
    null unless the server follows or reports."""

    version: int | None
    store: str
    checksum: str | None  # of the live parameters, summed over ranks (None: not known yet)
    version_checksum: str | None  # what the served version's header records
    staged: list[int]  # the prefetched update's versions
    last_update: AppliedUpdate | None
    tensors_via_vllm_path: list[str]
    coverage: Coverage | None = None
    as_of: float | None = None
    update_in_progress: InProgress | None = None
    last_failure: Failure | None = None
    follow: FollowStatus | None = None


# -- RPC replies of one worker rank ----------------------------------------------------------------
@dataclass(frozen=True)
class ErrorPayload:
    """An exception raised in a worker or the engine core, carried across the RPC boundary with its
    HTTP status."""

    type: str
    status: int
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorPayload:
        return cls(type(exc).__name__, http_status(exc), str(exc))

    def to_error(self, rank: int | None) -> WorkerError:
        return WorkerError(self.message, status=self.status, rank=rank, type_name=self.type)

    def describe(self, rank: int) -> str:
        return f"rank {rank}: {self.type}: {self.message}"


@dataclass(frozen=True)
class ErrorReply:
    """What a worker method (or a reserved engine-core call) answers instead of raising."""

    error: ErrorPayload


@dataclass(frozen=True)
class WorkerStatus:
    """rpc.STATUS: what one rank serves."""

    rank: int
    version: int | None
    checksum: str | None  # whole-model checksum the served version's header records
    prepared: bool  # the layout has been probed
    fallback: list[str] = field(default_factory=list)  # tensors through vLLM's sparse path
    tickets: list[str] = field(default_factory=list)  # staged updates held
    coverage: Coverage | None = None
    live_sums: HexSums | None = None  # this rank's share of the live per-tensor sums, when asked for


@dataclass(frozen=True)
class Prepared:
    """rpc.PREPARE: the tensors the probe sent through vLLM's sparse path."""

    fallback: list[str]


@dataclass(frozen=True)
class RankSums:
    """rpc.LIVE_SUMS (this rank's share of the live per-tensor sums) and rpc.SERVED_SUMS (the sums
    the served version's header records): HF name -> sum mod 2^64."""

    version: int | None  # the served version
    sums: HexSums


@dataclass(frozen=True)
class StageSummary:
    """A rank's staged update: its checksum partials Σ w(p)(new - old) per tensor (owned elements)."""

    versions: list[int]
    partials: HexSums
    nnz: int  # elements this rank will write
    bytes: int  # staged device bytes
    stage_ms: float
    timings: dict[str, float] = field(default_factory=dict)  # ms per staging phase


@dataclass(frozen=True)
class StageStarted:
    """rpc.STAGE_START: staging runs on the worker's background thread."""

    started: str  # the ticket


@dataclass(frozen=True)
class StagePoll:
    """rpc.STAGE_POLL: the summary once staging is done."""

    done: bool
    summary: StageSummary | None = None

    @classmethod
    def of(cls, summary: StageSummary | None) -> StagePoll:
        return cls(summary is not None, summary)


@dataclass(frozen=True)
class Committed:
    """rpc.COMMIT: the rank's in-place writes took `apply_ms`."""

    apply_ms: float


@dataclass(frozen=True)
class RolledBack:
    """rpc.ROLLBACK: False when the rank had nothing committed to undo."""

    rolled_back: bool


@dataclass(frozen=True)
class Released:
    """rpc.RELEASE: the ticket's buffers are dropped."""

    released: str


# -- engine-core replies (engine_core/reserved.py: reserved collective_rpc names) ------------------------------
@dataclass(frozen=True, kw_only=True)
class CommittedAll:
    """rpc.COMMIT_ALL: every rank committed, in a pause or (mode "inflight") between two engine steps,
    and the label changed. The prefix-cache and request numbers are those of an in-flight commit (0 in
    a pause: the API process resets the prefix cache itself)."""

    version: int
    label: str  # vLLM's weight-version label from now on
    previous_label: str
    engine_step: int  # labelled engine steps before the commit: the first step on the new weights is the next
    engine_ms: float  # the engine loop's stall: preflight, writes on every rank, invalidation, label
    apply_ms: float  # the in-place writes, slowest rank
    dropped_blocks: int  # prefix-cache blocks whose hash was dropped
    dropped_blocks_in_use: int  # ... of them still held (and valid) for running requests
    tainted: int  # requests holding KV at the commit: they never insert prefix-cache hashes
    batches_in_flight: int  # batches already dispatched (batch queue): they keep the old label
    switch: dict[str, int]  # generate() request id -> index of its first output token on the new weights
    time: float  # wall clock (time.time()) at the commit

    def answer(self) -> InflightAnswer:
        """The HTTP answer's `inflight` part."""
        return InflightAnswer(
            label=self.label,
            previous_label=self.previous_label,
            engine_step=self.engine_step,
            engine_ms=self.engine_ms,
            apply_ms=self.apply_ms,
            dropped_blocks=self.dropped_blocks,
            dropped_blocks_in_use=self.dropped_blocks_in_use,
            tainted=self.tainted,
            batches_in_flight=self.batches_in_flight,
            requests_running=len(self.switch),
        )


@dataclass(frozen=True, kw_only=True)
class LabelSet:
    """rpc.SET_LABEL: the weight-version label set at start-up (or by hand)."""

    label: str
    previous_label: str
    engine_step: int
    time: float


@dataclass(frozen=True)
class PrefixCleared:
    """What dropping the prefix-cache hashes found (engine_core/reserved.py: drop_prefix_hashes)."""

    hash_keys: int
    blocks: int
    blocks_in_use: int


@dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """One label change in the engine core's history: an update in a pause (or the start-up label), or
    an in-flight commit (the fields from `engine_ms` to `switch`)."""

    mode: LabelCause
    version: int | None
    label: str
    previous_label: str
    engine_step: int
    engine_ms: float | None = omit_none()
    apply_ms: float | None = omit_none()
    dropped_blocks: int | None = omit_none()
    dropped_blocks_in_use: int | None = omit_none()
    tainted: int | None = omit_none()
    batches_in_flight: int | None = omit_none()
    switch: dict[str, int] | None = omit_none()
    time: float


@dataclass(frozen=True)
class ChoiceSpans:
    """The spans of one choice of a response: [[version, start, end], ...] (api_server attribution)."""

    index: int
    weight_versions: list[list[Any]]


@dataclass(frozen=True, kw_only=True)
class CommitSwitch:
    """A commit a response lived through, with its requests' switch indices (timeline by id)."""

    version: int | None
    label: str
    engine_step: int
    time: float
    switch: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """rpc.ENGINE_TIMELINE (the engine core's label history) and GET /v1/delta/timeline, which adds, for
    ?id=<response id>, the spans of that response's choices and the commits it lived through."""

    label: str
    engine_step: int
    inconsistent: str | None
    history: list[HistoryEntry]
    history_limit: int
    id: str | None = omit_none()
    choices: list[ChoiceSpans] | None = omit_none()
    commits: list[CommitSwitch] | None = omit_none()


@dataclass(frozen=True)
class PrefixState:
    """rpc.PREFIX_STATE: how many blocks carry a prefix hash, which requests are tainted (tests)."""

    hash_keys: int
    hashed_blocks: int
    tainted: list[str]
    async_scheduling: bool
    batch_queue: int | None
