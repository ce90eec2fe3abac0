"""What one vLLM worker holds for delta updates: the probed layout, the apply engine, staged updates.

The API process drives every rank through the same steps (collective_rpc, see methods.py):

    probe     probe + validate the layout once (main thread: it swaps torch.Tensor.copy_)
    stage     open and decode versions, gather the rollback buffer, compute checksum partials;
              runs on the replica's one staging thread so the worker keeps generating meanwhile
              (one long-lived thread, not one per update: no thread churn, one malloc arena)
    write     inside the pause: write in place (the engine restores this rank itself on failure)
    rollback  undo the writes of an update (another rank failed)
    release   drop a staged update's buffers

The served version lives here too, per rank, so that every rank can say what it holds. The replica
hangs on the model (`REPLICA_ATTR`): the loader attaches it, `replica_of` finds or creates it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ...apply.emit import StagedUpdate
from ...apply.engine import ApplyEngine
from ...apply.layout import hf_2d
from ...checksums import Sums, add_sums, to_hex
from ...errors import ChecksumMismatchError, InjectedFaultError, UnsupportedModelError
from ...format import VersionHeader, VersionLike
from ...server_api import METHODS, Counted, Coverage, HandlerInfo, Method, Recomputed, ViaVllm, fault_hits
from ..postprocess.derived import Product, check_targets, report_of
from ..postprocess.handlers import Handler, claims_for, handlers
from ..postprocess.loaded import fed_sums
from ..shared.messages import StageSummary
from . import dist, vllm_path
from .fallback import FallbackApplier, FallbackStage
from .probe import ProbeResult, finalize_layout, local_boxes, probe_layout, validate_layout

log = logging.getLogger(__name__)

REPLICA_ATTR = "_vllm_delta_replica"  # the model attribute that holds its DeltaReplica


@dataclass
class Served:
    version: int | None = None
    checksum: str | None = None  # whole-model checksum the version's header records
    sums: dict[str, int] = field(default_factory=dict)  # per-tensor sums the header records

    @classmethod
    def from_header(cls, header: VersionHeader) -> Served:
        t = header.tensors
        return cls(header.version, header.checksum, dict(zip(t.names, t.sum_values())))


@dataclass
class Ticket:
    versions: list[int]
    future: Future[None] | None = None  # the staging job on the replica's staging thread
    staged: StagedUpdate | None = None
    fallback: FallbackStage | None = None
    error: BaseException | None = None
    stage_ms: float = 0.0
    previous: Served | None = None  # what was served before this ticket's writes
    method: Method = "delta"  # "vllm": write through vLLM's sparse path instead (vllm_path.py)
    vllm_patches: list[Any] | None = None  # for method "vllm": vLLM CheckpointWeightPatch objects
    fault: str | None = None  # test hook (server_api.fault_hits)
    undo: bool = False  # the files but the last are undone, newest first, down to the last (rpc.StageArgs)


class DeltaReplica:
    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None):
        self.model = model
        self.device = torch.device(device) if device is not None else _model_device(model)
        self.rank, self.world_size = dist.rank_and_size()
        self.engine_index = 0  # vLLM's data-parallel rank of this worker's engine core (set by the worker methods)
        self.probe: ProbeResult | None = None
        self.engine: ApplyEngine | None = None
        self.fallback: FallbackApplier | None = None
        self.served = Served()
        self.recomputes: list[tuple[Handler, list[Product]]] = []
        self.tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()
        self._stager: ThreadPoolExecutor | None = None

    # -- the layout (collective) ----------------------------------------------------------------
    @property
    def probed(self) -> bool:
        return self.engine is not None

    def probe_layout(
        self, hf_shapes: dict[str, tuple[int, ...]], *, validate: bool = True, force_fallback: Iterable[str] = ()
    ) -> dict[str, str]:
        """Probe, check post-processing (derived.py), validate and combine the layout over all ranks.
        Every rank must call it; a refusal on any rank is raised on every rank. Returns fallbacks."""
        t0 = time.perf_counter()
        result: ProbeResult | None = None
        local_error: UnsupportedModelError | None = None
        recomputes: list[tuple[Handler, list[Product]]] = []
        try:
            result = probe_layout(self.model, hf_shapes)
            for name in force_fallback:
                if name in hf_shapes:
                    result.fallback.setdefault(name, "forced by delta_fallback")
            recomputes = self._check_postprocessing(result)
            if validate:
                result = validate_layout(self.model, result)
        except UnsupportedModelError as exc:
            local_error = exc
        mine = (
            (local_boxes(result.layout), sorted(result.fallback), None)
            if result is not None and local_error is None
            else ({}, [], str(local_error))
        )
        gathered = dist.all_gather_object(mine)
        if local_error is not None:
            raise local_error
        refused = [(r, g[2]) for r, g in enumerate(gathered) if g[2]]
        if refused:
            raise UnsupportedModelError(f"rank {refused[0][0]} refused the model: {refused[0][1]}")
        assert result is not None
        result = finalize_layout(result, self.rank, [(g[0], g[1]) for g in gathered])
        self.probe = result
        self.engine = ApplyEngine(result.targets, result.layout, device=self.device)
        self.fallback = FallbackApplier(self.model, result.fallback, counts=self.rank == 0)
        self.recomputes = recomputes
        fed = fed_sums(self.model)
        if fed is not None or self.world_size > 1:
            # Plain-checkpoint servers: what was loaded must read back through the layout (loaded.py).
            # Collective whenever there are several ranks (one rank may lack the record).
            union: dict[str, int] = {}
            for part in dist.all_gather_object(fed or {}):
                union.update(part)
            mapped = {n: s for n, s in union.items() if n in result.layout.segments}
            if mapped:
                try:
                    self.verify_loaded(mapped, UnsupportedModelError, "the checkpoint's tensor has")
                except UnsupportedModelError:
                    self.probe = self.engine = self.fallback = None
                    raise
        log.info(
            "vllm-delta: layout of %d tensors over %d parameters (%d through vLLM's sparse path) in %.0f ms",
            len(hf_shapes),
            len(result.targets),
            len(result.fallback),
            (time.perf_counter() - t0) * 1e3,
        )
        return dict(result.fallback)

    def _check_postprocessing(self, result: ProbeResult) -> list[tuple[Handler, list[Product]]]:
        """Refuse targets vLLM's post-processing transformed or shadowed (derived.py), unless a handler
        claims them; returns the handlers that recompute products after every update."""
        report = report_of(self.model)
        if report is None:
            return []  # not loaded through vLLM's model loader: nothing was observed
        claims = claims_for(report.products)
        check_targets(report, result.writes, {p.path for _, prods in claims for p in prods})
        return [(h, prods) for h, prods in claims if h.recompute is not None]

    def recompute_derived(self) -> None:
        """Rebuild what handlers claimed from the live parameters (after writes, inside the pause)."""
        for handler, products in self.recomputes:
            assert handler.recompute is not None
            handler.recompute(self.model, products)

    def verify_loaded(
        self, expected: dict[str, int], error: Callable[..., Exception] = ChecksumMismatchError, source: str = ""
    ) -> dict[str, int]:
        """Collective: the live per-tensor sums over all ranks must equal `expected` (what was loaded);
        raises `error` naming the first tensor that differs. Returns the live sums."""
        live = add_sums(dist.all_gather_object(self.live_sums()))
        for name, want in expected.items():
            got = live.get(name, 0)
            if got != want:
                raise error(
                    f"its live weights read through the probed layout have checksum {to_hex(got)}, "
                    f"{source or 'what was loaded has'} {to_hex(want)}: vLLM transformed the parameter after "
                    "loading, or its loader is not the plain copy the probe recorded",
                    tensor=name,
                )
        return live

    def coverage(self) -> Coverage:
        """How the served model's tensors take updates: in place, through vLLM's sparse path, recomputed."""
        assert self.probe is not None
        layout = self.probe.layout
        numel = {n: math.prod(s) for n, s in layout.hf_shapes.items()}
        in_place = [n for n in layout.hf_shapes if n in layout.segments and n not in self.probe.fallback]
        via_vllm = sorted(self.probe.fallback)
        recomputed = [p for _, prods in self.recomputes for p in prods]
        report = report_of(self.model)
        return Coverage(
            tensors=len(numel),
            elements=sum(numel.values()),
            in_place=Counted(len(in_place), sum(numel[n] for n in in_place)),
            vllm_path=ViaVllm(
                len(via_vllm),
                sum(numel[n] for n in via_vllm),
                via_vllm,
                {n: self.probe.fallback[n] for n in via_vllm},
            ),
            recomputed=Recomputed(
                len(recomputed),
                sum(p.numel for p in recomputed),
                [p.path for p in recomputed],
                [h.name for h, _ in self.recomputes],
            ),
            fully_in_place=not via_vllm and not recomputed,
            handlers=[HandlerInfo(h.name, h.cost) for h in handlers()],
            post_processing=report.summary() if report is not None else None,
        )

    @property
    def _who(self) -> str:
        return f"engine {self.engine_index} rank {self.rank}" if self.engine_index else f"rank {self.rank}"

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

    def live_sums_all_ranks(self) -> Sums:
        """Per HF tensor: the live positional sum over every rank (collective)."""
        return add_sums(dist.all_gather_object(self.live_sums()))

    def patch_behind_our_back(self) -> tuple[str, int] | None:
        """Test hook (methods.test_patch): flip the lowest bit of the first element this rank owns of the
        first in-place tensor (by name), bypassing every record. (HF name, flat index), None if none."""
        engine = self._require()
        layout = engine.layout
        for name in sorted(layout.segments):
            if self.probe is not None and name in self.probe.fallback:
                continue
            for seg in layout.segments[name]:
                if seg.owner and seg.rows and seg.cols:
                    engine.flats[seg.target][seg.dst_offset : seg.dst_offset + 1].bitwise_xor_(1)
                    return name, seg.row0 * hf_2d(layout.hf_shapes[name])[1] + seg.col0
        return None

    @property
    def fallback_names(self) -> list[str]:
        """Tensors that go through vLLM's sparse path (sorted; [] before the probe)."""
        return sorted(self.fallback.reasons) if self.fallback else []

    # -- staging --------------------------------------------------------------------------------
    def stage(self, ticket: str, files: list[VersionLike], *, undo: bool = False) -> StageSummary:
        """Stage synchronously (the loader, the native backend). Returns the summary. With `undo`, the
        files but the last are undone, newest first, down to the last (rpc.StageArgs)."""
        self.tickets[ticket] = t = Ticket([vf.version for vf in files], undo=undo)
        self._stage_into(t, lambda: files)
        if t.error is not None:
            self.tickets.pop(ticket, None)
            raise t.error
        return self.summary(ticket)

    def stage_start(
        self,
        ticket: str,
        versions: list[int],
        open_files: Callable[[], list[VersionLike]],
        method: Method = "delta",
        fault: str | None = None,
        undo: bool = False,
    ) -> None:
        """Stage on a background thread: generation continues between the worker's RPCs meanwhile."""
        self._require()
        if ticket in self.tickets:
            raise ValueError(f"ticket {ticket} is already staged")
        if method not in METHODS:
            raise ValueError(f"unknown apply method {method!r}")
        t = Ticket(list(versions), method=method, fault=fault, undo=undo)
        if self._stager is None:
            self._stager = ThreadPoolExecutor(1, thread_name_prefix="vllm-delta-stage")
        self.tickets[ticket] = t
        t.future = self._stager.submit(self._stage_into, t, open_files)

    def _stage_into(self, t: Ticket, open_files: Callable[[], list[VersionLike]]) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._require()
            files = open_files()
            back_to = None
            if t.undo:  # a backward update: the last file is its target, opened for its header
                files, back_to = files[:-1], files[-1].header
            if fault_hits(t.fault, "stage", self.engine_index, self.rank):
                raise InjectedFaultError(f"injected fault while staging on {self._who}")
            t.staged = engine.stage(files, back_to=back_to)  # on the engine's own side stream
            assert self.fallback is not None
            t.fallback = self.fallback.stage(files, undo=t.undo)
            if t.method == "vllm":
                t.vllm_patches = vllm_path.checkpoint_patches(engine.layout, t.staged)
        except BaseException as exc:  # noqa: BLE001 - reported to the API process by poll
            t.error = exc
        t.stage_ms = (time.perf_counter() - t0) * 1e3

    def poll(self, ticket: str) -> StageSummary | None:
        """None while staging runs; the summary when done; raises the staging error (and drops the ticket)."""
        t = self._ticket(ticket)
        if t.future is not None and not t.future.done():
            return None
        if t.error is not None:
            self.tickets.pop(ticket, None)
            raise t.error
        return self.summary(ticket)

    def summary(self, ticket: str) -> StageSummary:
        t = self._ticket(ticket)
        assert t.staged is not None and t.fallback is not None
        return StageSummary(
            versions=list(t.versions),
            partials=add_sums([t.staged.partials, t.fallback.partials]),
            nnz=t.staged.nnz + t.fallback.nnz,
            bytes=t.staged.bytes,
            stage_ms=t.stage_ms,
            timings=dict(t.staged.timings),
            decoded=t.staged.decoded + t.fallback.decoded,
            rank=self.rank,
            world_size=self.world_size,
        )

    # -- the pause ------------------------------------------------------------------------------
    def patch(self, ticket: str, fault: str | None = None, method: Method = "delta") -> float:
        """Write a staged update in place; returns the time taken (ms). On failure this rank is restored
        before the error propagates. `method` "vllm" writes through vLLM's sparse path instead (the
        ticket must have been staged for it)."""
        t = self._ticket(ticket)
        if t.staged is None:
            raise ValueError(f"ticket {ticket} is not staged")
        if method == "vllm":
            return self._patch_through_vllm(ticket, t)
        if method != "delta":
            raise ValueError(f"unknown apply method {method!r}")
        engine = self._require()
        assert self.fallback is not None and t.fallback is not None
        t0 = time.perf_counter()
        engine.patch(t.staged)
        try:
            self.fallback.patch(t.fallback)
            self.recompute_derived()
            if fault_hits(fault, "patch", self.engine_index, self.rank):
                raise InjectedFaultError(f"injected fault after the writes on {self._who}")
        except BaseException:
            self.fallback.rollback(t.fallback)
            engine.rollback(t.staged)
            self.recompute_derived()
            raise
        t.previous, self.served = self.served, Served.from_header(t.staged.header)
        return (time.perf_counter() - t0) * 1e3

    def _patch_through_vllm(self, ticket: str, t: Ticket) -> float:
        if t.vllm_patches is None:
            raise ValueError(f"ticket {ticket} was not staged for vLLM's sparse path")
        engine = self._require()
        assert t.staged is not None and t.fallback is not None and self.fallback is not None
        patches, fallback, fallback_stage = t.vllm_patches, self.fallback, t.fallback

        def patch() -> None:
            vllm_path.load_patches(self.model, patches)
            fallback.patch(fallback_stage)
            self.recompute_derived()  # handlers' derived tensors (handlers.py)

        # The same elements as our plan: on failure the engine's rollback buffer restores them.
        try:
            apply_ms = engine.patch_with(t.staged, patch)
        except BaseException:
            self.recompute_derived()
            raise
        t.previous, self.served = self.served, Served.from_header(t.staged.header)
        return apply_ms

    def rollback(self, ticket: str) -> bool:
        """Undo a written ticket (another rank failed). False if there was nothing to undo."""
        t = self.tickets.get(ticket)
        if t is None or t.staged is None or not t.staged.written:
            return False
        assert self.fallback is not None and t.fallback is not None
        self.fallback.rollback(t.fallback)
        self._require().rollback(t.staged)
        self.recompute_derived()
        if t.previous is not None:
            self.served = t.previous
        return True

    def release(self, ticket: str) -> None:
        """Drop a staged update. A staging still running (the API process gave up on it: a deadline) is
        abandoned, not joined: it may be waiting on a store, and this runs between forward passes. It
        ends on its own (store operations have deadlines); the engine stages one update at a time."""
        t = self.tickets.pop(ticket, None)
        if t is not None and t.future is not None and not t.future.done():
            log.warning("vllm-delta: abandoning staging ticket %s (still running)", ticket)
        if t is not None and self._stager is not None and _malloc_trim is not None:
            # The staged buffers are free now. glibc keeps freed heap memory for reuse (its trim
            # threshold grows up to 64 MB with the allocation sizes it has seen), which over many
            # updates shows as slow RSS growth; hand the free pages back, off the main thread.
            self._stager.submit(_malloc_trim, 0)

    def _ticket(self, ticket: str) -> Ticket:
        try:
            return self.tickets[ticket]
        except KeyError:
            raise ValueError(f"unknown ticket {ticket}") from None


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another libc, or VLLM_DELTA_MALLOC_TRIM=0)."""
    if os.environ.get("VLLM_DELTA_MALLOC_TRIM", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def replica_of(model: torch.nn.Module) -> DeltaReplica:
    """The model's replica, created on first use (a server not started with --load-format delta)."""
    replica = getattr(model, REPLICA_ATTR, None)
    if replica is None:
        replica = DeltaReplica(model)
        setattr(model, REPLICA_ATTR, replica)
    return replica
