"""The apply engine: stage versions before the pause, commit them in place inside it, roll back.

Plain tensors in, plain tensors out: the engine knows nothing of vLLM. It holds the live target
tensors (written in place, never rebound) and a `Layout` (HF tensor -> local segments).

    staged = engine.stage([vfile, ...])   # decode, translate, gather old values, new values,
                                          # per-tensor checksum partials; nothing is written
    verify_partials(sums, [staged.partials, ...], header)   # all ranks together; raises on mismatch
    engine.commit(staged)                 # the pause: one fused scatter per element width
    engine.rollback(staged)               # restore the previous bits exactly

Several versions stage into one update (a chain: deltas in order, or an anchor and its deltas),
so a reader several versions behind catches up in one pause.

Backends (scatter.py): on CUDA the fused kernels, "cuda" (csrc/, built with torch's extension
builder the first time an engine is created on a machine, ~30 s, then cached) when it builds, else
"triton"; on CPU the torch path. `backend=` or VLLM_DELTA_SCATTER_BACKEND chooses. Kernels are
compiled/loaded during `stage` (a no-op write of one block), never inside `commit`.

Staging (everything but the write) runs on a side CUDA stream while the server keeps generating:
read + zstd decode on a thread pool into pinned memory, one host-to-device copy, then on the
device, chunk by chunk (bounded memory): positions from gaps, HF -> local translation (vectorized
over all tensors), the live bits at the changed places (the rollback buffer), new bits from ULP
differences, checksum partials, and the fused scatter plan. `commit` is then one kernel launch per
element width (backends: scatter.py). On CPU the torch path does the same with grouped plans.
Memory: `StagedUpdate.memory` (8 B per changed bf16 element held until commit/release, ~2x that at
the peak of staging, 3 B per element of pinned host memory). A staged update records the engine
state it was staged against; committing it after another commit or rollback raises
NotSuccessorError (stage again).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from .. import codec as codecs
from ..checksum import MASK64, positional_sum
from ..errors import ChecksumMismatchError, NotSuccessorError, ShapeMismatchError, UnsupportedModelError
from ..format import VersionFile, VersionHeader
from . import scatter as scatter_ops
from .layout import Layout, hf_2d
from .staging import CHUNK_ELEMS, Chunk, Decoder, Item

_K_SIGNED = 0x9E3779B97F4A7C15 - (1 << 64)  # checksum weight constant (docs/FORMAT.md), as an int64
_UMASK = {2: 0xFFFF, 4: 0xFFFFFFFF}
_INT = {2: torch.int16, 4: torch.int32}
_STATE = itertools.count(1)


@dataclass
class StagedUpdate:
    versions: list[int]
    header: VersionHeader  # the last version's header
    plans: list[scatter_ops.ScatterPlan] = field(default_factory=list)  # one per element width
    new_bits: list[torch.Tensor] = field(default_factory=list)  # plan order
    old_bits: list[torch.Tensor] = field(default_factory=list)  # the rollback buffer, plan order
    partials: dict[str, int] = field(default_factory=dict)  # Σ w(p)(new - old) over owned elements
    nnz: int = 0  # local elements written
    bytes: int = 0  # staged device bytes (plans + new + old values)
    timings: dict[str, float] = field(default_factory=dict)  # ms per staging phase, and "total"
    committed: bool = False
    backend: str = "torch"
    memory: dict[str, int] = field(default_factory=dict)  # staging memory: device peak, held, host
    base_state: int = 0  # engine state this update was staged against
    state: int = 0  # engine state once committed

    @property
    def version(self) -> int:
        return self.versions[-1]


class _SegTable:
    """Segment k of every HF tensor, as device arrays indexed by tensor (layout order)."""

    FIELDS = ("target", "row0", "rows", "col0", "ccols", "dst", "drs", "dcs", "plo", "phi", "shift")

    def __init__(self, layout: Layout, names: list[str], k: int, device):
        rows = []
        self.valid_h, self.full_h, self.rowbox_h, self.owner_h = [], [], [], []
        for name in names:
            segs = layout.segments.get(name, ())
            r, cols = hf_2d(layout.hf_shapes[name])
            if k < len(segs):
                s = segs[k]
                rowbox = s.col0 == 0 and s.cols == cols and s.dst_col_stride == 1 and s.dst_row_stride == cols
                full = rowbox and s.row0 == 0 and s.rows == r
                rows.append([s.target, s.row0, s.rows, s.col0, s.cols, s.dst_offset, s.dst_row_stride,
                             s.dst_col_stride, s.row0 * cols, (s.row0 + s.rows) * cols, s.dst_offset - s.row0 * cols])
                self.valid_h.append(True)
                self.full_h.append(full)
                self.rowbox_h.append(rowbox)
                self.owner_h.append(bool(s.owner))
            else:
                rows.append([0] * len(self.FIELDS))
                self.valid_h += [False]
                self.full_h += [False]
                self.rowbox_h += [False]
                self.owner_h += [False]
        t = torch.tensor(rows, dtype=torch.int64).reshape(len(names), len(self.FIELDS)).T.contiguous().to(device)
        for i, f in enumerate(self.FIELDS):
            setattr(self, f, t[i])
        self.valid = torch.tensor(self.valid_h, dtype=torch.bool, device=device)
        self.owner = torch.tensor(self.owner_h, dtype=torch.bool, device=device)


@dataclass
class _Sel:
    mask: torch.Tensor | None  # elements in this segment (None: all)
    tid: torch.Tensor  # int64 target index per element
    local: torch.Tensor  # int64 target-local offset per element
    owner: torch.Tensor | bool


class _Out:
    """Staged output of one element width, accumulated chunk by chunk."""

    def __init__(self):
        self.plans, self.new, self.old = [], [], []
        self.ids, self.offs = [], []


class ApplyEngine:
    def __init__(
        self,
        targets: dict[str, torch.Tensor],
        layout: Layout,
        device: torch.device | str | None = None,
        *,
        backend: str | None = None,
        chunk_elems: int = CHUNK_ELEMS,
        threads: int | None = None,
        block: int = scatter_ops.BLOCK,
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
        self.block = block
        self.chunk_elems = chunk_elems
        # HF tensors in layout order; virtual offsets give every element one global id (chains).
        self._names = list(layout.hf_shapes)
        self._index = {n: i for i, n in enumerate(self._names)}
        numels = [hf_2d(layout.hf_shapes[n])[0] * hf_2d(layout.hf_shapes[n])[1] for n in self._names]
        self._vstart_h = [0] + list(itertools.accumulate(numels))[:-1]
        self._vstart = torch.tensor(self._vstart_h, dtype=torch.int64, device=self.device)
        self._cols = torch.tensor([hf_2d(layout.hf_shapes[n])[1] for n in self._names], dtype=torch.int64,
                                  device=self.device)
        _check_layout(layout, self.flats)
        kmax = max([len(s) for s in layout.segments.values()] + [1])
        self._tables = [_SegTable(layout, self._names, k, self.device) for k in range(kmax)]
        # Fused addressing, per element width: the base tensor and every target's offset from it.
        self._base: dict[int, int] = {}
        self._tbase: dict[int, torch.Tensor] = {}
        self._tbase_h: dict[int, list[int]] = {}
        self._wflats: dict[int, list] = {}
        for width in {f.element_size() for f in self.flats}:
            ids = [i for i, f in enumerate(self.flats) if f.element_size() == width and f.device == self.device]
            if not ids:
                continue
            b, deltas = scatter_ops.address_base([self.flats[i] for i in ids])
            self._base[width] = ids[b]
            tb = [0] * len(self.flats)
            for i, d in zip(ids, deltas):
                tb[i] = d
            self._tbase_h[width] = tb
            self._tbase[width] = torch.tensor(tb, dtype=torch.int64, device=self.device)
            keep = set(ids)
            self._wflats[width] = [f if i in keep else None for i, f in enumerate(self.flats)]
        self._decoder = Decoder(self.device, chunk_elems, threads)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._state = 0
        self._warm: set = set()

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
        if seg.col0 == 0 and seg.cols == cols and seg.dst_col_stride == 1 and seg.dst_row_stride == cols:
            n = seg.rows * cols  # a contiguous run of the target
            return positional_sum(flat[seg.dst_offset : seg.dst_offset + n], seg.row0 * cols)
        total = 0
        for pos, dst in _segment_blocks(self.layout, name, seg, flat.device):
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
        for seg in self.layout.segments.get(name, ()):
            if self.flats[seg.target].element_size() != entry.torch_dtype.itemsize:
                raise ShapeMismatchError(
                    f"dtype {entry.dtype} does not match the model's {self.targets[seg.target].dtype}",
                    version=header.version,
                    tensor=name,
                )

    def _stream_ctx(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else _nullctx()

    def _sync_stream(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def stage(self, files: list[VersionFile]) -> StagedUpdate:
        """Prepare the versions in `files` (in order) for one in-place commit. Writes nothing."""
        if not files:
            raise ValueError("nothing to stage")
        t_start = time.perf_counter()
        for vf in files:
            h = vf.header
            if h.kind == "delta":
                codecs.get_codec(h.codec, {"version": h.version})
            for name, entry in h.tensors.items():
                self._check_entry(h, name, entry)
        staged = StagedUpdate(
            versions=[vf.version for vf in files],
            header=files[-1].header,
            backend=self.backend,
            base_state=self._state,
        )
        timings = staged.timings
        mem0 = self._mem()
        self._mem_peak = mem0
        self._acc = torch.zeros(len(self._names), dtype=torch.int64, device=self.device)
        changed: set[int] = set()
        outs: dict[int, _Out] = {}
        with self._stream_ctx():
            if len(files) == 1 and files[0].header.kind == "delta":
                vf = files[0]
                for width, items in self._items(vf).items():
                    changed.update(it.index for it in items)
                    for chunk in self._decoder.decode(vf.version, vf.header.codec, items, width, timings):
                        self._emit(outs, width, chunk.t_idx, chunk.p, chunk.runs, chunk, timings)
                        self._note_mem()
            else:
                pending = self._stage_chain(files, timings, changed)
                for width, (P, new) in pending.items():
                    for s in range(0, P.numel(), self.chunk_elems):
                        p_glob, nb = P[s : s + self.chunk_elems], new[s : s + self.chunk_elems]
                        t_idx = torch.searchsorted(self._vstart, p_glob, right=True) - 1
                        uniq, counts = torch.unique_consecutive(t_idx, return_counts=True)
                        runs = list(zip(uniq.tolist(), counts.tolist()))
                        self._emit(outs, width, t_idx, p_glob - self._vstart[t_idx], runs, nb, timings)
                        self._note_mem()
            t0 = time.perf_counter()
            self._finish(staged, outs)
            self._sync_stream()
            t0 = _span(timings, "plan", t0)
            acc = self._acc.tolist()
            staged.partials = {self._names[i]: acc[i] & MASK64 for i in sorted(changed)}
            self._note_mem()
        self._acc = None
        staged.memory = {
            "device_peak_bytes": max(0, self._mem_peak - mem0),
            "device_held_bytes": staged.bytes,
            "host_bytes": self._decoder.host_bytes,
        }
        timings["total"] = (time.perf_counter() - t_start) * 1e3
        return staged

    def _items(self, vf: VersionFile) -> dict[int, list[Item]]:
        """Changed tensors this engine holds any of, by element width, in layout order."""
        h = vf.header
        by_width: dict[int, list[Item]] = {}
        for name, entry in h.tensors.items():
            if not entry.nnz or not self.layout.segments.get(name):
                continue
            item = Item(
                index=self._index[name],
                name=name,
                numel=entry.numel,
                nnz=entry.nnz,
                enc=entry.enc,
                parts=vf.parts(name),
                dtype=entry.torch_dtype,
            )
            by_width.setdefault(entry.torch_dtype.itemsize, []).append(item)
        for items in by_width.values():
            items.sort(key=lambda it: it.index)
        return by_width

    # -- translation: HF positions -> (target, local offset) per segment -------------------------
    def _translate(self, t_idx: torch.Tensor, p: torch.Tensor, tensors: list[int]) -> list[_Sel]:
        out = []
        for tab in self._tables:
            if not any(tab.valid_h[t] for t in tensors):
                continue
            tid = tab.target[t_idx]
            owners = {tab.owner_h[t] for t in tensors if tab.valid_h[t]}
            owner = owners.pop() if len(owners) == 1 else tab.owner[t_idx]
            if all(tab.valid_h[t] and tab.full_h[t] for t in tensors):
                out.append(_Sel(None, tid, p + tab.shift[t_idx], owner))
            elif all(tab.valid_h[t] and tab.rowbox_h[t] for t in tensors):
                mask = (p >= tab.plo[t_idx]) & (p < tab.phi[t_idx])
                out.append(_Sel(mask, tid, p + tab.shift[t_idx], owner))
            else:
                cols = self._cols[t_idx]
                r = torch.div(p, cols, rounding_mode="floor")
                c = p - r * cols
                row0, col0 = tab.row0[t_idx], tab.col0[t_idx]
                mask = (
                    tab.valid[t_idx]
                    & (r >= row0)
                    & (r < row0 + tab.rows[t_idx])
                    & (c >= col0)
                    & (c < col0 + tab.ccols[t_idx])
                )
                local = tab.dst[t_idx] + (r - row0) * tab.drs[t_idx] + (c - col0) * tab.dcs[t_idx]
                out.append(_Sel(mask, tid, local.masked_fill_(~mask, 0), owner))
        return out

    def _gather(self, width: int, tid: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Live bits at (target, local offset) pairs of one width."""
        if self.fused:
            addr = self._tbase[width][tid] + local
            return scatter_ops.gather_at(self.flats[self._base[width]], addr, self.backend)
        out = torch.empty(local.numel(), dtype=_INT[width], device=local.device)
        if local.numel():
            for t in torch.unique(tid).tolist():
                m = tid == t
                out[m] = self.flats[t][local[m]]
        return out

    def _emit(self, outs, width, t_idx, p, runs, source, timings) -> None:
        """Translate one chunk, read the live bits, make the new bits, checksum partials, plan it.

        `source`: a decoded Chunk (new bits from its values or diffs) or a tensor of new bits."""
        t0 = time.perf_counter()
        tensors = [t for t, m in runs if m]
        sels = self._translate(t_idx, p, tensors)
        t0 = self._span(timings, "translate", t0)
        n = p.numel()
        # Live bits through the first segment holding each element (elements held nowhere: 0).
        if not sels:
            return
        if sels[0].mask is None:
            live = self._gather(width, sels[0].tid, sels[0].local)
        else:
            live = self._live(width, sels, n)
        if isinstance(source, Chunk):
            new = source.values if source.values is not None else _add_wrap(live, source.diffs, width)
        else:
            new = source
        t0 = self._span(timings, "gather", t0)
        # Checksum partials over owned elements: Σ w(p) (bits(new) - bits(old)).
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
        if not everything and owned is None:
            owned = torch.zeros(n, dtype=torch.bool, device=p.device)
        umask = _UMASK[width]
        delta = (new.to(torch.int64) & umask) - (live.to(torch.int64) & umask)
        term = (p + 1).mul_(_K_SIGNED).mul_(delta)
        if not everything:
            term.masked_fill_(~owned, 0)
        # per-tensor sums: elements of a tensor are consecutive, so prefix sums at run ends (no atomics)
        runs = [(t, m) for t, m in runs if m]
        meta = torch.tensor([t for t, _ in runs] + list(itertools.accumulate(m for _, m in runs)), dtype=torch.int64)
        meta = meta.to(p.device, non_blocking=True)
        ends = torch.cumsum(term, 0)[meta[len(runs) :] - 1]
        self._acc.index_add_(0, meta[: len(runs)], torch.cat([ends[:1], ends[1:] - ends[:-1]]))
        del term, delta
        t0 = self._span(timings, "partials", t0)
        # Plan: every segment holding an element gets it; rollback bits read through that segment.
        out = outs.setdefault(width, _Out())
        for k, s in enumerate(sels):
            if s.mask is None:
                tid, local, nb = s.tid, s.local, new
                ob = live if k == 0 else self._gather(width, tid, local)
            else:
                idx = s.mask.nonzero().reshape(-1)
                if not idx.numel():
                    continue
                tid, local, nb = s.tid[idx], s.local[idx], new[idx]
                ob = live[idx] if k == 0 else self._gather(width, tid, local)
            if self.fused:
                plan = scatter_ops.fused_plan(
                    self._wflats[width],
                    self.flats[self._base[width]],
                    self._tbase_h[width],
                    self._tbase[width],
                    tid,
                    local,
                    block=self.block,
                )
                out.plans.append(plan)
                out.new.append(plan.arrange(nb))
                out.old.append(plan.arrange(ob))
            else:
                out.ids.append(tid)
                out.offs.append(local)
                out.new.append(nb)
                out.old.append(ob)
        self._span(timings, "plan", t0)

    def _finish(self, staged: StagedUpdate, outs: dict[int, _Out]) -> None:
        for width in sorted(outs):
            out = outs[width]
            if self.fused:
                if not out.plans:
                    continue
                plan = scatter_ops.cat_plans(out.plans)
                new, old = _cat(out.new), _cat(out.old)
                out.plans = out.new = out.old = None
                self._warmup(plan, old)
            else:
                if not out.ids:
                    continue
                plan = scatter_ops.build_plan(self.targets, _cat(out.ids), _cat(out.offs))
                new, old = plan.arrange(_cat(out.new)), plan.arrange(_cat(out.old))
            staged.plans.append(plan)
            staged.new_bits.append(new)
            staged.old_bits.append(old)
            staged.nnz += plan.nnz
            staged.bytes += plan.nbytes + new.numel() * new.element_size() + old.numel() * old.element_size()

    def _warmup(self, plan: scatter_ops.ScatterPlan, old: torch.Tensor) -> None:
        """Compile/load the commit kernel for this plan's types now, not inside the pause: write the
        first block's current bits back (no change)."""
        key = (plan.dtype, plan.rel.dtype)
        if key in self._warm or not plan.size:
            return
        first = scatter_ops.ScatterPlan(
            targets=plan.targets,
            bounds=[],
            offsets=None,
            base=plan.base,
            block=plan.block,
            block_base=plan.block_base[:1],
            rel=plan.rel[: plan.block],
            slots=None,
            target_base=plan.target_base,
            count=0,
        )
        scatter_ops.scatter_(first, old[: plan.block], self.backend)
        self._warm.add(key)

    # -- chains: several versions (and anchors) in one update ------------------------------------
    def _stage_chain(self, files, timings, changed) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{width: (sorted global ids V[t] + p, final new bits)} over every version of the chain."""
        pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for vf in files:
            if vf.header.kind == "anchor":
                pending = self._anchor_changes(vf, changed)
                continue
            for width, items in self._items(vf).items():
                changed.update(it.index for it in items)
                ps, news = [], []
                prev = pending.get(width)
                for chunk in self._decoder.decode(vf.version, vf.header.codec, items, width, timings):
                    P = self._vstart[chunk.t_idx] + chunk.p
                    if chunk.values is not None:
                        new = chunk.values
                    else:
                        sels = self._translate(chunk.t_idx, chunk.p, chunk.tensors)
                        live = self._live(width, sels, chunk.p.numel())
                        base = live
                        if prev is not None and prev[0].numel():
                            i = torch.searchsorted(prev[0], P).clamp_(max=prev[0].numel() - 1)
                            hit = prev[0][i] == P
                            base = torch.where(hit, prev[1][i], live)
                        new = _add_wrap(base, chunk.diffs, width)
                    ps.append(P)
                    news.append(new)
                if ps:
                    pending[width] = _merge(prev, torch.cat(ps), torch.cat(news))
        return pending

    def _live(self, width, sels, n) -> torch.Tensor:
        live = torch.zeros(n, dtype=_INT[width], device=self.device)
        keep = torch.zeros(n, dtype=torch.bool, device=self.device)
        for s in sels:
            sel = (s.mask if s.mask is not None else torch.ones_like(keep)) & ~keep
            idx = sel.nonzero().reshape(-1)
            if idx.numel():
                live[idx] = self._gather(width, s.tid[idx], s.local[idx])
            keep |= sel
        return live

    def _anchor_changes(self, vf: VersionFile, changed) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Elements whose anchor bits differ from the live bits, in global ids, by width."""
        parts: dict[int, tuple[list, list]] = {}
        for name in vf.header.tensors:
            segs = self.layout.segments.get(name, ())
            if not segs:
                continue
            t = self._index[name]
            changed.add(t)
            dense = codecs.int_view(vf.dense(name)).reshape(-1)
            width = dense.element_size()
            ps, vs = parts.setdefault(width, ([], []))
            for seg in segs:
                for pos, dst in _segment_blocks(self.layout, name, seg, self.device):
                    live = self.flats[seg.target][dst]
                    new = dense[pos.cpu()].to(self.device)
                    diff = new != live
                    if bool(diff.any()):
                        ps.append(pos[diff] + self._vstart_h[t])
                        vs.append(new[diff])
        out = {}
        for width, (ps, vs) in parts.items():
            if ps:
                out[width] = _merge(None, torch.cat(ps), torch.cat(vs))
        return out

    # -- the pause -------------------------------------------------------------------------
    def commit(self, staged: StagedUpdate) -> float:
        """Write the staged bits in place. On any failure, restore what was written and re-raise."""
        if staged.committed:
            raise ValueError(f"update to version {staged.version} is already committed")
        if staged.base_state != self._state:
            raise NotSuccessorError(
                "staged against other live weights (an update was committed or rolled back since): stage again",
                version=staged.version,
            )
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
        staged.committed = True
        staged.state = next(_STATE)
        self._state = staged.state
        return (time.perf_counter() - t0) * 1e3

    def rollback(self, staged: StagedUpdate) -> None:
        """Write back the bits the staged places held at staging time (whoever wrote them since: our
        commit or another path over the same elements). Roll back later updates first."""
        for plan, bits in zip(staged.plans, staged.old_bits):
            scatter_ops.scatter_(plan, bits, staged.backend)
        self._sync()
        staged.committed = False
        self._state = staged.base_state

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- bookkeeping -----------------------------------------------------------------------------
    def _span(self, timings: dict, key: str, t0: float) -> float:
        self._sync_stream()
        return _span(timings, key, t0)

    def _mem(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _note_mem(self) -> None:
        self._mem_peak = max(self._mem_peak, self._mem())


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check_layout(layout: Layout, flats: list[torch.Tensor]) -> None:
    """Every segment's box lies in its HF tensor and its strided region in its target (so that the
    engine can skip per-element range checks)."""
    for name, segs in layout.segments.items():
        if name not in layout.hf_shapes:
            raise UnsupportedModelError(f"layout has segments for {name!r} but no shape")
        rows, cols = hf_2d(layout.hf_shapes[name])
        for s in segs:
            if not 0 <= s.target < len(flats):
                raise UnsupportedModelError(f"segment of {name!r} names target {s.target} of {len(flats)}")
            if s.row0 < 0 or s.col0 < 0 or s.row0 + s.rows > rows or s.col0 + s.cols > cols:
                raise UnsupportedModelError(f"segment box of {name!r} exceeds its shape {(rows, cols)}")
            if not s.rows or not s.cols:
                continue
            ext = [(s.rows - 1) * s.dst_row_stride, (s.cols - 1) * s.dst_col_stride]
            lo = s.dst_offset + sum(min(0, e) for e in ext)
            hi = s.dst_offset + sum(max(0, e) for e in ext)
            if lo < 0 or hi >= flats[s.target].numel():
                raise UnsupportedModelError(
                    f"segment of {name!r} reaches outside its target ({flats[s.target].numel()} elements)"
                )


def _span(timings: dict, key: str, t0: float) -> float:
    t1 = time.perf_counter()
    timings[key] = timings.get(key, 0.0) + (t1 - t0) * 1e3
    return t1


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _add_wrap(bits: torch.Tensor, diffs: torch.Tensor, width: int) -> torch.Tensor:
    """(bits + diffs) mod 2^(8·width), as the signed integer type of that width."""
    wide = torch.int32 if width == 2 else torch.int64
    return (bits.to(wide) + diffs.to(wide)).to(_INT[width])


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


def _merge(prev, pos, new):
    """Union of pending changes (global ids, sorted); later values win."""
    if prev is not None and prev[0].numel():
        pos = torch.cat([prev[0], pos])
        new = torch.cat([prev[1], new])
    order = torch.sort(pos, stable=True).indices
    pos, new = pos[order], new[order]
    last = torch.ones_like(pos, dtype=torch.bool)
    last[:-1] = pos[1:] != pos[:-1]
    return pos[last], new[last]


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
