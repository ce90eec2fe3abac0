"""The typed messages between the API process, the engine core and the workers (rpc.py declares the calls).

What a worker rank answers (`WorkerStatus`, `StageSummary`, ...) and what the engine core answers
(`PatchedAll`, `LabelSet`, the timeline). They cross vLLM's msgpack boundary in their plain form,
through the same two functions as the HTTP bodies (`vllm_delta.server_api.to_wire` / `from_wire`,
over the generic codec of wire.py), so nothing outside the codec reads a payload by key. 64-bit
checksum sums are ints in Python and 16 hex digits on the wire (`HexSums`). A failing rank answers
`ErrorReply` instead (rpc.py tells the two apart). The HTTP bodies and the vocabularies are in
vllm_delta/server_api.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import WorkerError, error_type, http_status
from ...server_api import Coverage, InflightAnswer, WeightSpan
from ...wire import HexSums


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
        return cls(error_type(exc), http_status(exc), str(exc))

    def to_error(self, rank: int | str | None) -> WorkerError:
        """`rank`: the failed rank's number, or who failed in words ("engine 1 rank 0"; rpc.Where)."""
        return WorkerError(self.message, status=self.status, rank=rank, type_name=self.type)

    def describe(self, rank: int | str) -> str:
        who = f"rank {rank}" if isinstance(rank, int) else rank
        return f"{who}: {self.type}: {self.message}"


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
    probed: bool  # the layout has been probed
    fallback: list[str] = field(default_factory=list)  # tensors through vLLM's sparse path
    tickets: list[str] = field(default_factory=list)  # staged updates held
    coverage: Coverage | None = None
    live_sums: HexSums | None = None  # this rank's share of the live per-tensor sums, when asked for
    world_size: int = 1  # the ranks that together hold one copy of the weights (two_phase.worlds)


@dataclass(frozen=True)
class Probed:
    """rpc.PROBE: the tensors the probe sent through vLLM's sparse path."""

    fallback: list[str]


@dataclass(frozen=True)
class RankSums:
    """rpc.LIVE_SUMS (this rank's share of the live per-tensor sums) and rpc.SERVED_SUMS (the sums
    the served version's header records): HF name -> sum mod 2^64."""

    version: int | None  # the served version
    sums: HexSums
    rank: int = 0  # in its world (two_phase.worlds)
    world_size: int = 1


@dataclass(frozen=True)
class StageSummary:
    """A rank's staged update: its checksum partials Σ w(p)(new - old) per tensor (owned elements)."""

    versions: list[int]
    partials: HexSums
    nnz: int  # elements this rank will write
    bytes: int  # staged device bytes
    stage_ms: float
    timings: dict[str, float] = field(default_factory=dict)  # ms per staging phase
    decoded: int = 0  # changed elements this rank decoded (the chunks holding its rows: its share)
    # The rank in its world (the ranks that together hold one copy of the weights: two_phase.worlds).
    rank: int = 0
    world_size: int = 1


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
class Patched:
    """rpc.PATCH: the rank's in-place writes took `apply_ms`."""

    apply_ms: float


@dataclass(frozen=True)
class RolledBack:
    """rpc.ROLLBACK: False when the rank had nothing written to undo."""

    rolled_back: bool


@dataclass(frozen=True)
class TestPatched:
    """rpc.TEST_PATCH (test hook): the element a rank changed behind the plugin's back (None: none)."""

    rank: int
    tensor: str | None
    index: int | None  # flat index in the Hugging Face tensor


@dataclass(frozen=True)
class HeapSite:
    """Where live blocks of ours were allocated (shared/heap.py): the innermost vllm_delta frame."""

    where: str  # vllm_delta/...py:line
    bytes: int
    blocks: int


@dataclass(frozen=True)
class HeapReport:
    """rpc.TEST_HEAP and the API process's share of POST /v1/delta/test/heap (test hooks, heap.py)."""

    rank: int | None  # None: the API process
    bytes: int  # live blocks whose traceback passes through vllm_delta (0 unless tracing)
    blocks: int
    top: list[HeapSite]
    tensor_bytes: int  # distinct torch CPU storages alive in the process


@dataclass(frozen=True)
class HeapAnswer:
    """POST /v1/delta/test/heap (test hook): the API process's report and every worker rank's."""

    api: HeapReport
    workers: list[HeapReport]


@dataclass(frozen=True)
class Released:
    """rpc.RELEASE: the ticket's buffers are dropped."""

    released: str


# -- engine-core replies (engine_core/calls.py: reserved collective_rpc names) ------------------------------
@dataclass(frozen=True, kw_only=True)
class PatchedAll:
    """rpc.PATCH_ALL: every rank wrote in place, in a pause or (mode "inflight") between two engine steps,
    and the label changed. The prefix-cache and request numbers are those of an in-flight update (0 in
    a pause: the API process resets the prefix cache itself)."""

    version: int
    label: str  # vLLM's weight-version label from now on
    previous_label: str
    engine_step: int  # labelled engine steps before the writes: the first step on the new weights is the next
    engine_ms: float  # the engine loop's stall: preflight, writes on every rank, invalidation, label
    apply_ms: float  # the in-place writes, slowest rank
    dropped_blocks: int  # prefix-cache blocks whose hash was dropped
    dropped_blocks_in_use: int  # ... of them still held (and valid) for running requests
    tainted: int  # requests holding KV at the writes: they never insert prefix-cache hashes
    batches_in_flight: int  # batches already dispatched (batch queue): they keep the old label
    switch: dict[str, int]  # generate() request id -> index of its first output token on the new weights
    time: float  # wall clock (time.time()) at the writes

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
class RolledBackAll:
    """rpc.ROLLBACK_ALL: every rank of this engine undid the ticket's writes (another engine failed). If
    this engine's writes had landed, its label is back to the one before them (`relabelled`)."""

    ranks_rolled_back: int  # ranks that had writes to undo
    relabelled: bool
    label: str  # vLLM's weight-version label from now on
    engine_ms: float


@dataclass(frozen=True, kw_only=True)
class LabelSet:
    """rpc.SET_LABEL: the weight-version label set at start-up (or by hand)."""

    label: str
    previous_label: str
    engine_step: int
    time: float


@dataclass(frozen=True)
class PrefixCleared:
    """What dropping the prefix-cache hashes found (engine_core/calls.py: drop_prefix_hashes)."""

    hash_keys: int
    blocks: int
    blocks_in_use: int


@dataclass(frozen=True)
class PrefixState:
    """rpc.PREFIX_STATE: how many blocks carry a prefix hash, which requests are tainted (tests)."""

    hash_keys: int
    hashed_blocks: int
    tainted: list[str]
    async_scheduling: bool
    batch_queue: int | None


@dataclass(frozen=True)
class PromptVersions:
    """rpc.PROMPT_VERSIONS: the prompt spans (which label computed the KV of each prompt position) of
    the requests asked for, by the id the API process knows them by (engine_core/provenance.py)."""

    spans: dict[str, list[WeightSpan]]
