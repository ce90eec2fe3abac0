"""The HTTP contract of a vllm-delta server (docs/VLLM.md): the request and answer bodies of /v1/delta/*.

The server plugin answers with these types and clients read them with the same types (the TRL
integration, routers, tests): `from_wire(ServerStatus, requests.get(url).json())`. Nothing here needs
vLLM, so a trainer-side client imports it without the plugin. Every body converts through the generic
codec (wire.py) with the two functions of this module:

    to_wire(body)          -> plain values (the JSON answer)
    from_wire(cls, data)   -> the body, checked against its type hints

The requests check their raw JSON first (`check_wire`: a 400 names the first problem). The vocabularies
(update modes, patch methods, operations) are `Literal` aliases defined here once. The worker and
engine-core messages are in vllm/shared/messages.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar, get_args

from . import wire
from .attribution import PREFILL_WEIGHT_VERSIONS as PREFILL_WEIGHT_VERSIONS
from .attribution import RETURN_WEIGHT_VERSIONS as RETURN_WEIGHT_VERSIONS
from .attribution import WEIGHT_VERSIONS as WEIGHT_VERSIONS
from .errors import BadRequestError, short
from .wire import Millis, omit_none

PauseMode = Literal["keep", "wait", "abort"]  # vLLM's pause modes
UpdateMode = Literal["keep", "wait", "abort", "inflight"]  # "inflight": no pause (engine_core/calls.py)
Method = Literal["delta", "vllm"]  # our scatter | vLLM's load_checkpoint_weight_patches (vllm_path.py)
Operation = Literal["update", "stage"]
# Why the label changed; "rollback": an engine's writes undone because another engine failed (data parallelism)
LabelCause = Literal["keep", "wait", "abort", "inflight", "startup", "pause", "rollback"]
# What recomputed the live checksum; "outside": one of vLLM's own routes wrote the weights (a reset)
VerifyTrigger = Literal["startup", "request", "audit", "outside"]

UPDATE_MODES: tuple[UpdateMode, ...] = get_args(UpdateMode)
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)
METHODS: tuple[Method, ...] = get_args(Method)

# Test hook: with VLLM_DELTA_TEST_FAULTS=1 an update may name a fault that makes one rank fail, to prove
# the rollback across ranks and engines on a real server: "patch@<rank>" right after its in-place writes
# ("commit@<rank>", its name before issue 37, is the same step), "stage@<rank>" while staging (nothing
# written anywhere); "<step>@<rank>" is that rank of every engine, "<step>@<engine>:<rank>" that rank of
# one data-parallel engine only.
FAULTS_ENV = "VLLM_DELTA_TEST_FAULTS"
FaultStep = Literal["stage", "patch"]
_FAULT_ALIASES: dict[str, FaultStep] = {"commit": "patch"}  # old spellings clients may still send


def fault_hits(fault: str | None, step: FaultStep, engine: int, rank: int) -> bool:
    """The test hook's `fault` names this step on this rank of this engine (never without FAULTS_ENV=1)."""
    if fault is None or os.environ.get(FAULTS_ENV) != "1" or "@" not in fault:
        return False
    named, _, where = fault.partition("@")
    return _FAULT_ALIASES.get(named, named) == step and where in (str(rank), f"{engine}:{rank}")


Json = dict[str, Any]
M = TypeVar("M")


def to_wire(message: Any) -> Any:
    """The plain form of a body or message: the HTTP answer's JSON, or what crosses vLLM's msgpack boundary."""
    return wire.encode(message)


def from_wire(cls: type[M], data: Any) -> M:
    """A body or message from its plain form (an HTTP body, a client's JSON, an RPC reply or argument)."""
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
class PrefetchRequest:
    """POST /v1/delta/stage: a prefetch, staged and verified now, patched by a later update (no pause).
    (The route keeps its name; in the code "stage" is the decoding every update does, "prefetch" this.)"""

    version: int | str  # a version number or "latest"
    allow_reanchor: bool = False
    method: Method = "delta"

    @classmethod
    def check_wire(cls, body: Any) -> None:
        _check_body(body, {f.name for f in fields(cls)})


StageRequest = PrefetchRequest  # its name before issue 37, for importers


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


# -- version bounds of generation requests (api_server/gating.py) ----------------------------------
# The oldest policy version a request accepts, on POST /v1/completions and /v1/chat/completions: the
# body field (an OpenAI client sends it through `extra_body`) or the header; both at once must agree.
MIN_VERSION_FIELD = "min_weight_version"
MIN_VERSION_HEADER = "X-Min-Weight-Version"
MIN_VERSION_QUERY = "min_version"  # GET /v1/delta/ready?min_version=N
MAX_VERSION = 10**10 - 1  # records.MAX_VERSION (this layer is below records): no store holds a higher one
_MAX_DIGITS = len(str(MAX_VERSION))


def version_bound(value: Any, where: str) -> int:
    """A version bound from a JSON body: an integer 0..MAX_VERSION (not a bool, a float or a string);
    BadRequestError naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VERSION:
        raise BadRequestError(f"{where} must be an integer from 0 to {MAX_VERSION}, not {short(value)}")
    return value


def version_bound_text(text: str, where: str) -> int:
    """A version bound from a header or a query string: decimal digits (surrounding blanks ignored)."""
    digits = text.strip()
    if not digits.isascii() or not digits.isdigit() or len(digits) > _MAX_DIGITS:
        raise BadRequestError(f"{where} must be an integer from 0 to {MAX_VERSION}, not {short(text)}")
    return version_bound(int(digits), where)


def min_version_of(headers: list[str], body: Any) -> int | None:
    """The bound a generation request names (None: none): every `X-Min-Weight-Version` header value and
    the body's `min_weight_version` (null counts as absent) must be well-formed and agree (else 400)."""
    found: list[tuple[str, int]] = [(MIN_VERSION_HEADER, version_bound_text(h, MIN_VERSION_HEADER)) for h in headers]
    if isinstance(body, dict) and body.get(MIN_VERSION_FIELD) is not None:
        found.append((MIN_VERSION_FIELD, version_bound(body[MIN_VERSION_FIELD], MIN_VERSION_FIELD)))
    if len({v for _, v in found}) > 1:
        raise BadRequestError(f"the version bounds disagree: {', '.join(f'{w} {v}' for w, v in found)}")
    return found[0][1] if found else None


# -- HTTP answers ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PrefetchResult:
    """200 answer of /v1/delta/stage (a prefetch). `target`, `nnz` and `bytes` only when something was staged."""

    version: int | None  # the served version
    staged: list[int]
    target: int | None = omit_none()
    stage_ms: Millis = 0.0
    nnz: int | None = omit_none()
    bytes: int | None = omit_none()
    decoded_per_rank: list[int] | None = omit_none()  # changed elements each rank decoded (engine by engine under DP)


StageResult = PrefetchResult  # its name before issue 37, for importers


@dataclass(frozen=True, kw_only=True)
class InflightAnswer:
    """The `inflight` part of an in-flight update's answer: what the engine core did (PatchedAll
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
    when versions were applied (or undone: a backward update, `undone`): an update to the version already
    served answers without them."""

    version: int
    previous_version: int | None
    pause_ms: Millis
    apply_ms: Millis
    stage_ms: Millis
    nnz: int  # changed elements the applied (or undone) versions record
    bytes: int  # file bytes of the applied (or undone) versions
    applied: list[int]  # in order ([] for a backward update)
    mode: UpdateMode
    method: Method
    undone: list[int] | None = omit_none()  # a backward update: the versions taken back, newest first
    reanchored: bool | None = omit_none()
    prefetched: bool | None = omit_none()
    elements_written: int | None = omit_none()  # summed over ranks
    staged_bytes: int | None = omit_none()  # summed over ranks
    decoded_per_rank: list[int] | None = omit_none()  # changed elements each rank decoded (engine by engine under DP)
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
    leave_marked: bool = False  # delta_leave_marked: a marked served version is left by itself
    last_left: LeftMarked | None = None  # the last time it did


@dataclass(frozen=True, kw_only=True)
class LeftMarked:
    """A follower left a version marked bad by itself (follower.py): from `version` back to `to`."""

    version: int  # the version it served
    to: int  # the version it went back to
    marked: int  # the marked version on `version`'s chain (`version` itself, or one below it)
    reason: str  # the mark's reason
    time: float


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
class Verification:
    """A full recomputation of the live checksum from the parameters (every rank, every element), compared
    with the one the server keeps current at every patch: GET /v1/delta/status?verify=true, the
    background audit (`delta_audit_s`), and start-up. A mismatch means something wrote the weights behind
    the plugin's back."""

    trigger: VerifyTrigger
    time: float  # unix time of the recomputation
    version: int | None  # the served version
    ok: bool  # the recomputed sums equal those kept current (or nothing was known to compare with)
    checksum: str  # recomputed from the live parameters, summed over ranks
    expected: str | None  # the checksum kept current until then (None: none was known)
    mismatched: list[str]  # tensors whose sums differ (the first MISMATCHED_NAMES, sorted)
    ms: Millis  # how long the recomputation took
    # Data parallelism: the checksum recomputed from each engine's copy of the weights (null with one
    # engine). Engines that share their copy (MoE engines split the experts) show the same one. Any
    # engine whose copy differs makes `ok` false and names its tensors in `mismatched`; `checksum` is
    # then the first such engine's.
    engines: list[EngineChecksum] | None = omit_none()


@dataclass(frozen=True)
class EngineChecksum:
    engine: int  # vLLM's data-parallel rank
    checksum: str


MISMATCHED_NAMES = 16


@dataclass(frozen=True, kw_only=True)
class EngineServed:
    """One data-parallel engine core in GET /v1/delta/status `engines`: what its ranks said they serve at
    the last read (start-up, each update, a verification). With several engines they always agree
    unless something went wrong (`engines_disagree` says what)."""

    engine: int  # vLLM's data-parallel rank
    ranks: int  # its worker ranks
    version: int | None
    version_checksum: str | None  # what that version's header records


@dataclass(frozen=True, kw_only=True)
class ServerStatus:
    """200 answer of GET /v1/delta/status, answered by the API process from what it keeps current, with no
    call into the workers (`?verify=true` recomputes the live checksum first). While an update runs it
    says what is served until the update commits, and `update_in_progress` what runs. `follow` is null
    unless the server follows or reports."""

    version: int | None
    store: str
    # The live parameters' checksum, summed over ranks: recomputed at start-up (and by a verification),
    # kept current at every patch by adding the ranks' verified partials (None: not known yet).
    checksum: str | None
    version_checksum: str | None  # what the served version's header records
    staged: list[int]  # the prefetched update's versions
    last_update: AppliedUpdate | None
    tensors_via_vllm_path: list[str]
    coverage: Coverage | None = None
    as_of: float | None = None  # when `checksum` was last established (a recomputation or a patch)
    update_in_progress: InProgress | None = None
    last_failure: Failure | None = None
    follow: FollowStatus | None = None
    verification: Verification | None = None  # the last recomputation (its `ok` stays false until one passes)
    # Data parallelism (`--data-parallel-size N`): every engine core's served version (null with one
    # engine); `engines_disagree` says how they differ when they do (then `version` is the lowest any
    # engine serves, the server is not ready and every update is refused: restart it).
    engines: list[EngineServed] | None = omit_none()
    engines_disagree: str | None = omit_none()


@dataclass(frozen=True, kw_only=True)
class Readiness:
    """GET /v1/delta/ready[?min_version=N]: status 200 when ready, 503 when not, with this body either way.
    Ready: the server serves a version (>= N when given) and, following its store, serves the newest
    version its follower saw (or that version was skipped as bad)."""

    ready: bool
    version: int | None  # the served version
    min_version: int | None = omit_none()
    newest_seen: int | None = omit_none()  # follow mode: the store's newest version at the follower's last poll
    reason: str | None = omit_none()  # why not ready


# -- attribution on vLLM's OpenAI routes (api_server/spans.py; clients: vllm_delta.attribution, which
# names the request flag and the two keys: RETURN_WEIGHT_VERSIONS, WEIGHT_VERSIONS, PREFILL_WEIGHT_VERSIONS)
# Where a prompt position's KV came from outside this engine's own steps (none today: a KV connector
# turns prompt provenance off), its label.
UNKNOWN_LABEL = "unknown"

# vLLM 0.33 refuses new generation requests while paused in mode wait or abort (0.32 queued them): the
# engine core finishes them with RequestError(code="engine_paused", "Generation is paused. Please retry
# after it resumes.", retryable), which the server answers as a RetryableRequestError: HTTP 503
# {"error": {"message", "type": "ServiceUnavailableError", "code": 503}}, or that error as an event of
# a stream. The word "engine_paused" itself stays inside vLLM, so the message tells it.
ENGINE_PAUSED = "engine_paused"
PAUSED_MESSAGE = "generation is paused"


def is_engine_paused(status: Any, body: Any) -> bool:
    """Whether an answer is vLLM's retryable "generation is paused" refusal: `status` is the HTTP status
    (or a streamed error event's `code`), `body` the JSON answer or event."""
    if status != 503 or not isinstance(body, dict):
        return False
    error = body.get("error")
    if not isinstance(error, dict):
        return False
    return ENGINE_PAUSED in str(error.get("code")) or PAUSED_MESSAGE in str(error.get("message", "")).lower()


@dataclass(frozen=True)
class WeightSpan:
    """vLLM's `WeightVersionSpan` as JSON (SGLang's spans have the same fields): tokens [start, end)
    ran on the weights labelled `version` (a store version number as a string, e.g. "7"; "default"
    before any)."""

    version: str
    start: int
    end: int


# -- GET /v1/delta/timeline (also the engine core's reply to rpc.ENGINE_TIMELINE) -------------------
@dataclass(frozen=True, kw_only=True)
class HistoryEntry:
    """One label change in the engine core's history: an update in a pause (or the start-up label), or
    an in-flight patch (the fields from `engine_ms` to `switch`)."""

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
    """The output-token spans of one choice of a response, in vLLM's schema (api_server/spans.py)."""

    index: int
    weight_versions: list[WeightSpan]


@dataclass(frozen=True, kw_only=True)
class PatchSwitch:
    """An update's patch (its in-place writes, the label switched) a response lived through, with its
    requests' switch indices (timeline by id; the timeline's field keeps its name, `commits`)."""

    version: int | None
    label: str
    engine_step: int
    time: float
    switch: dict[str, int]
    engine: int | None = omit_none()  # data parallelism: the engine core the patch ran on


CommitSwitch = PatchSwitch  # its name before issue 37, for importers


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
    commits: list[PatchSwitch] | None = omit_none()
    # Data parallelism: every engine core's own timeline, in engine order (the top level is engine 0's)
    engines: list[Timeline] | None = omit_none()
