"""The apply engine: stage versions before the pause, patch the weights in place inside it, roll back.

Plain tensors in, plain tensors out: the engine knows nothing of vLLM. It holds the live target
tensors (written in place, never rebound) and a `Layout` (HF tensor -> local segments).

    staged = engine.stage([vfile, ...])   # decode, translate, gather old values, new values,
                                          # per-tensor checksum partials; nothing is written
    checksums.verify_partials(sums, [staged.partials, ...], header)   # all ranks; raises on mismatch
    engine.patch(staged)                  # the pause: one fused scatter per element width
    engine.rollback(staged)               # restore the previous bits exactly

Several versions stage into one update (a chain: deltas in order, or an anchor and its deltas),
so a reader several versions behind catches up in one pause. Backward, the same way:

    staged = engine.stage([v6, v5], back_to=v4.header)   # undo 6 then 5: the weights of version 4

Backends (scatter.py): on CUDA the fused kernels, "cuda" (csrc/, built with torch's extension
builder the first time an engine is created on a machine, ~30 s, then cached) when it builds, else
"triton"; on CPU the torch path. `backend=` or VLLM_DELTA_SCATTER_BACKEND chooses. Kernels are
compiled/loaded during `stage` (a no-op write of one block), never inside `patch`.

The engine orchestrates; the pieces live beside it: `layout.DeviceLayout` (HF positions -> local
targets, vectorized), `staging.Decoder` (file -> changes on the device), `chain.merge_chain`
(several versions -> one set of final bits), `scatter` (plans and kernels), and the checksum
arithmetic in `vllm_delta.checksums`. A fused engine stages the common chunk (whole tensors, one
owner: `DeviceLayout.whole_runs`) in one kernel launch (`stage_unit`: translation, live and new bits,
plan, arranged bits, partials; the same bits as the general path). `unit_kernel=` turns it on or off
(None: on where Triton runs on the engine's device, unless VLLM_DELTA_STAGE_UNIT=0: A/B measurements).

Staging (everything but the patch) runs on the engine's one side CUDA stream while the server keeps
generating (callers must not wrap it in a stream of their own):
read + zstd decode on a thread pool into pinned memory, one host-to-device copy, then on the
device, chunk by chunk (bounded memory): positions from gaps, HF -> local translation (vectorized
over all tensors), the live bits at the changed places (the rollback buffer), new bits from ULP
differences, checksum partials, and the fused scatter plan. `patch` is then one kernel launch per
element width (backends: scatter.py). On CPU the torch path does the same with grouped plans.
Memory: `StagedUpdate.memory` (8 B per changed bf16 element held until write/release, ~2x that at
the peak of staging, 3 B per element of pinned host memory). A staged update records the engine
state it was staged against; writing it after another write or rollback raises
NotSuccessorError (stage again).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import codec as codecs
from ..bits import INT_DTYPE
from ..checksums import MASK64, partial_terms, positional_sum
from ..codec.decoding import Runs
from ..errors import NotSuccessorError, ShapeMismatchError, UnsupportedModelError
from ..format import TensorEntry, VersionHeader, VersionLike
from ..format import TensorTable as HeaderTable
from . import scatter as scatter_ops
from . import stage_unit
from .chain import check_undo, merge_chain, step_bits
from .layout import DeviceLayout, Layout, Segment, Selection
from .staging import Chunk, Decoder, changed_items, item_indices

_STATE = itertools.count(1)


@dataclass
class StagedUpdate:
    versions: list[int]  # staged in order: applied, or (`undo`) undone newest first
    header: VersionHeader  # the header of the version the update leads to (the last applied, or the target)
    plans: list[scatter_ops.ScatterPlan] = field(default_factory=list)  # one per element width
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


class _Outputs:
    """Staged output of one element width, accumulated chunk by chunk."""

    def __init__(self) -> None:
        self.plans: list[scatter_ops.FusedPlan] = []
        self.new: list[torch.Tensor] = []
        self.old: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []  # grouped plans: target index per element
        self.offsets: list[torch.Tensor] = []  # grouped plans: target offset per element


class _Run:
    """The state of one `stage` call: checksum partials, outputs by width, timings, peak memory."""

    def __init__(self, engine: ApplyEngine, staged: StagedUpdate):
        self.engine = engine
        self.staged = staged
        self.undo = staged.undo
        self.timings = staged.timings
        self.sums = torch.zeros(len(engine.dlayout.names), dtype=torch.int64, device=engine.device)
        self.outs: dict[int, _Outputs] = {}
        self.changed: set[int] = set()  # indices of the HF tensors the update touches
        self.mem0 = engine._mem()
        self.peak = self.mem0

    def out(self, width: int) -> _Outputs:
        return self.outs.setdefault(width, _Outputs())

    def note_mem(self) -> None:
        self.peak = max(self.peak, self.engine._mem())

    def span(self, key: str, t0: float) -> float:
        if self.engine.phase_waits:  # VLLM_DELTA_STAGE_TIMING=sync: each phase's device time
            self.engine._sync_stream()
        return _span(self.timings, key, t0)


class ApplyEngine:
    def __init__(
        self,
        targets: dict[str, torch.Tensor],
        layout: Layout,
        device: torch.device | str | None = None,
        *,
        backend: str | None = None,
        chunk_elems: int | None = None,
        threads: int | None = None,
        block: int = scatter_ops.BLOCK,
        unit_kernel: bool | None = None,
    ):
        self.layout = layout
        self.target_names = list(layout.targets)
        missing = [n for n in self.target_names if n not in targets]
        if missing:
            raise UnsupportedModelError(f"layout names targets the model does not have: {missing[:5]}")
        self.targets = [targets[n] for n in self.target_names]
        self.flats = [scatter_ops.flat_bits(t) for t in self.targets]
        self.device = (
            torch.device(device)
            if device is not None
            else (self.targets[0].device if self.targets else torch.device("cpu"))
        )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend or scatter_ops.default_backend(self.device)
        if not scatter_ops.backend_available(self.backend, self.device):
            raise ValueError(
                f"scatter backend {self.backend!r} is not available on {self.device} "
                f"(available: {scatter_ops.available_backends(self.device)})"
            )
        self.fused = self.backend != "torch"
        self.unit_kernel = self.fused and stage_unit.enabled(unit_kernel, self.device)
        self.block = block
        layout.check([f.numel() for f in self.flats])
        self.dlayout = DeviceLayout(layout, self.device)
        self._addressing: dict[int, scatter_ops.FusedAddressing] = {}
        for width in {f.element_size() for f in self.flats}:
            addressing = scatter_ops.FusedAddressing.of(self.flats, width, self.device)
            if addressing is not None:
                self._addressing[width] = addressing
        self._decoder = Decoder(self.device, chunk_elems, threads)
        self.chunk_elems = self._decoder.chunk_elems  # staging.default_chunk_elems(device) unless named
        self.phase_waits = self._decoder.phase_waits
        # The one side stream of staging (decode, translation, plans): ordered against the writes
        # by the synchronization at the end of `stage`.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._stage_lock = threading.Lock()  # one staging at a time: the decoder's buffers are shared
        self._state = 0
        self._warm: set[tuple[torch.dtype, torch.dtype]] = set()
        self._fits: dict[str, tuple[str, list[int]]] = {}  # tensors whose header entry fits the model
        self._fitting: tuple[object, ...] | None = None  # the last tensor set that fit (TensorTable.set_key)

    # -- checksums -------------------------------------------------------------------------
    def live_sums(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """Per HF tensor: positional sum of the live bits over this engine's owned elements."""
        out = {}
        for name in names or self.layout.hf_shapes:
            total = 0
            for seg in self.layout.segments.get(name, ()):
                if seg.owner:
                    total += self._segment_sum(name, seg)
            out[name] = total & MASK64
        return out

    def _segment_sum(self, name: str, seg: Segment) -> int:
        flat = self.flats[seg.target]
        if self.layout.is_row_run(name, seg):
            cols = self.layout.hf_shapes[name][-1] if self.layout.hf_shapes[name] else 1
            n = seg.rows * seg.cols
            return positional_sum(flat[seg.dst_offset : seg.dst_offset + n], seg.row0 * cols)
        total = 0
        for pos, dst in self.layout.segment_blocks(name, seg, flat.device):
            total += positional_sum(flat[dst], pos)
        return total & MASK64

    # -- staging ---------------------------------------------------------------------------
    def _check_entry(self, header: VersionHeader, name: str, entry: TensorEntry) -> None:
        shape = self.layout.hf_shapes.get(name)
        if shape is None:
            raise UnsupportedModelError(
                "the version holds a tensor this model does not load", version=header.version, tensor=name
            )
        if tuple(entry.shape) != tuple(shape):
            raise ShapeMismatchError(
                f"shape {entry.shape} != model shape {list(shape)}", version=header.version, tensor=name
            )
        for seg in self.layout.segments.get(name, ()):
            # Real dtypes, not element sizes: float16 bits written into a bf16 parameter would pass a
            # size check, and the checksum (over bits) would agree with the version's header.
            if self.targets[seg.target].dtype != entry.torch_dtype:
                raise ShapeMismatchError(
                    f"dtype {entry.dtype} does not match the model's {self.targets[seg.target].dtype}",
                    version=header.version,
                    tensor=name,
                )

    def check_header(self, header: VersionHeader) -> None:
        """Every tensor of a version fits the model (name, shape, dtype): ShapeMismatchError or
        UnsupportedModelError naming the first that does not. A tensor seen with the same shape and
        dtype before is not checked again (a mixture of experts lists ~20K tensors per version)."""
        # immutable copies (a header's columns can be changed in place later: table[name] = entry); a
        # format-5 table's are its names string and array bytes (no object per tensor)
        table = HeaderTable.of(header.tensors).set_key()
        if table == self._fitting:  # the tensor table of a version checked before: C-level compares
            return
        seen = self._fits
        for name, entry in header.tensors.items():
            if seen.get(name) == (entry.dtype, entry.shape):
                continue
            self._check_entry(header, name, entry)
            seen[name] = (entry.dtype, list(entry.shape))
        self._fitting = table

    def _stream_ctx(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _sync_stream(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def stage(self, files: list[VersionLike], *, back_to: VersionHeader | None = None) -> StagedUpdate:
        """Prepare the versions in `files` (in order) for one in-place write. Writes nothing.

        With `back_to` (an older version's header), `files` are the deltas from the live version down to
        the one above `back_to`, newest first, and are undone: each one's differences subtracted
        (NotSuccessorError, before anything is read, when one cannot be: chain.check_undo)."""
        if not files:
            raise ValueError("nothing to stage")
        t_start = time.perf_counter()
        if back_to is not None:
            check_undo(files, back_to)
            self.check_header(back_to)
        for vf in files:
            h = vf.header
            if h.kind == "delta":
                codecs.get_codec(h.codec or "", {"version": h.version})
            self.check_header(h)
        t_header = time.perf_counter()
        staged = StagedUpdate(
            versions=[vf.version for vf in files],
            header=back_to if back_to is not None else files[-1].header,
            backend=self.backend,
            base_state=self._state,
            undo=back_to is not None,
        )
        with self._stage_lock, self._stream_ctx():
            run = _Run(self, staged)
            _span(run.timings, "header", t_start, t_header)  # the tensor table checked against the model
            self._decoder.decoded = 0
            self._stage_changes(run, files)
            staged.decoded = self._decoder.decoded
            t0 = time.perf_counter()
            self._finish(run)
            self._sync_stream()
            _span(run.timings, "plan", t0)
            t0 = time.perf_counter()
            sums = run.sums.tolist()
            staged.partials = {self.dlayout.names[i]: sums[i] & MASK64 for i in sorted(run.changed)}
            run.span("sums", t0)
            run.note_mem()
        staged.memory = {
            "device_peak_bytes": max(0, run.peak - run.mem0),
            "device_held_bytes": staged.bytes,
            "host_bytes": self._decoder.host_bytes,
        }
        staged.timings["total"] = (time.perf_counter() - t_start) * 1e3
        return staged

    def _stage_changes(self, run: _Run, files: list[VersionLike]) -> None:
        """Decode (and for chains, merge) the versions' changes and emit them chunk by chunk."""
        if len(files) == 1 and files[0].header.kind == "delta":
            vf = files[0]
            t0 = time.perf_counter()
            changed = changed_items(vf, self.dlayout)
            run.span("items", t0)  # the pieces this layout needs, from the header
            for width, items in changed.items():
                run.changed.update(item_indices(items))
                for chunk in self._decoder.decode(vf.version, vf.header.codec or "", items, width, run.timings):
                    self._emit(run, width, chunk.t_idx, chunk.p, chunk.runs, chunk)
                    run.note_mem()
            return
        pending = merge_chain(
            files, self.dlayout, self._decoder, self._live, self._read_target, run.timings, run.changed, run.undo
        )
        for width, (ids, new) in pending.items():
            for s in range(0, ids.numel(), self.chunk_elems):
                t_idx, p, runs = self.dlayout.split_global(ids[s : s + self.chunk_elems])
                self._emit(run, width, t_idx, p, runs, new[s : s + self.chunk_elems])
                run.note_mem()

    # -- live bits -------------------------------------------------------------------------------
    def _gather(self, width: int, tid: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Live bits at (target, local offset) pairs of one width."""
        if self.fused:
            return self._addressing[width].gather(tid, local, self.backend)
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

    def _live(self, width: int, sels: list[Selection], n: int) -> torch.Tensor:
        """Live bits of a chunk's elements, read through the first segment holding each (else 0)."""
        live = torch.zeros(n, dtype=INT_DTYPE[width], device=self.device)
        keep = torch.zeros(n, dtype=torch.bool, device=self.device)
        for s in sels:
            sel = (s.mask if s.mask is not None else torch.ones_like(keep)) & ~keep
            idx = sel.nonzero().reshape(-1)
            if idx.numel():
                live[idx] = self._gather(width, s.target[idx], s.offset[idx])
            keep |= sel
        return live

    def _read_target(self, target: int, offsets: torch.Tensor) -> torch.Tensor:
        return self.flats[target][offsets]

    # -- one chunk: translate, gather, new bits, partials, plan ----------------------------------
    def _emit(
        self,
        run: _Run,
        width: int,
        t_idx: torch.Tensor,
        p: torch.Tensor,
        runs: Runs,
        source: Chunk | torch.Tensor,
    ) -> None:
        """`source`: a decoded Chunk (new bits from its values or diffs) or a tensor of new bits."""
        t0 = time.perf_counter()
        runs = runs.nonempty()
        if self.unit_kernel and isinstance(source, Chunk) and self._emit_unit(run, width, p, runs, source, t0):
            return
        sels = self.dlayout.translate(t_idx, p, runs.tensors, runs.counts, runs.held)
        t0 = run.span("translate", t0)
        if not sels:
            return
        n = p.numel()
        if sels[0].mask is None:
            live = self._gather(width, sels[0].target, sels[0].offset)
        else:
            live = self._live(width, sels, n)
        if not isinstance(source, Chunk):
            new = source
        elif source.values is not None:
            new = source.values
        else:
            assert source.diffs is not None
            new = step_bits(live, source.diffs, width, run.undo)
        t0 = run.span("gather", t0)
        self._add_partials(run, sels, runs, p, new, live)
        t0 = run.span("partials", t0)
        self._plan(run, width, sels, new, live)
        run.span("plan", t0)

    def _emit_unit(self, run: _Run, width: int, p: torch.Tensor, runs: Runs, chunk: Chunk, t0: float) -> bool:
        """The common case in one launch (stage_unit.py); False where it does not apply."""
        args = (self.dlayout, self._addressing.get(width), p, runs, chunk, run.sums)
        unit = stage_unit.stage_chunk(*args, undo=run.undo, block=self.block)
        if unit is None:
            return False
        out = run.out(width)
        out.plans.append(unit[0])
        out.new.append(unit[1])
        out.old.append(unit[2])
        for key in ("translate", "gather", "partials"):  # inside the one launch, timed as "plan"
            run.timings.setdefault(key, 0.0)
        run.span("plan", t0)
        return True

    def _add_partials(
        self,
        run: _Run,
        sels: list[Selection],
        runs: Runs,
        p: torch.Tensor,
        new: torch.Tensor,
        live: torch.Tensor,
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
        run.sums.index_add_(0, meta[:k], torch.cat([ends[:1], ends[1:] - ends[:-1]]))

    def _plan(self, run: _Run, width: int, sels: list[Selection], new: torch.Tensor, live: torch.Tensor) -> None:
        """Every segment holding an element gets it; rollback bits are read through that segment."""
        out = run.out(width)
        for k, s in enumerate(sels):
            if s.mask is None:
                tid, local, nb = s.target, s.offset, new
                ob = live if k == 0 else self._gather(width, tid, local)
            else:
                idx = s.mask.nonzero().reshape(-1)
                if not idx.numel():
                    continue
                tid, local, nb = s.target[idx], s.offset[idx], new[idx]
                ob = live[idx] if k == 0 else self._gather(width, tid, local)
            if self.fused:
                # s.runs is set only without a mask (the host's runs of a whole-tensor selection)
                plan = self._addressing[width].plan(tid, local, block=self.block, runs=s.runs)
                out.plans.append(plan)
                out.new.append(plan.arrange(nb))
                out.old.append(plan.arrange(ob))
            else:
                out.targets.append(tid)
                out.offsets.append(local)
                out.new.append(nb)
                out.old.append(ob)

    def _finish(self, run: _Run) -> None:
        staged = run.staged
        for width in sorted(run.outs):
            out = run.outs[width]
            plan: scatter_ops.ScatterPlan
            if self.fused:
                if not out.plans:
                    continue
                plan = scatter_ops.cat_plans(out.plans)
                new, old = _cat(out.new), _cat(out.old)
                self._warmup(plan, old)
            else:
                if not out.targets:
                    continue
                plan = scatter_ops.build_plan(self.targets, _cat(out.targets), _cat(out.offsets))
                new, old = plan.arrange(_cat(out.new)), plan.arrange(_cat(out.old))
            run.outs[width] = _Outputs()  # drop the chunk pieces before the next width
            staged.plans.append(plan)
            staged.new_bits.append(new)
            staged.old_bits.append(old)
            staged.nnz += plan.nnz
            staged.bytes += plan.nbytes + new.numel() * new.element_size() + old.numel() * old.element_size()

    def _warmup(self, plan: scatter_ops.FusedPlan, old: torch.Tensor) -> None:
        """Compile/load the write kernel for this plan's types now, not inside the pause: write the
        first block's current bits back (no change)."""
        key = (plan.dtype, plan.rel.dtype)
        if key in self._warm or not plan.size:
            return
        first = plan.first_block()
        scatter_ops.scatter_(first, old[: plan.block], self.backend)
        self._warm.add(key)

    # -- the pause -------------------------------------------------------------------------
    def _check_current(self, staged: StagedUpdate) -> None:
        if staged.written:
            raise ValueError(f"update to version {staged.version} is already written")
        if staged.base_state != self._state:
            raise NotSuccessorError(
                "staged against other live weights (an update was written or rolled back since): stage again",
                version=staged.version,
            )

    def _mark_written(self, staged: StagedUpdate) -> None:
        staged.written = True
        staged.state = next(_STATE)
        self._state = staged.state

    def patch(self, staged: StagedUpdate) -> float:
        """Patch the weights: the staged bits in place. On any failure, restore what was written and re-raise."""
        self._check_current(staged)
        t0 = time.perf_counter()
        done = 0
        try:
            for plan, bits in zip(staged.plans, staged.new_bits):
                done += 1  # counted first: a failure inside a scatter may have written part of it
                scatter_ops.scatter_(plan, bits, staged.backend)
            self._sync()
        except BaseException:
            for plan, bits in list(zip(staged.plans, staged.old_bits))[:done]:
                scatter_ops.scatter_(plan, bits, staged.backend)
            self._sync()
            raise
        self._mark_written(staged)
        return (time.perf_counter() - t0) * 1e3

    def patch_with(self, staged: StagedUpdate, write: Callable[[], None]) -> float:
        """Patch `staged` through another writer (`write()` puts the same new bits in place, e.g. vLLM's
        sparse path): the same state checks as `patch`, and on failure our rollback buffer restores
        every staged element."""
        self._check_current(staged)
        t0 = time.perf_counter()
        try:
            write()
        except BaseException:
            self.rollback(staged)
            raise
        self._mark_written(staged)
        return (time.perf_counter() - t0) * 1e3

    def rollback(self, staged: StagedUpdate) -> None:
        """Write back the bits the staged places held at staging time (whoever wrote them since: our
        write or another path over the same elements). Roll back later updates first."""
        for plan, bits in zip(staged.plans, staged.old_bits):
            scatter_ops.scatter_(plan, bits, staged.backend)
        self._sync()
        staged.written = False
        self._state = staged.base_state

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _mem(self) -> int:
        # the nested dict as the allocator gives it: `memory_allocated` flattens every counter in Python
        # first (~0.5 ms a call, 7 calls a staging)
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]["current"])

    def close(self) -> None:
        """Stop the staging thread pool (the engine stays usable: it restarts on the next stage)."""
        self._decoder.close()


def _span(timings: dict[str, float], key: str, t0: float, t1: float | None = None) -> float:
    """Add [t0, t1) (t1: now) to `timings[key]`, in ms; returns t1."""
    t1 = time.perf_counter() if t1 is None else t1
    timings[key] = timings.get(key, 0.0) + (t1 - t0) * 1e3
    return t1


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
