"""The apply engine: stage versions before the pause, commit them in place inside it, roll back.

Plain tensors in, plain tensors out: the engine knows nothing of vLLM. It holds the live target
tensors (written in place, never rebound) and a `Layout` (HF tensor -> local segments).

    staged = engine.stage([vfile, ...])   # decode, translate, gather old values, new values,
                                          # per-tensor checksum partials; nothing is written
    verify_partials(sums, [staged.partials, ...], header)   # all ranks together; raises on mismatch
    engine.commit(staged)                 # the pause: one scatter per element width
    engine.rollback(staged)               # restore the previous bits exactly

Several versions stage into one update (a chain: deltas in order, or an anchor and its deltas),
so a reader several versions behind catches up in one pause.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .. import codec as codecs
from ..checksum import MASK64, positional_sum
from ..errors import ChecksumMismatchError, ShapeMismatchError, UnsupportedModelError
from ..format import VersionFile, VersionHeader
from . import scatter as scatter_ops
from .layout import Layout, hf_2d


@dataclass
class StagedUpdate:
    versions: list[int]
    header: VersionHeader  # the last version's header
    plans: list[scatter_ops.ScatterPlan] = field(default_factory=list)  # one per element width
    new_bits: list[torch.Tensor] = field(default_factory=list)
    old_bits: list[torch.Tensor] = field(default_factory=list)  # the rollback buffer
    partials: dict[str, int] = field(default_factory=dict)  # Σ w(p)(new - old) over owned elements
    nnz: int = 0  # local elements written
    bytes: int = 0  # staged device bytes (offsets + new + old values)
    timings: dict[str, float] = field(default_factory=dict)
    committed: bool = False

    @property
    def version(self) -> int:
        return self.versions[-1]


class _Timer:
    def __init__(self, timings: dict[str, float], device: torch.device):
        self.timings, self.device = timings, device

    def __call__(self, key: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                if timer.device.type == "cuda":
                    torch.cuda.synchronize(timer.device)
                timer.timings[key] = timer.timings.get(key, 0.0) + (time.perf_counter() - self.t0) * 1e3

        return _Span()


class ApplyEngine:
    def __init__(self, targets: dict[str, torch.Tensor], layout: Layout, device: torch.device | str | None = None):
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

    # -- checksums -------------------------------------------------------------------------
    def live_sums(self, names=None) -> dict[str, int]:
        """Per HF tensor: positional sum of the live bits over this engine's owned elements."""
        out = {}
        for name in names or self.layout.hf_shapes:
            total = 0
            for seg in self.layout.segments.get(name, ()):
                if seg.owner:
                    total += self._segment_sum(name, seg)
            out[name] = total & MASK64
        return out

    def _segment_sum(self, name, seg) -> int:
        _, cols = hf_2d(self.layout.hf_shapes[name])
        flat = self.flats[seg.target]
        block = max(1, (1 << 22) // max(seg.cols, 1))
        total = 0
        c = torch.arange(seg.cols, dtype=torch.int64, device=flat.device)
        for r0 in range(0, seg.rows, block):
            r = torch.arange(r0, min(seg.rows, r0 + block), dtype=torch.int64, device=flat.device).unsqueeze(1)
            pos = ((seg.row0 + r) * cols + seg.col0 + c).reshape(-1)
            dst = (seg.dst_offset + r * seg.dst_row_stride + c * seg.dst_col_stride).reshape(-1)
            total += positional_sum(flat[dst], pos)
        return total & MASK64

    # -- staging ---------------------------------------------------------------------------
    def _check_entry(self, header: VersionHeader, name: str, entry) -> None:
        shape = self.layout.hf_shapes.get(name)
        if shape is None:
            raise UnsupportedModelError(
                "the version holds a tensor this model does not load", version=header.version, tensor=name
            )
        if tuple(entry.shape) != tuple(shape):
            raise ShapeMismatchError(
                f"shape {entry.shape} != model shape {list(shape)}", version=header.version, tensor=name
            )
        segs = self.layout.segments.get(name, ())
        if segs and self.flats[segs[0].target].element_size() != entry.torch_dtype.itemsize:
            raise ShapeMismatchError(
                f"dtype {entry.dtype} does not match the model's {self.targets[segs[0].target].dtype}",
                version=header.version,
                tensor=name,
            )

    def _local(self, name: str, positions: torch.Tensor):
        """Positions this engine holds, and the live bits there (read through the first segment)."""
        keep = torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
        old = None
        for seg, mask, dst in self.layout.translate(name, positions):
            fresh = mask & ~keep
            if old is None:
                old = torch.zeros(positions.shape, dtype=self.flats[seg.target].dtype, device=positions.device)
            if bool(fresh.any()):
                old[fresh] = self.flats[seg.target][dst[fresh[mask]]]
            keep |= mask
        if old is None:
            return keep, torch.empty(0, dtype=torch.int16, device=positions.device)
        return keep, old[keep]

    def _owned(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        owned = torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
        for seg, mask, _ in self.layout.translate(name, positions):
            if seg.owner:
                owned |= mask
        return owned

    def stage(self, files: list[VersionFile]) -> StagedUpdate:
        """Prepare the versions in `files` (in order) for one in-place commit. Writes nothing."""
        if not files:
            raise ValueError("nothing to stage")
        timings: dict[str, float] = {}
        span = _Timer(timings, self.device)
        # HF name -> (sorted positions, final bits, live bits) for this engine's elements.
        pending: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for i, vf in enumerate(files):
            h = vf.header
            if h.kind == "anchor" and i:
                pending.clear()  # an anchor replaces everything before it
            for name, entry in h.tensors.items():
                self._check_entry(h, name, entry)
                if h.kind == "anchor":
                    with span("anchor_diff"):
                        self._stage_anchor(vf, name, pending)
                    continue
                if entry.nnz == 0:
                    continue
                ctx = {"version": h.version, "tensor": name}
                codec = codecs.get_codec(h.codec, ctx)
                with span("read"):
                    sections = codec.unpack(
                        vf.parts(name), entry.enc, numel=entry.numel, nnz=entry.nnz, dtype=entry.torch_dtype, ctx=ctx
                    )
                with span("decode"):
                    changes = codec.finish(sections, numel=entry.numel, device=self.device, ctx=ctx)
                with span("translate"):
                    self._stage_changes(name, changes, pending)
        return self._finish_stage(files, pending, timings, span)

    def _stage_changes(self, name, changes: codecs.Changes, pending) -> None:
        keep, live = self._local(name, changes.positions)
        pos = changes.positions[keep]
        prev = pending.get(name)
        base = live
        if prev is not None and pos.numel():
            # Earlier versions of this update already changed some positions: build on those.
            idx = torch.searchsorted(prev[0], pos).clamp_(max=max(prev[0].numel() - 1, 0))
            hit = prev[0][idx] == pos if prev[0].numel() else torch.zeros_like(pos, dtype=torch.bool)
            base = torch.where(hit, prev[1][idx], live)
        local = codecs.Changes(
            positions=pos,
            values=None if changes.values is None else changes.values[keep],
            diffs=None if changes.diffs is None else changes.diffs[keep],
        )
        new = local.new_bits(base)
        pending[name] = _merge(prev, pos, new, live)

    def _stage_anchor(self, vf: VersionFile, name: str, pending) -> None:
        dense = codecs.int_view(vf.dense(name)).reshape(-1)
        for seg in self.layout.segments.get(name, ()):
            for pos, dst in _segment_blocks(self.layout, name, seg, self.device):
                live = self.flats[seg.target][dst]
                new = dense[pos.cpu()].to(self.device)
                diff = new != live
                if bool(diff.any()):
                    pending[name] = _merge(pending.get(name), pos[diff], new[diff], live[diff])

    def _finish_stage(self, files, pending, timings, span) -> StagedUpdate:
        staged = StagedUpdate(versions=[vf.version for vf in files], header=files[-1].header, timings=timings)
        by_width: dict[int, tuple[list, list, list]] = {}
        with span("plan"):
            for name, (pos, new, live) in pending.items():
                owned = self._owned(name, pos)
                staged.partials[name] = (
                    positional_sum(new[owned], pos[owned]) - positional_sum(live[owned], pos[owned])
                ) & MASK64
                for seg, mask, dst in self.layout.translate(name, pos):
                    if not bool(mask.any()):
                        continue
                    ids, offs, bits = by_width.setdefault(self.flats[seg.target].element_size(), ([], [], []))
                    ids.append(torch.full((dst.numel(),), seg.target, dtype=torch.int64, device=dst.device))
                    offs.append(dst)
                    bits.append(new[mask])
            for width, (ids, offs, bits) in by_width.items():
                plan = scatter_ops.build_plan(self.targets, torch.cat(ids), torch.cat(offs))
                new_bits = torch.cat(bits)[plan.order] if plan.order is not None else torch.cat(bits)
                staged.plans.append(plan)
                staged.new_bits.append(new_bits)
                staged.old_bits.append(scatter_ops.gather(plan))
                staged.nnz += plan.nnz
                staged.bytes += plan.nnz * (8 + 2 * width)
        return staged

    # -- the pause -------------------------------------------------------------------------
    def commit(self, staged: StagedUpdate) -> float:
        """Write the staged bits in place. On any failure, restore what was written and re-raise."""
        t0 = time.perf_counter()
        done = 0
        try:
            for plan, bits in zip(staged.plans, staged.new_bits):
                scatter_ops.scatter_(plan, bits)
                done += 1
            self._sync()
        except BaseException:
            for plan, bits in list(zip(staged.plans, staged.old_bits))[: done + 1]:
                scatter_ops.scatter_(plan, bits)
            self._sync()
            raise
        staged.committed = True
        return (time.perf_counter() - t0) * 1e3

    def rollback(self, staged: StagedUpdate) -> None:
        """Restore the bits a committed update replaced."""
        for plan, bits in zip(staged.plans, staged.old_bits):
            scatter_ops.scatter_(plan, bits)
        self._sync()
        staged.committed = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _segment_blocks(layout: Layout, name: str, seg, device, block_elems: int = 1 << 22):
    """(HF positions, target offsets) of a segment in row blocks, bounding temporary memory."""
    _, cols = hf_2d(layout.hf_shapes[name])
    block = max(1, block_elems // max(seg.cols, 1))
    c = torch.arange(seg.cols, dtype=torch.int64, device=device)
    for r0 in range(0, seg.rows, block):
        r = torch.arange(r0, min(seg.rows, r0 + block), dtype=torch.int64, device=device).unsqueeze(1)
        yield (
            ((seg.row0 + r) * cols + seg.col0 + c).reshape(-1),
            (seg.dst_offset + r * seg.dst_row_stride + c * seg.dst_col_stride).reshape(-1),
        )


def _merge(prev, pos, new, live):
    """Union of pending changes; later values win, the earliest live value is kept for rollback."""
    if prev is None or prev[0].numel() == 0:
        return pos, new, live
    all_pos = torch.cat([prev[0], pos])
    all_new = torch.cat([prev[1], new])
    all_live = torch.cat([prev[2], live])
    order = torch.sort(all_pos, stable=True).indices
    all_pos, all_new, all_live = all_pos[order], all_new[order], all_live[order]
    last = torch.ones_like(all_pos, dtype=torch.bool)
    last[:-1] = all_pos[1:] != all_pos[:-1]
    first = torch.ones_like(all_pos, dtype=torch.bool)
    first[1:] = all_pos[1:] != all_pos[:-1]
    return all_pos[last], all_new[last], all_live[first]


def verify_partials(current_sums: dict[str, int], partials: list[dict[str, int]], expected: VersionHeader) -> None:
    """Check that current per-tensor sums plus every rank's staged partials give the header's sums."""
    for name, entry in expected.tensors.items():
        have = current_sums.get(name, 0)
        for p in partials:
            have += p.get(name, 0)
        if (have & MASK64) != int(entry.checksum, 16):
            raise ChecksumMismatchError(
                f"staged result would have checksum {have & MASK64:016x}, the publisher recorded {entry.checksum}",
                version=expected.version,
                tensor=name,
            )
