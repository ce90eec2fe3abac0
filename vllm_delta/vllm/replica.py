"""What one vLLM worker holds for delta updates: the probed layout, the apply engine, staged updates.

The API process drives every rank through the same steps (collective_rpc, see worker.py):

    prepare   probe + validate the layout once (main thread: it swaps torch.Tensor.copy_)
    stage     open and decode versions, gather the rollback buffer, compute checksum partials;
              runs on a background thread so the worker keeps generating meanwhile
    commit    inside the pause: write in place (the engine restores this rank itself on failure)
    rollback  undo a committed update (another rank failed)
    release   drop a staged update's buffers

The served version lives here too, per rank, so that every rank can say what it holds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..apply.engine import ApplyEngine, StagedUpdate
from ..checksums import MASK64, combine, to_hex
from ..errors import DeltaError, UnsupportedModelError
from ..format import VersionHeader, VersionLike
from . import dist
from .fallback import FallbackApplier, FallbackStage
from .probe import ProbeResult, finalize_layout, local_boxes, probe_layout, validate_layout

log = logging.getLogger(__name__)

# Test hook: with VLLM_DELTA_TEST_FAULTS=1 a request may name a fault ("commit@<rank>") that makes
# that rank fail right after its writes, to prove the cross-rank rollback on a real server.
FAULTS_ENV = "VLLM_DELTA_TEST_FAULTS"


class InjectedFault(RuntimeError):
    pass


@dataclass
class Served:
    version: int | None = None
    checksum: str | None = None  # whole-model checksum the version's header records
    sums: dict[str, int] = field(default_factory=dict)  # per-tensor sums the header records

    @classmethod
    def from_header(cls, header: VersionHeader) -> Served:
        return cls(header.version, header.checksum, {n: int(e.checksum, 16) for n, e in header.tensors.items()})


@dataclass
class Ticket:
    versions: list[int]
    thread: threading.Thread | None = None
    staged: StagedUpdate | None = None
    fallback: FallbackStage | None = None
    error: BaseException | None = None
    stage_ms: float = 0.0
    previous: Served | None = None  # what was served before this ticket's commit
    method: str = "delta"  # "vllm": commit through vLLM's sparse path instead (vllm_path.py)
    vllm_patches: list | None = None


class DeltaReplica:
    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None):
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.rank, self.world_size = dist.rank_and_size()
        self.probe: ProbeResult | None = None
        self.engine: ApplyEngine | None = None
        self.fallback: FallbackApplier | None = None
        self.served = Served()
        self.tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()

    # -- the layout (collective) ----------------------------------------------------------------
    @property
    def prepared(self) -> bool:
        return self.engine is not None

    def prepare(
        self, hf_shapes: dict[str, tuple[int, ...]], *, validate: bool = True, force_fallback=()
    ) -> dict[str, str]:
        """Probe, validate and combine the layout over all ranks. Every rank must call it. Returns fallbacks."""
        t0 = time.perf_counter()
        result = probe_layout(self.model, hf_shapes)
        for name in force_fallback:
            if name in hf_shapes:
                result.fallback.setdefault(name, "forced by delta_fallback")
        if validate:
            result = validate_layout(self.model, result)
        gathered = dist.all_gather_object((local_boxes(result.layout), sorted(result.fallback)))
        result = finalize_layout(result, self.rank, gathered)
        self.probe = result
        self.engine = ApplyEngine(result.targets, result.layout, device=self.device)
        self.fallback = FallbackApplier(self.model, result.fallback, counts=self.rank == 0)
        log.info(
            "vllm-delta: layout of %d tensors over %d parameters (%d through vLLM's sparse path) in %.0f ms",
            len(hf_shapes),
            len(result.targets),
            len(result.fallback),
            (time.perf_counter() - t0) * 1e3,
        )
        return dict(result.fallback)

    def _require(self) -> ApplyEngine:
        if self.engine is None:
            raise UnsupportedModelError("the layout has not been probed on this worker yet")
        return self.engine

    # -- checksums ------------------------------------------------------------------------------
    def live_sums(self) -> dict[str, int]:
        """Per HF tensor: this rank's share of the live positional sum (owned elements only)."""
        sums = self._require().live_sums()
        assert self.fallback is not None
        sums.update(self.fallback.live_sums())
        return sums

    def live_checksum_all_ranks(self) -> str:
        """The whole-model live checksum, summed over every rank (collective)."""
        parts = dist.all_gather_object(self.live_sums())
        return to_hex(combine((name, s) for p in parts for name, s in p.items()))

    # -- staging --------------------------------------------------------------------------------
    def stage(self, ticket: str, files: list[VersionLike]) -> dict:
        """Stage synchronously (the loader, the native backend). Returns the summary."""
        self.tickets[ticket] = t = Ticket([vf.version for vf in files])
        self._stage_into(t, lambda: files)
        if t.error is not None:
            self.tickets.pop(ticket, None)
            raise t.error
        return self.summary(ticket)

    def stage_start(
        self, ticket: str, versions: list[int], open_files: Callable[[], list[VersionLike]], method: str = "delta"
    ) -> None:
        """Stage on a background thread: generation continues between the worker's RPCs meanwhile."""
        self._require()
        if ticket in self.tickets:
            raise ValueError(f"ticket {ticket} is already staged")
        if method not in ("delta", "vllm"):
            raise ValueError(f"unknown apply method {method!r}")
        t = Ticket(list(versions), method=method)
        t.thread = threading.Thread(target=self._stage_into, args=(t, open_files), name=f"vllm-delta-stage-{ticket}")
        self.tickets[ticket] = t
        t.thread.start()

    def _stage_into(self, t: Ticket, open_files: Callable[[], list[VersionLike]]) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._require()
            files = open_files()
            t.staged = engine.stage(files)  # on the engine's own side stream
            assert self.fallback is not None
            t.fallback = self.fallback.stage(files)
            if t.method == "vllm":
                from .vllm_path import checkpoint_patches

                t.vllm_patches = checkpoint_patches(self, t)
        except BaseException as exc:  # noqa: BLE001 - reported to the API process by poll
            t.error = exc
        t.stage_ms = (time.perf_counter() - t0) * 1e3

    def poll(self, ticket: str) -> dict | None:
        """None while staging runs; the summary when done; raises the staging error (and drops the ticket)."""
        t = self._ticket(ticket)
        if t.thread is not None and t.thread.is_alive():
            return None
        if t.error is not None:
            self.tickets.pop(ticket, None)
            raise t.error
        return self.summary(ticket)

    def summary(self, ticket: str) -> dict:
        t = self._ticket(ticket)
        assert t.staged is not None and t.fallback is not None
        partials = dict(t.staged.partials)
        for name, p in t.fallback.partials.items():
            partials[name] = (partials.get(name, 0) + p) & MASK64
        return {
            "versions": t.versions,
            "partials": {n: to_hex(p) for n, p in partials.items()},
            "nnz": t.staged.nnz + t.fallback.nnz,
            "bytes": t.staged.bytes,
            "stage_ms": t.stage_ms,
            "timings": dict(t.staged.timings),
        }

    # -- the pause ------------------------------------------------------------------------------
    def commit(self, ticket: str, fault: str | None = None) -> float:
        """Write a staged update in place. On failure this rank is restored before the error propagates."""
        t = self._ticket(ticket)
        if t.staged is None:
            raise ValueError(f"ticket {ticket} is not staged")
        engine = self._require()
        assert self.fallback is not None and t.fallback is not None
        t0 = time.perf_counter()
        engine.commit(t.staged)
        try:
            self.fallback.commit(t.fallback)
            if fault == f"commit@{self.rank}" and os.environ.get(FAULTS_ENV) == "1":
                raise InjectedFault(f"injected fault after the writes on rank {self.rank}")
        except BaseException:
            self.fallback.rollback(t.fallback)
            engine.rollback(t.staged)
            raise
        t.previous, self.served = self.served, Served.from_header(t.staged.header)
        return (time.perf_counter() - t0) * 1e3

    def rollback(self, ticket: str) -> bool:
        """Undo a committed ticket (another rank failed). False if there was nothing to undo."""
        t = self.tickets.get(ticket)
        if t is None or t.staged is None or not t.staged.committed:
            return False
        assert self.fallback is not None and t.fallback is not None
        self.fallback.rollback(t.fallback)
        self._require().rollback(t.staged)
        if t.previous is not None:
            self.served = t.previous
        return True

    def release(self, ticket: str) -> None:
        t = self.tickets.pop(ticket, None)
        if t is not None and t.thread is not None and t.thread.is_alive():
            t.thread.join()

    def _ticket(self, ticket: str) -> Ticket:
        try:
            return self.tickets[ticket]
        except KeyError:
            raise ValueError(f"unknown ticket {ticket}") from None


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def error_payload(exc: BaseException) -> dict:
    """A plain-dict form of an error that crosses the RPC boundary with its HTTP status."""
    status = getattr(exc, "http_status", 500) if isinstance(exc, DeltaError) else 500
    return {"type": type(exc).__name__, "status": status, "message": str(exc)}
