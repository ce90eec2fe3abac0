"""The worker side of the worker calls (rpc.py), attached to vLLM's Worker class by the plugin.

Each declared call is served by one function of the rank's replica (`serve`: plain keyword arguments
in, the reply's plain form out, an exception answered as an error reply with its HTTP status, so the
API process can answer 404/409/422 rather than a generic 500).

Every method runs on the worker's main thread, between forward passes; only staging itself is
moved to a background thread (see replica.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import UnsupportedModelError
from ...server_api import FAULTS_ENV
from ...store import VersionRecord
from ..shared import heap, rpc
from ..shared.messages import (
    HeapReport,
    Patched,
    Probed,
    RankSums,
    Released,
    RolledBack,
    StagePoll,
    StageStarted,
    TestPatched,
    WorkerStatus,
)
from ..shared.options import StoreSpec
from .replica import DeltaReplica, replica_of

if TYPE_CHECKING:
    from ...store import DeltaStore

log = logging.getLogger(__name__)

A = TypeVar("A")
R = TypeVar("R")

_stores: dict[tuple[str, str, str, bool], DeltaStore] = {}
_stores_lock = threading.Lock()


def open_store(spec: StoreSpec) -> DeltaStore:
    """One DeltaStore per (uri, options, cache dir) in this process: records are cached inside it."""
    key = (spec.uri, repr(sorted(spec.storage_options.items())), spec.cache_dir, bool(spec.trusted_keys))
    with _stores_lock:
        if key not in _stores:
            _stores[key] = spec.open()
        return _stores[key]


def status(r: DeltaReplica, args: rpc.StatusArgs) -> WorkerStatus:
    """What this rank serves; with `live_sums`, its share of the live per-tensor sums too."""
    return WorkerStatus(
        rank=r.rank,
        version=r.served.version,
        checksum=r.served.checksum,
        probed=r.probed,
        fallback=r.fallback_names,
        tickets=sorted(r.tickets),
        coverage=r.coverage() if r.probed else None,
        live_sums=r.live_sums() if args.live_sums and r.probed else None,
        world_size=r.world_size,
    )


def probe(r: DeltaReplica, args: rpc.ProbeArgs) -> Probed:
    """Probe the layout from the shapes of `version` (collective: every rank runs it together)."""
    if r.probed:
        return Probed(r.fallback_names)
    header = open_store(args.store).open(args.version, fresh=True).header
    fallback = r.probe_layout(header.tensors.shape_map())
    if fallback:
        log.warning("vllm-delta: tensors through vLLM's sparse path: %s", fallback)
    return Probed(sorted(fallback))


def live_sums(r: DeltaReplica, args: rpc.NoArgs) -> RankSums:
    """This rank's share of the live per-tensor sums (the API process adds the ranks up)."""
    if not r.probed:
        raise UnsupportedModelError("the layout has not been probed yet")
    return RankSums(r.served.version, r.live_sums(), r.rank, r.world_size)


def served_sums(r: DeltaReplica, args: rpc.NoArgs) -> RankSums:
    """Per-tensor sums the served version's header records (what staged partials are added to)."""
    return RankSums(r.served.version, dict(r.served.sums), r.rank, r.world_size)


def stage_start(r: DeltaReplica, args: rpc.StageArgs) -> StageStarted:
    """Stage `versions` on a background thread, each file checked against the records the API process
    decided on (or, without records, read afresh); with `undo`, back to the last of them."""
    st = open_store(args.store)
    if args.records is not None:
        recs = [VersionRecord.from_json(text) for text in args.records]
        if [rec.version for rec in recs] != list(args.versions):
            raise ValueError(f"records of versions {[rec.version for rec in recs]} for versions {args.versions}")
        r.stage_start(
            args.ticket,
            args.versions,
            lambda: [st.open(rec.version, record=rec) for rec in recs],
            method=args.method,
            fault=args.fault,
            undo=args.undo,
        )
    else:
        versions = list(args.versions)
        r.stage_start(
            args.ticket,
            versions,
            lambda: [st.open(v, fresh=True) for v in versions],
            method=args.method,
            fault=args.fault,
            undo=args.undo,
        )
    return StageStarted(args.ticket)


def stage_poll(r: DeltaReplica, args: rpc.TicketArgs) -> StagePoll:
    return StagePoll.of(r.poll(args.ticket))


def patch(r: DeltaReplica, args: rpc.PatchArgs) -> Patched:
    return Patched(r.patch(args.ticket, fault=args.fault, method=args.method))


def rollback(r: DeltaReplica, args: rpc.TicketArgs) -> RolledBack:
    return RolledBack(r.rollback(args.ticket))


def release(r: DeltaReplica, args: rpc.TicketArgs) -> Released:
    r.release(args.ticket)
    return Released(args.ticket)


def test_patch(r: DeltaReplica, args: rpc.TestPatchArgs) -> TestPatched:
    """Test hook: flip one live bit on rank 0 of engine `args.engine`, telling nobody (refused without
    VLLM_DELTA_TEST_FAULTS=1)."""
    if os.environ.get(FAULTS_ENV) != "1":
        raise PermissionError(f"{rpc.TEST_PATCH.name} is a test hook, enabled only with {FAULTS_ENV}=1")
    written = r.patch_behind_our_back() if r.rank == 0 and r.engine_index == args.engine else None
    return TestPatched(r.rank, *(written or (None, None)))


def test_heap(r: DeltaReplica, args: rpc.HeapArgs) -> HeapReport:
    """Test hook: trace this worker's allocations; what vllm_delta keeps alive (shared/heap.py)."""
    if os.environ.get(FAULTS_ENV) != "1":
        raise PermissionError(f"{rpc.TEST_HEAP.name} is a test hook, enabled only with {FAULTS_ENV}=1")
    return heap.act(args.action, r.rank)


def engine_index(worker: Any) -> int:
    """vLLM's data-parallel rank of the worker's engine core (`data_parallel_index`: set for dense engines,
    which vLLM runs as independent engines of data-parallel size 1, and for MoE engines alike); 0 without
    data parallelism."""
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", None)
    return index if isinstance(index, int) else 0


def _on_worker(fn: Callable[[DeltaReplica, A], R]) -> Callable[[Any, A], R]:
    """`fn` on the replica of a vLLM worker's model."""

    def on_worker(worker: Any, args: A) -> R:
        replica = replica_of(worker.get_model())
        replica.engine_index = engine_index(worker)
        return fn(replica, args)

    on_worker.__doc__ = fn.__doc__
    return on_worker


# Each declaration with its implementation (mypy checks the argument and reply types of each pair).
WORKER_METHODS: dict[str, Callable[..., Any]] = {
    m.__name__: m
    for m in (
        rpc.serve(rpc.STATUS, _on_worker(status)),
        rpc.serve(rpc.PROBE, _on_worker(probe)),
        rpc.serve(rpc.LIVE_SUMS, _on_worker(live_sums)),
        rpc.serve(rpc.SERVED_SUMS, _on_worker(served_sums)),
        rpc.serve(rpc.STAGE_START, _on_worker(stage_start)),
        rpc.serve(rpc.STAGE_POLL, _on_worker(stage_poll)),
        rpc.serve(rpc.PATCH, _on_worker(patch)),
        rpc.serve(rpc.ROLLBACK, _on_worker(rollback)),
        rpc.serve(rpc.RELEASE, _on_worker(release)),
    )
}
assert set(WORKER_METHODS) == {c.name for c in rpc.WORKER_CALLS}, "every worker call is served"


TEST_METHODS: dict[str, Callable[..., Any]] = {
    m.__name__: m
    for m in (rpc.serve(rpc.TEST_PATCH, _on_worker(test_patch)), rpc.serve(rpc.TEST_HEAP, _on_worker(test_heap)))
}


def install(worker_cls: type) -> None:
    """Attach the methods to vLLM's Worker class (CPUWorker inherits them); the test hooks only with
    VLLM_DELTA_TEST_FAULTS=1. Idempotent."""
    methods = {**WORKER_METHODS, **(TEST_METHODS if os.environ.get(FAULTS_ENV) == "1" else {})}
    for name, fn in methods.items():
        if getattr(worker_cls, name, None) is not fn:
            setattr(worker_cls, name, fn)
