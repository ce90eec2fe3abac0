"""Worker-side RPC methods (`collective_rpc("delta_...")`), attached to vLLM's Worker class by the plugin.

Arguments are plain JSON-like values and results the wire form of a type of messages.py (they
cross the API -> engine core -> worker msgpack boundary). Errors are returned as
{"error": ErrorPayload} with their HTTP status instead of raised, so the API process can answer
404/409/422 rather than a generic 500.

Every method runs on the worker's main thread, between forward passes; only staging itself is
moved to a background thread (see replica.py).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import UnsupportedModelError
from ..store import VersionRecord
from .messages import (
    Committed,
    Json,
    Prepared,
    RankSums,
    Released,
    RolledBack,
    StagePoll,
    StageStarted,
    WorkerStatus,
    error_reply,
)
from .options import StoreSpec
from .replica import DeltaReplica, replica_of

if TYPE_CHECKING:
    from ..store import DeltaStore

log = logging.getLogger(__name__)

_stores: dict[tuple, DeltaStore] = {}
_stores_lock = threading.Lock()


def open_store(spec: dict[str, Any]) -> DeltaStore:
    """One DeltaStore per (uri, options, cache dir) in this process: records are cached inside it."""
    s = StoreSpec.from_dict(spec)
    key = (s.uri, repr(sorted(s.storage_options.items())), s.cache_dir)
    with _stores_lock:
        if key not in _stores:
            _stores[key] = s.open()
        return _stores[key]


def _replica(worker: Any) -> DeltaReplica:
    return replica_of(worker.get_model())


F = TypeVar("F", bound=Callable[..., Json])


def _reports_errors(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Json:
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the API process with its status
            log.warning("vllm-delta: %s failed: %s", fn.__name__, exc)
            return error_reply(exc)

    return wrapper  # type: ignore[return-value]


@_reports_errors
def delta_status(self: Any) -> Json:
    r = _replica(self)
    return WorkerStatus(
        rank=r.rank,
        version=r.served.version,
        checksum=r.served.checksum,
        prepared=r.prepared,
        fallback=r.fallback_names,
        tickets=sorted(r.tickets),
        coverage=r.coverage() if r.prepared else None,
    ).to_wire()


@_reports_errors
def delta_prepare(self: Any, store: dict[str, Any], version: int) -> Json:
    """Probe the layout from the shapes of `version` (collective: every rank runs it together)."""
    r = _replica(self)
    if r.prepared:
        return Prepared(r.fallback_names).to_wire()
    header = open_store(store).open(version, fresh=True).header
    shapes = {n: tuple(e.shape) for n, e in header.tensors.items()}
    fallback = r.prepare(shapes)
    if fallback:
        log.warning("vllm-delta: tensors through vLLM's sparse path: %s", fallback)
    return Prepared(sorted(fallback)).to_wire()


@_reports_errors
def delta_live_sums(self: Any) -> Json:
    """This rank's share of the live per-tensor sums (the API process adds the ranks up)."""
    r = _replica(self)
    if not r.prepared:
        raise UnsupportedModelError("the layout has not been probed yet")
    return RankSums(r.served.version, r.live_sums()).to_wire()


@_reports_errors
def delta_served_sums(self: Any) -> Json:
    """Per-tensor sums the served version's header records (what staged partials are added to)."""
    r = _replica(self)
    return RankSums(r.served.version, dict(r.served.sums)).to_wire()


@_reports_errors
def delta_stage_start(
    self: Any,
    ticket: str,
    store: dict[str, Any],
    versions: list[int],
    method: str = "delta",
    records: list[str] | None = None,
) -> Json:
    """Stage `versions` on a background thread. `records`: their commit records (JSON) as the API process
    read them for this update's decision; each file is opened and checked against them."""
    r = _replica(self)
    st = open_store(store)
    if records is not None:
        recs = [VersionRecord.from_json(text) for text in records]
        if [rec.version for rec in recs] != list(versions):
            raise ValueError(f"records of versions {[rec.version for rec in recs]} for versions {versions}")
        r.stage_start(ticket, versions, lambda: [st.open(rec.version, record=rec) for rec in recs], method=method)
    else:
        r.stage_start(ticket, versions, lambda: [st.open(v, fresh=True) for v in versions], method=method)
    return StageStarted(ticket).to_wire()


@_reports_errors
def delta_stage_poll(self: Any, ticket: str) -> Json:
    return StagePoll(_replica(self).poll(ticket)).to_wire()


@_reports_errors
def delta_commit(self: Any, ticket: str, method: str = "delta", fault: str | None = None) -> Json:
    return Committed(_replica(self).commit(ticket, fault=fault, method=method)).to_wire()


@_reports_errors
def delta_rollback(self: Any, ticket: str) -> Json:
    return RolledBack(_replica(self).rollback(ticket)).to_wire()


@_reports_errors
def delta_release(self: Any, ticket: str) -> Json:
    _replica(self).release(ticket)
    return Released(ticket).to_wire()


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


def install(worker_cls: type) -> None:
    """Attach the methods to vLLM's Worker class (CPUWorker inherits them). Idempotent."""
    for name, fn in WORKER_METHODS.items():
        if getattr(worker_cls, name, None) is not fn:
            setattr(worker_cls, name, fn)
