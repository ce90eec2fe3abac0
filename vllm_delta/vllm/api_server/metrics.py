"""Prometheus metrics of the plugin, served on vLLM's own `/metrics` (API process only).

vLLM's `/metrics` exports prometheus_client's default `REGISTRY` (with `PROMETHEUS_MULTIPROC_DIR`,
i.e. several API servers, the multiprocess files: Gauges say `multiprocess_mode`). The metrics are
created once per process, on first use (creating one twice raises in prometheus_client). Names start
with `vllm_delta_`, never `vllm:` (vLLM unregisters every collector named `vllm:*` when its stat
logger starts). Labels carry error class names and status codes only: `/metrics` is not behind
`--api-key`, so no store URI, path or secret goes into a label.

    vllm_delta_served_version                     gauge: the store version the server serves
    vllm_delta_updates_total{outcome}             applied | unchanged (already served) | failed
    vllm_delta_failures_total{operation,type,status}   update | stage; error class; HTTP status
    vllm_delta_update_in_progress                 gauge: 1 while an update or prefetch runs
    vllm_delta_pause_seconds, _apply_seconds, _stage_seconds   histograms (applied updates)
    vllm_delta_update_bytes, _update_changed_elements          histograms (applied updates)
    vllm_delta_cache_bytes                        gauge: the download cache of the server's store
    vllm_delta_live_checksum_verifications_total{trigger,outcome}   recomputations of the live checksum:
                                                  startup | request | audit | outside; ok | mismatch
    vllm_delta_live_checksum_mismatch             gauge: 1 while the last recomputation found a mismatch
    vllm_delta_min_version_requests_total{outcome}   requests with a min_weight_version: ran (at once) |
                                                  held (waited, then ran) | refused (409) | malformed (400)
    vllm_delta_engines_disagree                   gauge: 1 while the data-parallel engines serve different
                                                  versions (as last read)
    vllm_delta_marked_left_total                  the follower left a version marked bad by itself
    vllm_delta_served_marked                      gauge: 1 while the follower sees a mark on the served
                                                  version's chain (until it has left it)

Beside them, every update and prefetch is observed through vLLM's own RL series (vLLM 0.32 and 0.33,
`vllm/entrypoints/rl/online/metrics.py`), so a dashboard built on vLLM's series sees them:

    vllm:rl_weight_update_operation_duration_seconds{operation}   histogram: "update" (an update,
                                                  pushed or followed, any mode: vLLM's label for
                                                  /update_weights, whose meaning it shares) | "stage"
                                                  (a prefetch: no vLLM operation means that)
    vllm:rl_weight_update_operations_in_flight{operation}          gauge

vLLM creates those collectors lazily, after its stat logger started (which unregisters `vllm:*`), and
so does `vllm_operation`: on the first update, never at import.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any, Literal, get_args

log = logging.getLogger(__name__)

GateOutcome = Literal["ran", "held", "refused", "malformed"]  # a request with a min_weight_version
GATE_OUTCOMES: tuple[GateOutcome, ...] = get_args(GateOutcome)
_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_SIZE_BUCKETS = tuple(float(4**k) for k in range(4, 18))  # 256 .. 2^34


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.served_version = Gauge(
            "vllm_delta_served_version", "Store version the server serves", multiprocess_mode="mostrecent"
        )
        self.updates = Counter("vllm_delta_updates", "update_weights calls by outcome", ["outcome"])
        self.failures = Counter(
            "vllm_delta_failures", "Failed updates and prefetches by error type", ["operation", "type", "status"]
        )
        self.in_progress = Gauge(
            "vllm_delta_update_in_progress", "1 while an update or prefetch runs", multiprocess_mode="mostrecent"
        )
        self.pause = Histogram("vllm_delta_pause_seconds", "Pause to resume of applied updates", buckets=_TIME_BUCKETS)
        self.apply = Histogram("vllm_delta_apply_seconds", "In-place writes (slowest rank)", buckets=_TIME_BUCKETS)
        self.stage = Histogram("vllm_delta_stage_seconds", "Staging before the pause", buckets=_TIME_BUCKETS)
        self.bytes = Histogram("vllm_delta_update_bytes", "File bytes of the applied versions", buckets=_SIZE_BUCKETS)
        self.elements = Histogram(
            "vllm_delta_update_changed_elements", "Changed elements the applied versions record", buckets=_SIZE_BUCKETS
        )
        self.cache_bytes = Gauge(
            "vllm_delta_cache_bytes",
            "Bytes in the download cache of the server's store",
            multiprocess_mode="mostrecent",
        )
        self.verifications = Counter(
            "vllm_delta_live_checksum_verifications",
            "Recomputations of the live checksum by trigger and outcome",
            ["trigger", "outcome"],
        )
        self.mismatch = Gauge(
            "vllm_delta_live_checksum_mismatch",
            "1 while the last recomputation of the live checksum found a mismatch",
            multiprocess_mode="mostrecent",
        )
        self.gated = Counter(
            "vllm_delta_min_version_requests", "Generation requests with a min_weight_version by outcome", ["outcome"]
        )
        self.engines_disagree = Gauge(
            "vllm_delta_engines_disagree",
            "1 while the data-parallel engines of this server serve different versions",
            multiprocess_mode="mostrecent",
        )
        self.marked_left = Counter("vllm_delta_marked_left", "Versions marked bad that the follower left by itself")
        self.served_marked = Gauge(
            "vllm_delta_served_marked",
            "1 while a mark lies on the served version's chain (the follower leaves it)",
            multiprocess_mode="mostrecent",
        )
        for outcome in ("applied", "unchanged", "failed"):
            self.updates.labels(outcome=outcome)  # exported at 0 from the start
        for outcome in GATE_OUTCOMES:
            self.gated.labels(outcome=outcome)

    def applied(self, result: Any) -> None:
        self.updates.labels(outcome="applied").inc()
        self.served_version.set(result.version)
        self.pause.observe(result.pause_ms / 1e3)
        self.apply.observe(result.apply_ms / 1e3)
        self.stage.observe(result.stage_ms / 1e3)
        self.bytes.observe(result.bytes)
        self.elements.observe(result.nnz)

    def gate(self, outcome: GateOutcome) -> None:
        self.gated.labels(outcome=outcome).inc()

    def verified(self, verification: Any) -> None:
        outcome = "ok" if verification.ok else "mismatch"
        self.verifications.labels(trigger=verification.trigger, outcome=outcome).inc()
        self.mismatch.set(0 if verification.ok else 1)

    def failed(self, operation: str, type_name: str, status: int) -> None:
        if operation == "update":
            self.updates.labels(outcome="failed").inc()
        self.failures.labels(operation=operation, type=type_name, status=str(status)).inc()


_metrics: Metrics | None = None
_unavailable = False
_lock = threading.Lock()


def metrics() -> Metrics | None:
    """The process's metrics, created on first call; None without prometheus_client (never raises)."""
    global _metrics, _unavailable
    with _lock:
        if _metrics is None and not _unavailable:
            try:
                _metrics = Metrics()
            except Exception as exc:  # noqa: BLE001 - metrics must never break an update
                _unavailable = True
                log.warning("vllm-delta: no Prometheus metrics: %s", exc)
        return _metrics


# Our operation -> the `operation` label of vLLM's RL series (the same word where the meaning is vLLM's).
VLLM_OPERATIONS = {"update": "update", "stage": "stage"}
_vllm_unavailable = False


@contextlib.contextmanager
def vllm_operation(operation: str) -> Iterator[None]:
    """Observe one update or prefetch through vLLM's `vllm:rl_weight_update_*` series (its own
    collectors, created on first use as vLLM does); without them (an older vLLM) nothing is observed.
    Never raises for the metrics."""
    global _vllm_unavailable
    record: Any = None
    if not _vllm_unavailable:
        try:
            from vllm.entrypoints.rl.online.metrics import weight_operation_metrics

            record = weight_operation_metrics().record(VLLM_OPERATIONS.get(operation, operation))
        except Exception as exc:  # noqa: BLE001 - metrics must never break an update
            _vllm_unavailable = True
            log.warning("vllm-delta: vLLM's vllm:rl_weight_update_* series are unavailable: %s", exc)
    if record is None:
        yield
        return
    with record:
        yield
