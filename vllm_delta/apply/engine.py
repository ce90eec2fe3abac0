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
(several versions -> one set of final bits), `emit.StageRun` (a chunk's translation, live and new
bits, checksum partials and plan), `plans` (where each element goes), `scatter` (the kernels that
write it), and the checksum arithmetic in `vllm_delta.checksums`. A fused engine stages the common
chunk (whole tensors, one owner: `DeviceLayout.whole_runs`) in one kernel launch (`stage_unit`:
translation, live and new bits, plan, arranged bits, partials; the same bits as the general path).
`unit_kernel=` turns it on or off (None: on where Triton runs on the engine's device, unless
VLLM_DELTA_STAGE_UNIT=0: A/B measurements).

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

import torch

from .. import codec as codecs
from ..checksums import MASK64, positional_sum
from ..errors import NotSuccessorError, ShapeMismatchError, UnsupportedModelError
from ..format import TensorEntry, VersionHeader, VersionLike
from ..format import TensorTable as HeaderTable
from . import scatter as scatter_ops
from . import stage_unit
from .chain import check_undo, merge_chain
from .emit import LiveBits, StagedUpdate, StageRun, span
from .layout import DeviceLayout, Layout, Segment
from .plans import BLOCK, FusedPlan, flat_bits
from .staging import Decoder, changed_items, item_indices

_STATE = itertools.count(1)


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
        block: int = BLOCK,
        unit_kernel: bool | None = None,
    ):
        self.layout = layout
        self.target_names = list(layout.targets)
        missing = [n for n in self.target_names if n not in targets]
        if missing:
            raise UnsupportedModelError(f"layout names targets the model does not have: {missing[:5]}")
        self.targets = [targets[n] for n in self.target_names]
        self.flats = [flat_bits(t) for t in self.targets]
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
        addressing: dict[int, scatter_ops.FusedAddressing] = {}
        for width in {f.element_size() for f in self.flats}:
            by_width = scatter_ops.FusedAddressing.of(self.flats, width, self.device)
            if by_width is not None:
                addressing[width] = by_width
        self.live_bits = LiveBits(self.flats, addressing, self.backend, self.device)
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

    def sync_stream(self) -> None:
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
            run = StageRun(self, staged)
            span(run.timings, "header", t_start, t_header)  # the tensor table checked against the model
            self._decoder.decoded = 0
            self._stage_changes(run, files)
            staged.decoded = self._decoder.decoded
            t0 = time.perf_counter()
            run.finish()
            self.sync_stream()
            span(run.timings, "plan", t0)
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

    def _stage_changes(self, run: StageRun, files: list[VersionLike]) -> None:
        """Decode (and for chains, merge) the versions' changes and emit them chunk by chunk."""
        if len(files) == 1 and files[0].header.kind == "delta":
            vf = files[0]
            t0 = time.perf_counter()
            changed = changed_items(vf, self.dlayout)
            run.span("items", t0)  # the pieces this layout needs, from the header
            for width, items in changed.items():
                run.changed.update(item_indices(items))
                for chunk in self._decoder.decode(vf.version, vf.header.codec or "", items, width, run.timings):
                    run.emit(width, chunk.t_idx, chunk.p, chunk.runs, chunk)
                    run.note_mem()
            return
        bits = self.live_bits
        pending = merge_chain(
            files, self.dlayout, self._decoder, bits.live, bits.read, run.timings, run.changed, run.undo
        )
        for width, (ids, new) in pending.items():
            for s in range(0, ids.numel(), self.chunk_elems):
                t_idx, p, runs = self.dlayout.split_global(ids[s : s + self.chunk_elems])
                run.emit(width, t_idx, p, runs, new[s : s + self.chunk_elems])
                run.note_mem()

    def warm_up(self, plan: FusedPlan, old: torch.Tensor) -> None:
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

    def device_allocated(self) -> int:
        # the nested dict as the allocator gives it: `memory_allocated` flattens every counter in Python
        # first (~0.5 ms a call, 7 calls a staging)
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]["current"])

    def close(self) -> None:
        """Stop the staging thread pool (the engine stays usable: it restarts on the next stage)."""
        self._decoder.close()
