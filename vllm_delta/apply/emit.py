"""One `ApplyEngine.stage` call's work, chunk by chunk: what the engine hands each decoded chunk to.

For a chunk of changed elements (HF positions `p`, in runs of one HF tensor each):

    sels = dlayout.translate(...)       # the engine's targets holding each element (one per TP copy)
    live = gather(sels[0])              # the live bits there: the rollback buffer
    new  = values | live ± diffs        # the chunk's new bits (undo: the diffs subtracted)
    sums[t] += Σ w(p)(new - live)       # each HF tensor's checksum partial, over owned elements
    plans += plan(sels, new, live)      # where each element goes, the bits in plan order

`StageRun.finish` joins the chunks' plans per element width into the StagedUpdate. A fused engine
stages the common chunk in one launch instead (stage_unit.py: the same bits). `LiveBits` reads the
live bits for the chunks and for chain merges (chain.merge_chain).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..bits import INT_DTYPE
from ..checksums import partial_terms
from ..codec.decoding import Runs
from ..format import VersionHeader
from . import stage_unit
from .chain import step_bits
from .layout import DeviceLayout, Selection
from .plans import FusedPlan, ScatterPlan, build_plan, cat_plans
from .scatter import FusedAddressing
from .staging import Chunk


@dataclass
class StagedUpdate:
    """What `ApplyEngine.stage` prepared: plans and bits to write in the pause, the rollback buffer,
    the checksum partials, and how staging went."""

    versions: list[int]  # staged in order: applied, or (`undo`) undone newest first
    header: VersionHeader  # the header of the version the update leads to (the last applied, or the target)
    plans: list[ScatterPlan] = field(default_factory=list)  # one per element width
    new_bits: list[torch.Tensor] = field(default_factory=list)  # plan order
    old_bits: list[torch.Tensor] = field(default_factory=list)  # the rollback buffer, plan order
    partials: dict[str, int] = field(default_factory=dict)  # Σ w(p)(new - old) over owned elements
    nnz: int = 0  # local elements written
    decoded: int = 0  # changed elements decoded (this rank's share of the versions' chunks)
    bytes: int = 0  # staged device bytes (plans + new + old values)
    timings: dict[str, float] = field(default_factory=dict)  # ms per staging phase, and "total"
    written: bool = False
    backend: str = "torch"
    memory: dict[str, int] = field(default_factory=dict)  # staging memory: device peak, held, host
    base_state: int = 0  # engine state this update was staged against
    state: int = 0  # engine state once written
    undo: bool = False  # the versions' differences are subtracted: back to `header`'s version

    @property
    def version(self) -> int:
        """The version the update leads to."""
        return self.header.version


class LiveBits:
    """The live bits of an engine's targets at (target, local offset) pairs of one element width."""

    def __init__(
        self, flats: list[torch.Tensor], addressing: dict[int, FusedAddressing], backend: str, device: torch.device
    ) -> None:
        self.flats = flats
        self.addressing = addressing
        self.backend = backend
        self.fused = backend != "torch"
        self.device = device

    def gather(self, width: int, tid: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Live bits at (target, local offset) pairs of one width."""
        if self.fused:
            return self.addressing[width].gather(tid, local, self.backend)
        out = torch.empty(local.numel(), dtype=INT_DTYPE[width], device=local.device)
        if local.numel():
            # grouped by target once (a mask per target costs O(elements x targets): 435 targets of a MoE)
            order = torch.argsort(tid, stable=True)
            ids, counts = torch.unique_consecutive(tid[order], return_counts=True)
            at = 0
            for t, c in zip(ids.tolist(), counts.tolist()):
                sel = order[at : at + c]
                out[sel] = self.flats[t][local[sel]]
                at += c
        return out

    def live(self, width: int, sels: list[Selection], n: int) -> torch.Tensor:
        """Live bits of a chunk's elements, read through the first segment holding each (else 0)."""
        live = torch.zeros(n, dtype=INT_DTYPE[width], device=self.device)
        keep = torch.zeros(n, dtype=torch.bool, device=self.device)
        for s in sels:
            sel = (s.mask if s.mask is not None else torch.ones_like(keep)) & ~keep
            idx = sel.nonzero().reshape(-1)
            if idx.numel():
                live[idx] = self.gather(width, s.target[idx], s.offset[idx])
            keep |= sel
        return live

    def read(self, target: int, offsets: torch.Tensor) -> torch.Tensor:
        return self.flats[target][offsets]


class Outputs:
    """Staged output of one element width, accumulated chunk by chunk."""

    def __init__(self) -> None:
        self.plans: list[FusedPlan] = []
        self.new: list[torch.Tensor] = []
        self.old: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []  # grouped plans: target index per element
        self.offsets: list[torch.Tensor] = []  # grouped plans: target offset per element


class Engine(Protocol):
    """What a StageRun uses of the engine that stages (ApplyEngine)."""

    dlayout: DeviceLayout
    device: torch.device
    targets: list[torch.Tensor]
    live_bits: LiveBits
    fused: bool  # fused plans (a kernel backend), else grouped plans (the torch path)
    unit_kernel: bool
    block: int
    phase_waits: bool

    def sync_stream(self) -> None: ...

    def device_allocated(self) -> int: ...

    def warm_up(self, plan: FusedPlan, old: torch.Tensor) -> None: ...


class StageRun:
    """The state of one `stage` call: checksum partials, outputs by width, timings, peak memory."""

    def __init__(self, engine: Engine, staged: StagedUpdate):
        self.engine = engine
        self.staged = staged
        self.undo = staged.undo
        self.timings = staged.timings
        self.sums = torch.zeros(len(engine.dlayout.names), dtype=torch.int64, device=engine.device)
        self.outs: dict[int, Outputs] = {}
        self.changed: set[int] = set()  # indices of the HF tensors the update touches
        self.mem0 = engine.device_allocated()
        self.peak = self.mem0

    def out(self, width: int) -> Outputs:
        return self.outs.setdefault(width, Outputs())

    def note_mem(self) -> None:
        self.peak = max(self.peak, self.engine.device_allocated())

    def span(self, key: str, t0: float) -> float:
        if self.engine.phase_waits:  # VLLM_DELTA_STAGE_TIMING=sync: each phase's device time
            self.engine.sync_stream()
        return span(self.timings, key, t0)

    # -- one chunk: translate, gather, new bits, partials, plan ----------------------------------
    def emit(self, width: int, t_idx: torch.Tensor, p: torch.Tensor, runs: Runs, source: Chunk | torch.Tensor) -> None:
        """`source`: a decoded Chunk (new bits from its values or diffs) or a tensor of new bits."""
        engine = self.engine
        t0 = time.perf_counter()
        runs = runs.nonempty()
        if engine.unit_kernel and isinstance(source, Chunk) and self._emit_unit(width, p, runs, source, t0):
            return
        sels = engine.dlayout.translate(t_idx, p, runs.tensors, runs.counts, runs.held)
        t0 = self.span("translate", t0)
        if not sels:
            return
        bits = engine.live_bits
        if sels[0].mask is None:
            live = bits.gather(width, sels[0].target, sels[0].offset)
        else:
            live = bits.live(width, sels, p.numel())
        if not isinstance(source, Chunk):
            new = source
        elif source.values is not None:
            new = source.values
        else:
            assert source.diffs is not None
            new = step_bits(live, source.diffs, width, self.undo)
        t0 = self.span("gather", t0)
        self._add_partials(sels, runs, p, new, live)
        t0 = self.span("partials", t0)
        self._plan(width, sels, new, live)
        self.span("plan", t0)

    def _emit_unit(self, width: int, p: torch.Tensor, runs: Runs, chunk: Chunk, t0: float) -> bool:
        """The common case in one launch (stage_unit.py); False where it does not apply."""
        engine = self.engine
        args = (engine.dlayout, engine.live_bits.addressing.get(width), p, runs, chunk, self.sums)
        unit = stage_unit.stage_chunk(*args, undo=self.undo, block=engine.block)
        if unit is None:
            return False
        out = self.out(width)
        out.plans.append(unit[0])
        out.new.append(unit[1])
        out.old.append(unit[2])
        for key in ("translate", "gather", "partials"):  # inside the one launch, timed as "plan"
            self.timings.setdefault(key, 0.0)
        self.span("plan", t0)
        return True

    def _add_partials(
        self, sels: list[Selection], runs: Runs, p: torch.Tensor, new: torch.Tensor, live: torch.Tensor
    ) -> None:
        """Per HF tensor, Σ w(p)(new - old) over the elements this rank owns."""
        owned, everything = None, False
        for s in sels:
            if s.owner is False:
                continue
            m = s.mask
            if isinstance(s.owner, torch.Tensor):
                m = s.owner if m is None else m & s.owner
            if m is None:
                everything = True
                break
            owned = m if owned is None else owned | m
        term = partial_terms(p.clone(), new, live)
        if not everything:
            term.masked_fill_(~owned if owned is not None else torch.ones_like(term, dtype=torch.bool), 0)
        # Elements of a tensor are consecutive: per-tensor sums from prefix sums at run ends (no atomics).
        k = runs.tensors.size
        meta = torch.from_numpy(np.concatenate([runs.tensors, np.cumsum(runs.counts)])).to(p.device, non_blocking=True)
        ends = torch.cumsum(term, 0)[meta[k:] - 1]
        self.sums.index_add_(0, meta[:k], torch.cat([ends[:1], ends[1:] - ends[:-1]]))

    def _plan(self, width: int, sels: list[Selection], new: torch.Tensor, live: torch.Tensor) -> None:
        """Every segment holding an element gets it; rollback bits are read through that segment."""
        engine, out = self.engine, self.out(width)
        gather = engine.live_bits.gather
        for k, s in enumerate(sels):
            if s.mask is None:
                tid, local, nb = s.target, s.offset, new
                ob = live if k == 0 else gather(width, tid, local)
            else:
                idx = s.mask.nonzero().reshape(-1)
                if not idx.numel():
                    continue
                tid, local, nb = s.target[idx], s.offset[idx], new[idx]
                ob = live[idx] if k == 0 else gather(width, tid, local)
            if engine.fused:
                # s.runs is set only without a mask (the host's runs of a whole-tensor selection)
                plan = engine.live_bits.addressing[width].plan(tid, local, block=engine.block, runs=s.runs)
                out.plans.append(plan)
                out.new.append(plan.arrange(nb))
                out.old.append(plan.arrange(ob))
            else:
                out.targets.append(tid)
                out.offsets.append(local)
                out.new.append(nb)
                out.old.append(ob)

    # -- the whole update ------------------------------------------------------------------------
    def finish(self) -> None:
        """Each width's chunk pieces joined into one plan with its new and rollback bits (the kernels
        compiled/loaded for its types now, not inside the pause)."""
        staged, engine = self.staged, self.engine
        for width in sorted(self.outs):
            out = self.outs[width]
            plan: ScatterPlan
            if engine.fused:
                if not out.plans:
                    continue
                plan = cat_plans(out.plans)
                new, old = _cat(out.new), _cat(out.old)
                engine.warm_up(plan, old)
            else:
                if not out.targets:
                    continue
                plan = build_plan(engine.targets, _cat(out.targets), _cat(out.offsets))
                new, old = plan.arrange(_cat(out.new)), plan.arrange(_cat(out.old))
            self.outs[width] = Outputs()  # drop the chunk pieces before the next width
            staged.plans.append(plan)
            staged.new_bits.append(new)
            staged.old_bits.append(old)
            staged.nnz += plan.nnz
            staged.bytes += plan.nbytes + new.numel() * new.element_size() + old.numel() * old.element_size()


def span(timings: dict[str, float], key: str, t0: float, t1: float | None = None) -> float:
    """Add [t0, t1) (t1: now) to `timings[key]`, in ms; returns t1."""
    t1 = time.perf_counter() if t1 is None else t1
    timings[key] = timings.get(key, 0.0) + (t1 - t0) * 1e3
    return t1


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
