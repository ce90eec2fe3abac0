"""Worker-side RPC methods (`collective_rpc("delta_...")`), attached to vLLM's Worker class by the plugin.

Arguments and results are plain JSON-like values (they cross the API -> engine core -> worker
msgpack boundary). Errors are returned as {"error": {...}} with their HTTP status instead of
raised, so the API process can answer 404/409/422 rather than a generic 500.

Every method runs on the worker's main thread, between forward passes; only staging itself is
moved to a background thread (see replica.py).
"""

from __future__ import annotations

import functools
import logging
import threading

from ..errors import UnsupportedModelError
from .options import StoreSpec
from .replica import DeltaReplica, error_payload

log = logging.getLogger(__name__)

REPLICA_ATTR = "_vllm_delta_replica"
_stores: dict[tuple, object] = {}
_stores_lock = threading.Lock()


def open_store(spec: dict):
    """One DeltaStore per (uri, options, cache dir) in this process: records are cached inside it."""
    s = StoreSpec.from_dict(spec)
    key = (s.uri, repr(sorted(s.storage_options.items())), s.cache_dir)
    with _stores_lock:
        if key not in _stores:
            _stores[key] = s.open()
        return _stores[key]


def replica_of(worker) -> DeltaReplica:
    """The worker's replica, created on first use for servers not started with --load-format delta."""
    model = worker.get_model()
    replica = getattr(model, REPLICA_ATTR, None)
    if replica is None:
        replica = DeltaReplica(model)
        setattr(model, REPLICA_ATTR, replica)
    return replica


def _reports_errors(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the API process with its status
            log.warning("vllm-delta: %s failed: %s", fn.__name__, exc)
            return {"error": error_payload(exc)}

    return wrapper


@_reports_errors
def delta_status(self) -> dict:
    r = replica_of(self)
    return {
        "rank": r.rank,
        "version": r.served.version,
        "checksum": r.served.checksum,
        "prepared": r.prepared,
        "fallback": sorted(r.fallback.reasons) if r.fallback else [],
        "tickets": sorted(r.tickets),
        "coverage": r.coverage() if r.prepared else None,
    }


@_reports_errors
def delta_prepare(self, store: dict, version: int) -> dict:
    """Probe the layout from the shapes of `version` (collective: every rank runs it together)."""
    r = replica_of(self)
    if r.prepared:
        return {"fallback": sorted(r.fallback.reasons) if r.fallback else []}
    header = open_store(store).open(version).header
    shapes = {n: tuple(e.shape) for n, e in header.tensors.items()}
    fallback = r.prepare(shapes)
    if fallback:
        log.warning("vllm-delta: tensors through vLLM's sparse path: %s", fallback)
    return {"fallback": sorted(fallback)}


@_reports_errors
def delta_live_sums(self) -> dict:
    """This rank's share of the live per-tensor sums, as hex (the API process adds the ranks up)."""
    r = replica_of(self)
    if not r.prepared:
        raise UnsupportedModelError("the layout has not been probed yet")
    return {"sums": {n: f"{s:016x}" for n, s in r.live_sums().items()}}


@_reports_errors
def delta_served_sums(self) -> dict:
    """Per-tensor sums the served version's header records (what staged partials are added to)."""
    r = replica_of(self)
    return {"version": r.served.version, "sums": {n: f"{s:016x}" for n, s in r.served.sums.items()}}


@_reports_errors
def delta_stage_start(self, ticket: str, store: dict, versions: list[int], method: str = "delta") -> dict:
    r = replica_of(self)
    st = open_store(store)
    r.stage_start(ticket, versions, lambda: [st.open(v) for v in versions], method=method)
    return {"started": ticket}


@_reports_errors
def delta_stage_poll(self, ticket: str) -> dict:
    summary = replica_of(self).poll(ticket)
    return {"done": summary is not None, "summary": summary}


@_reports_errors
def delta_commit(self, ticket: str, method: str = "delta", fault: str | None = None) -> dict:
    r = replica_of(self)
    if method == "delta":
        return {"apply_ms": r.commit(ticket, fault=fault)}
    if method == "vllm":
        from .vllm_path import commit_through_vllm

        return {"apply_ms": commit_through_vllm(r, ticket)}
    raise ValueError(f"unknown apply method {method!r}")


@_reports_errors
def delta_rollback(self, ticket: str) -> dict:
    return {"rolled_back": replica_of(self).rollback(ticket)}


@_reports_errors
def delta_release(self, ticket: str) -> dict:
    replica_of(self).release(ticket)
    return {"released": ticket}


WORKER_METHODS = {
    f.__name__: f
    for f in (
        delta_status,
        delta_prepare,
        delta_live_sums,
        delta_served_sums,
        delta_stage_start,
        delta_stage_poll,
        delta_commit,
        delta_rollback,
        delta_release,
    )
}


def install(worker_cls) -> None:
    """Attach the methods to vLLM's Worker class (CPUWorker inherits them). Idempotent."""
    for name, fn in WORKER_METHODS.items():
        if getattr(worker_cls, name, None) is not fn:
            setattr(worker_cls, name, fn)
