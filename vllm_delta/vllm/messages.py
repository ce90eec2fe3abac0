"""The typed boundary between the API process and the workers, and the HTTP bodies.

Two kinds of values live here:

* HTTP: the requests (`StageRequest`, `UpdateRequest`, parsed and checked by `from_body`) and the
  answers (`StageResult`, `UpdateResult`, `ServerStatus`, `to_json`).
* RPC: what a worker rank returns to `collective_rpc("delta_...")` (worker.py). Results cross
  vLLM's msgpack boundary (API process -> engine core -> workers), which carries plain values only
  (anything else needs VLLM_ALLOW_INSECURE_SERIALIZATION, vllm/v1/serial_utils.py), so each type
  has a plain wire form: `to_wire` on the worker, `from_wire` in the API process. 64-bit checksum
  sums are ints in Python and 16 hex digits on the wire. A failing rank answers
  `{"error": ErrorPayload}` instead (`error_reply`, `reply_error`).

Nothing outside this module reads a payload by key.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checksums import to_hex
from ..errors import BadRequestError, WorkerError, http_status, short

MODES = ("keep", "wait", "abort")  # vLLM's pause modes
INFLIGHT = "inflight"  # no pause: the commit runs between two engine steps (enginecore.py)
UPDATE_MODES = (*MODES, INFLIGHT)
METHODS = ("delta", "vllm")  # our scatter | vLLM's load_checkpoint_weight_patches (vllm_path.py)

# Test hook: with VLLM_DELTA_TEST_FAULTS=1 an update may name a fault ("commit@<rank>") that makes
# that rank fail right after its writes, to prove the cross-rank rollback on a real server.
FAULTS_ENV = "VLLM_DELTA_TEST_FAULTS"

Json = dict[str, Any]


def _hex_sums(sums: Mapping[str, int]) -> dict[str, str]:
    return {name: to_hex(value) for name, value in sums.items()}


def _int_sums(sums: Mapping[str, str]) -> dict[str, int]:
    return {name: int(value, 16) for name, value in sums.items()}


# -- HTTP requests ---------------------------------------------------------------------------------
def _check_body(body: Any, *, update: bool) -> Mapping[str, Any]:
    """The request's fields, checked in a fixed order (the first problem is the 400's message)."""
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    known = {"version", "allow_reanchor", "method"} | ({"mode", "fault"} if update else set())
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
    return body


@dataclass(frozen=True)
class StageRequest:
    """POST /v1/delta/stage: stage now, apply later (no pause)."""

    version: int | str  # a version number or "latest"
    allow_reanchor: bool = False
    method: str = "delta"

    @classmethod
    def from_body(cls, body: Any) -> StageRequest:
        """Parse a JSON body; BadRequestError (400) names the first problem."""
        b = _check_body(body, update=False)
        return cls(b["version"], b.get("allow_reanchor", False), b.get("method", "delta"))


@dataclass(frozen=True)
class UpdateRequest:
    """POST /v1/delta/update_weights."""

    version: int | str  # a version number or "latest"
    allow_reanchor: bool = False
    mode: str = "keep"
    method: str = "delta"
    fault: str | None = None  # test hook (FAULTS_ENV)

    @classmethod
    def from_body(cls, body: Any) -> UpdateRequest:
        """Parse a JSON body; BadRequestError (400) names the first problem."""
        b = _check_body(body, update=True)
        return cls(
            b["version"],
            b.get("allow_reanchor", False),
            b.get("mode", "keep"),
            b.get("method", "delta"),
            b.get("fault"),
        )


# -- HTTP answers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageResult:
    """200 answer of /v1/delta/stage. `target`, `nnz` and `bytes` only when something was staged."""

    version: int | None  # the served version
    staged: list[int]
    stage_ms: float = 0.0
    target: int | None = None
    nnz: int | None = None
    bytes: int | None = None

    def to_json(self) -> Json:
        if not self.staged:
            return {"version": self.version, "staged": [], "stage_ms": round(self.stage_ms, 3)}
        return {
            "version": self.version,
            "staged": list(self.staged),
            "target": self.target,
            "stage_ms": round(self.stage_ms, 3),
            "nnz": self.nnz,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class UpdateResult:
    """200 answer of /v1/delta/update_weights (docs/VLLM.md). The fields after `method` are present only
    when versions were applied: an update to the version already served answers without them."""

    version: int
    previous_version: int | None
    pause_ms: float
    apply_ms: float
    stage_ms: float
    nnz: int  # changed elements the applied versions record
    bytes: int  # file bytes of the applied versions
    applied: list[int]
    mode: str
    method: str
    reanchored: bool | None = None
    prefetched: bool | None = None
    elements_written: int | None = None  # summed over ranks
    staged_bytes: int | None = None  # summed over ranks
    timings: dict[str, float] | None = None  # staging stages of rank 0, ms
    inflight: InflightCommitted | None = None  # mode "inflight": what the engine core did

    def to_json(self) -> Json:
        out: Json = {
            "version": self.version,
            "previous_version": self.previous_version,
            "pause_ms": round(self.pause_ms, 3),
            "apply_ms": round(self.apply_ms, 3),
            "stage_ms": round(self.stage_ms, 3),
            "nnz": self.nnz,
            "bytes": self.bytes,
            "applied": list(self.applied),
            "mode": self.mode,
            "method": self.method,
        }
        extra = {
            "reanchored": self.reanchored,
            "prefetched": self.prefetched,
            "elements_written": self.elements_written,
            "staged_bytes": self.staged_bytes,
            "timings": None if self.timings is None else dict(self.timings),
            "inflight": None if self.inflight is None else self.inflight.to_json(),
        }
        out.update((k, v) for k, v in extra.items() if v is not None)
        return out


@dataclass(frozen=True)
class InProgress:
    """An update or prefetch running now (GET /v1/delta/status answers without waiting for it)."""

    operation: str  # "update" | "stage"
    version: int | str  # as requested: a number or "latest"
    since: float  # unix time it started

    def to_json(self) -> Json:
        return {
            "operation": self.operation,
            "version": self.version,
            "since": self.since,
            "seconds": round(max(0.0, time.time() - self.since), 3),
        }


@dataclass(frozen=True)
class Failure:
    """The last update or prefetch that failed (what it answered)."""

    operation: str
    version: int | str
    type: str
    status: int
    message: str
    time: float

    def to_json(self) -> Json:
        return {
            "operation": self.operation,
            "version": self.version,
            "type": self.type,
            "status": self.status,
            "message": self.message,
            "time": self.time,
        }


@dataclass(frozen=True)
class FollowStatus:
    """The `follow` part of GET /v1/delta/status: where a following (or reporting) server stands.

    `from_json` is for clients (the example, tests): they read the answer through this type."""

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
    last_pause_ms: float | None
    reporting: bool  # writing this replica's report to the store's ledger
    replica_id: str | None
    poll_s: float
    mode: str

    def to_json(self) -> Json:
        return {
            "following": self.following,
            "store": self.store,
            "served": self.served,
            "newest_seen": self.newest_seen,
            "lag": self.lag,
            "last_error": self.last_error,
            "last_error_version": self.last_error_version,
            "last_error_time": self.last_error_time,
            "skipped": {str(v): why for v, why in sorted(self.skipped.items())},
            "polls": self.polls,
            "updates": self.updates,
            "last_pause_ms": None if self.last_pause_ms is None else round(self.last_pause_ms, 3),
            "reporting": self.reporting,
            "replica_id": self.replica_id,
            "poll_s": self.poll_s,
            "mode": self.mode,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> FollowStatus:
        return cls(
            following=bool(doc["following"]),
            store=str(doc["store"]),
            served=doc["served"],
            newest_seen=doc["newest_seen"],
            lag=doc["lag"],
            last_error=doc["last_error"],
            last_error_version=doc["last_error_version"],
            last_error_time=doc["last_error_time"],
            skipped={int(v): str(why) for v, why in doc["skipped"].items()},
            polls=int(doc["polls"]),
            updates=int(doc["updates"]),
            last_pause_ms=doc["last_pause_ms"],
            reporting=bool(doc["reporting"]),
            replica_id=doc["replica_id"],
            poll_s=float(doc["poll_s"]),
            mode=str(doc["mode"]),
        )


@dataclass(frozen=True)
class ServerStatus:
    """200 answer of GET /v1/delta/status. While an update runs, the answer is the state known before it
    (`as_of`: when that was read from the workers) and `update_in_progress` says what runs. `follow` is
    null unless the server follows or reports."""

    version: int | None
    store: str
    checksum: str | None  # of the live parameters, summed over ranks (None: not known yet)
    version_checksum: str | None  # what the served version's header records
    staged: list[int]  # the prefetched update's versions
    last_update: UpdateResult | None
    last_update_time: float | None
    tensors_via_vllm_path: list[str]
    coverage: Json | None = None  # in place / vLLM's sparse path / recomputed (DeltaReplica.coverage)
    as_of: float | None = None
    update_in_progress: InProgress | None = None
    last_failure: Failure | None = None
    follow: FollowStatus | None = None

    def to_json(self) -> Json:
        last = None
        if self.last_update is not None:
            last = {**self.last_update.to_json(), "time": self.last_update_time}
        return {
            "version": self.version,
            "store": self.store,
            "checksum": self.checksum,
            "version_checksum": self.version_checksum,
            "staged": list(self.staged),
            "last_update": last,
            "tensors_via_vllm_path": list(self.tensors_via_vllm_path),
            "coverage": self.coverage,
            "as_of": self.as_of,
            "update_in_progress": None if self.update_in_progress is None else self.update_in_progress.to_json(),
            "last_failure": None if self.last_failure is None else self.last_failure.to_json(),
            "follow": None if self.follow is None else self.follow.to_json(),
        }


# -- RPC replies of one worker rank ----------------------------------------------------------------
@dataclass(frozen=True)
class ErrorPayload:
    """An exception raised in a worker, carried across the RPC boundary with its HTTP status."""

    type: str
    status: int
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorPayload:
        return cls(type(exc).__name__, http_status(exc), str(exc))

    def to_wire(self) -> Json:
        return {"type": self.type, "status": self.status, "message": self.message}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> ErrorPayload:
        return cls(str(data.get("type", "Error")), int(data.get("status", 500)), str(data.get("message", "")))

    def to_error(self, rank: int | None) -> WorkerError:
        return WorkerError(self.message, status=self.status, rank=rank, type_name=self.type)


def error_reply(exc: BaseException) -> Json:
    """What a worker method returns instead of raising."""
    return {"error": ErrorPayload.from_exception(exc).to_wire()}


def reply_error(reply: Any) -> ErrorPayload | None:
    """The error a rank's reply carries, or None for a result."""
    if isinstance(reply, dict) and "error" in reply:
        return ErrorPayload.from_wire(reply["error"])
    return None


@dataclass(frozen=True)
class WorkerStatus:
    """delta_status: what one rank serves."""

    rank: int
    version: int | None
    checksum: str | None  # whole-model checksum the served version's header records
    prepared: bool  # the layout has been probed
    fallback: list[str] = field(default_factory=list)  # tensors through vLLM's sparse path
    tickets: list[str] = field(default_factory=list)  # staged updates held
    # The coverage report (DeltaReplica.coverage), passed through to /v1/delta/status as is.
    coverage: Json | None = None

    def to_wire(self) -> Json:
        return {
            "rank": self.rank,
            "version": self.version,
            "checksum": self.checksum,
            "prepared": self.prepared,
            "fallback": list(self.fallback),
            "tickets": list(self.tickets),
            "coverage": self.coverage,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> WorkerStatus:
        return cls(
            data["rank"],
            data["version"],
            data["checksum"],
            data["prepared"],
            list(data["fallback"]),
            list(data["tickets"]),
            data.get("coverage"),
        )


@dataclass(frozen=True)
class Prepared:
    """delta_prepare: the tensors the probe sent through vLLM's sparse path."""

    fallback: list[str]

    def to_wire(self) -> Json:
        return {"fallback": list(self.fallback)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Prepared:
        return cls(list(data["fallback"]))


@dataclass(frozen=True)
class RankSums:
    """delta_live_sums (this rank's share of the live per-tensor sums) and delta_served_sums (the sums
    the served version's header records): HF name -> sum mod 2^64."""

    version: int | None  # the served version
    sums: dict[str, int]

    def to_wire(self) -> Json:
        return {"version": self.version, "sums": _hex_sums(self.sums)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RankSums:
        return cls(data.get("version"), _int_sums(data["sums"]))


@dataclass(frozen=True)
class StageSummary:
    """A rank's staged update: its checksum partials Σ w(p)(new - old) per tensor (owned elements)."""

    versions: list[int]
    partials: dict[str, int]
    nnz: int  # elements this rank will write
    bytes: int  # staged device bytes
    stage_ms: float
    timings: dict[str, float] = field(default_factory=dict)  # ms per staging phase

    def to_wire(self) -> Json:
        return {
            "versions": list(self.versions),
            "partials": _hex_sums(self.partials),
            "nnz": self.nnz,
            "bytes": self.bytes,
            "stage_ms": self.stage_ms,
            "timings": dict(self.timings),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StageSummary:
        return cls(
            list(data["versions"]),
            _int_sums(data["partials"]),
            data["nnz"],
            data["bytes"],
            data["stage_ms"],
            dict(data.get("timings") or {}),
        )


@dataclass(frozen=True)
class StageStarted:
    """delta_stage_start: staging runs on the worker's background thread."""

    started: str  # the ticket

    def to_wire(self) -> Json:
        return {"started": self.started}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StageStarted:
        return cls(data["started"])


@dataclass(frozen=True)
class StagePoll:
    """delta_stage_poll: the summary once staging is done."""

    summary: StageSummary | None

    @property
    def done(self) -> bool:
        return self.summary is not None

    def to_wire(self) -> Json:
        return {"done": self.done, "summary": None if self.summary is None else self.summary.to_wire()}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StagePoll:
        return cls(StageSummary.from_wire(data["summary"]) if data["done"] else None)


@dataclass(frozen=True)
class Committed:
    """delta_commit: the rank's in-place writes took `apply_ms`."""

    apply_ms: float

    def to_wire(self) -> Json:
        return {"apply_ms": self.apply_ms}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Committed:
        return cls(data["apply_ms"])


@dataclass(frozen=True)
class RolledBack:
    """delta_rollback: False when the rank had nothing committed to undo."""

    rolled_back: bool

    def to_wire(self) -> Json:
        return {"rolled_back": self.rolled_back}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RolledBack:
        return cls(data["rolled_back"])


@dataclass(frozen=True)
class Released:
    """delta_release: the ticket's buffers are dropped."""

    released: str

    def to_wire(self) -> Json:
        return {"released": self.released}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Released:
        return cls(data["released"])


# -- engine-core replies (enginecore.py: reserved collective_rpc names) ----------------------------
@dataclass(frozen=True)
class InflightCommitted:
    """delta_inflight_commit: every rank committed between two engine steps."""

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

    def to_wire(self) -> Json:
        return {
            "version": self.version,
            "label": self.label,
            "previous_label": self.previous_label,
            "engine_step": self.engine_step,
            "engine_ms": self.engine_ms,
            "apply_ms": self.apply_ms,
            "dropped_blocks": self.dropped_blocks,
            "dropped_blocks_in_use": self.dropped_blocks_in_use,
            "tainted": self.tainted,
            "batches_in_flight": self.batches_in_flight,
            "switch": dict(self.switch),
            "time": self.time,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> InflightCommitted:
        return cls(
            data["version"],
            data["label"],
            data["previous_label"],
            data["engine_step"],
            data["engine_ms"],
            data["apply_ms"],
            data["dropped_blocks"],
            data["dropped_blocks_in_use"],
            data["tainted"],
            data["batches_in_flight"],
            dict(data["switch"]),
            data["time"],
        )

    def to_json(self) -> Json:
        """In the HTTP answer of update_weights (the per-request switch indices are in the timeline)."""
        out = self.to_wire()
        del out["switch"], out["time"], out["version"]
        out["engine_ms"] = round(self.engine_ms, 3)
        out["apply_ms"] = round(self.apply_ms, 3)
        out["requests_running"] = len(self.switch)
        return out


@dataclass(frozen=True)
class LabelSet:
    """delta_set_label: the weight-version label after an update inside a pause (or at start-up)."""

    label: str
    previous_label: str
    engine_step: int
    time: float

    def to_wire(self) -> Json:
        return {
            "label": self.label,
            "previous_label": self.previous_label,
            "engine_step": self.engine_step,
            "time": self.time,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> LabelSet:
        return cls(data["label"], data["previous_label"], data["engine_step"], data["time"])
