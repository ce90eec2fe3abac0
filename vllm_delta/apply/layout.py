"""Where each Hugging Face tensor's elements live in the local (engine-side) parameters.

An HF tensor is seen as a 2-D array (rows, cols): (prod(shape[:-1]), shape[-1]), or (n, 1) for
1-D tensors. A `Segment` maps a box of it to a strided region of one local target tensor:

    HF flat position p = r * cols + c,  row0 <= r < row0 + rows,  col0 <= c < col0 + cols
    -> target element   dst_offset + (r - row0) * dst_row_stride + (c - col0) * dst_col_stride

(element offsets into the target's flat storage). This covers fused parameters (qkv_proj,
gate_up_proj: a row box at a row offset), tensor-parallel shards (row or column boxes), vocab
padding (a prefix of rows) and tied embeddings (two segments). `owner` marks the one copy of each
element that counts in checksums (replicated tensors exist on every tensor-parallel rank).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..codec.decoding import Runs
from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class Segment:
    target: int
    row0: int
    rows: int
    col0: int
    cols: int
    dst_offset: int
    dst_row_stride: int
    dst_col_stride: int = 1
    owner: bool = True


def hf_2d(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return int(shape[0]), 1
    cols = int(shape[-1])
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, cols


def full_segment(target: int, shape: tuple[int, ...] | list[int], *, owner: bool = True) -> Segment:
    """The whole HF tensor, contiguous, at the start of the target."""
    rows, cols = hf_2d(shape)
    return Segment(target, 0, rows, 0, cols, 0, cols, 1, owner)


@dataclass
class Layout:
    """HF name -> segments, over a list of local targets (named, for messages and checks)."""

    targets: list[str]
    hf_shapes: dict[str, tuple[int, ...]]
    segments: dict[str, list[Segment]] = field(default_factory=dict)

    @classmethod
    def identity(cls, shapes: dict[str, tuple[int, ...]]) -> Layout:
        """Each HF tensor is its own target (trainer-side replicas, materialize, tests)."""
        names = list(shapes)
        return cls(
            targets=names,
            hf_shapes={n: tuple(s) for n, s in shapes.items()},
            segments={n: [full_segment(i, shapes[n])] for i, n in enumerate(names)},
        )

    def translate(self, name: str, positions: torch.Tensor) -> list[tuple[Segment, torch.Tensor, torch.Tensor]]:
        """HF flat positions -> [(segment, mask over positions, target flat offsets of the masked)]."""
        _, cols = hf_2d(self.hf_shapes[name])
        r = torch.div(positions, cols, rounding_mode="floor")
        c = positions - r * cols
        out = []
        for seg in self.segments.get(name, ()):
            mask = (r >= seg.row0) & (r < seg.row0 + seg.rows) & (c >= seg.col0) & (c < seg.col0 + seg.cols)
            dst = seg.dst_offset + (r[mask] - seg.row0) * seg.dst_row_stride + (c[mask] - seg.col0) * seg.dst_col_stride
            out.append((seg, mask, dst))
        return out

    def segment_elements(
        self, name: str, seg: Segment, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All (HF flat positions, target flat offsets) of one segment, row-major."""
        blocks = list(self.segment_blocks(name, seg, device, block_elems=max(1, seg.rows * seg.cols)))
        if not blocks:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return empty, empty
        return blocks[0]

    def segment_blocks(
        self, name: str, seg: Segment, device: torch.device | str | None = None, block_elems: int = 1 << 22
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """`segment_elements` in row blocks of about `block_elems`, bounding temporary memory."""
        _, cols = hf_2d(self.hf_shapes[name])
        block = max(1, block_elems // max(seg.cols, 1))
        c = torch.arange(seg.cols, dtype=torch.int64, device=device)
        for r0 in range(0, seg.rows, block):
            r = torch.arange(r0, min(seg.rows, r0 + block), dtype=torch.int64, device=device).unsqueeze(1)
            yield (
                ((seg.row0 + r) * cols + seg.col0 + c).reshape(-1),
                (seg.dst_offset + r * seg.dst_row_stride + c * seg.dst_col_stride).reshape(-1),
            )

    def is_row_run(self, name: str, seg: Segment) -> bool:
        """Whole rows of the HF tensor, contiguous in the target: one flat run on both sides."""
        _, cols = hf_2d(self.hf_shapes[name])
        return seg.col0 == 0 and seg.cols == cols and seg.dst_col_stride == 1 and seg.dst_row_stride == cols

    def check(self, target_numels: list[int]) -> None:
        """Every segment's box lies in its HF tensor and its strided region in its target (so that
        the apply engine can skip per-element range checks). Raises UnsupportedModelError."""
        for name, segs in self.segments.items():
            if name not in self.hf_shapes:
                raise UnsupportedModelError(f"layout has segments for {name!r} but no shape")
            rows, cols = hf_2d(self.hf_shapes[name])
            for s in segs:
                if not 0 <= s.target < len(target_numels):
                    raise UnsupportedModelError(f"segment of {name!r} names target {s.target} of {len(target_numels)}")
                if s.row0 < 0 or s.col0 < 0 or s.row0 + s.rows > rows or s.col0 + s.cols > cols:
                    raise UnsupportedModelError(f"segment box of {name!r} exceeds its shape {(rows, cols)}")
                if not s.rows or not s.cols:
                    continue
                ext = [(s.rows - 1) * s.dst_row_stride, (s.cols - 1) * s.dst_col_stride]
                lo = s.dst_offset + sum(min(0, e) for e in ext)
                hi = s.dst_offset + sum(max(0, e) for e in ext)
                if lo < 0 or hi >= target_numels[s.target]:
                    raise UnsupportedModelError(
                        f"segment of {name!r} reaches outside its target ({target_numels[s.target]} elements)"
                    )


# -- the layout on a device: vectorized translation of many positions at once ----------------------


class Selection(NamedTuple):
    """The elements of a chunk that one segment slot holds, and where they go."""

    mask: torch.Tensor | None  # bool per chunk element: held by this slot (None: all of them)
    target: torch.Tensor  # int64 per element: target index
    offset: torch.Tensor  # int64 per element: element offset in the target (0 where not held)
    owner: torch.Tensor | bool  # counts in checksums: per element, or one value for the whole chunk
    # With no mask and the chunk's runs known: the runs of equal `target`, on the host (target per
    # run, elements per run), so that a fused plan needs no device-to-host wait to find them.
    runs: TargetRuns | None = None


class TargetRuns(NamedTuple):
    """Consecutive elements of one target, in element order (host arrays)."""

    targets: np.ndarray  # int64 target index per run
    lengths: np.ndarray  # int64 elements per run (each > 0)

    @classmethod
    def merged(cls, targets: np.ndarray, lengths: np.ndarray) -> TargetRuns:
        """Runs of `lengths` elements going to `targets`, adjacent runs of one target merged."""
        keep = lengths > 0
        targets, lengths = targets[keep], lengths[keep]
        if not targets.size:
            return cls(targets.astype(np.int64), lengths.astype(np.int64))
        first = np.flatnonzero(np.r_[True, targets[1:] != targets[:-1]])
        return cls(targets[first].astype(np.int64), np.add.reduceat(lengths, first).astype(np.int64))


class SegmentTable:
    """Segment slot k of every HF tensor (layout order) as device arrays, plus host-side flags."""

    def __init__(self, layout: Layout, names: list[str], k: int, device: torch.device):
        columns: dict[str, list[int]] = {f: [] for f in _TABLE_FIELDS}
        self.valid: list[bool] = []  # the tensor has a k-th segment
        self.full: list[bool] = []  # ... which is the whole tensor as one flat run
        self.row_run: list[bool] = []  # ... which is whole rows as one flat run
        self.owner: list[bool] = []
        for name in names:
            segs = layout.segments.get(name, ())
            rows, cols = hf_2d(layout.hf_shapes[name])
            s = segs[k] if k < len(segs) else None
            run = s is not None and layout.is_row_run(name, s)
            self.valid.append(s is not None)
            self.row_run.append(run)
            self.full.append(run and s is not None and s.row0 == 0 and s.rows == rows)
            self.owner.append(s is not None and s.owner)
            if s is None:
                s = Segment(0, 0, 0, 0, 0, 0, 0, 0)
            values = {
                "target": s.target,
                "row0": s.row0,
                "rows": s.rows,
                "col0": s.col0,
                "cols": s.cols,
                "dst_offset": s.dst_offset,
                "dst_row_stride": s.dst_row_stride,
                "dst_col_stride": s.dst_col_stride,
                # row runs: HF positions [pos_lo, pos_hi) go to target offset p + shift
                "pos_lo": s.row0 * cols,
                "pos_hi": (s.row0 + s.rows) * cols,
                "shift": s.dst_offset - s.row0 * cols,
            }
            for f in _TABLE_FIELDS:
                columns[f].append(values[f])
        self.arrays = {
            f: torch.tensor(v, dtype=torch.int64).to(device) for f, v in columns.items()
        }  # name -> int64 per tensor
        self.target_h = np.array(columns["target"], dtype=np.int64)  # the target column, on the host
        self.shift_h = np.array(columns["shift"], dtype=np.int64)  # ... and the row runs' shift
        self.valid_t = torch.tensor(self.valid, dtype=torch.bool, device=device)
        self.owner_t = torch.tensor(self.owner, dtype=torch.bool, device=device)
        # the flags as arrays: a chunk's tensors are looked up at once (thousands in a MoE chunk)
        self.flags = np.array([self.valid, self.full, self.row_run, self.owner], dtype=bool).reshape(4, -1)


_TABLE_FIELDS = (
    "target",
    "row0",
    "rows",
    "col0",
    "cols",
    "dst_offset",
    "dst_row_stride",
    "dst_col_stride",
    "pos_lo",
    "pos_hi",
    "shift",
)


class DeviceLayout:
    """A `Layout` on a device: HF tensors in layout order, and (tensor index, HF position) pairs
    translated to (target, offset) for a whole chunk of elements at once.

    Every element of every HF tensor also has one *global id*: its tensor's start in the
    concatenation of all tensors (layout order) plus its position (chains merge by global id)."""

    def __init__(self, layout: Layout, device: torch.device):
        self.layout = layout
        self.device = device
        self.names = list(layout.hf_shapes)
        self.index = {n: i for i, n in enumerate(self.names)}
        numels = [math.prod(hf_2d(layout.hf_shapes[n])) for n in self.names]
        self.numels = np.array(numels, dtype=np.int64)  # elements of each HF tensor, layout order
        self.starts = [0, *itertools.accumulate(numels)][:-1]
        self.starts_t = torch.tensor(self.starts, dtype=torch.int64, device=device)
        cols = [hf_2d(layout.hf_shapes[n])[1] for n in self.names]
        self.cols_t = torch.tensor(cols, dtype=torch.int64, device=device)
        slots = max([len(s) for s in layout.segments.values()] + [1])
        self.tables = [SegmentTable(layout, self.names, k, device) for k in range(slots)]
        # the tensors one segment holds (no tied copy): a run the decoder knows is held needs no mask
        self.single = np.array([len(layout.segments.get(n, ())) == 1 for n in self.names], dtype=bool)
        # The positions each tensor's segments hold lie in [need_lo, need_hi) (empty: none): a rank's
        # rows of a tensor split by rows, every row of one split by columns. Staging hands them to the
        # decoder, which skips the chunks of other ranks' rows.
        self.need_lo = np.zeros(len(self.names), dtype=np.int64)
        self.need_hi = np.zeros(len(self.names), dtype=np.int64)
        # ... and its columns in [need_c0, need_c1) (a rank's columns of a tensor split by columns: a file
        # with rank blocks skips the other ranks' column blocks)
        self.need_c0 = np.zeros(len(self.names), dtype=np.int64)
        self.need_c1 = np.zeros(len(self.names), dtype=np.int64)
        for i, name in enumerate(self.names):
            segs = [s for s in layout.segments.get(name, ()) if s.rows and s.cols]
            if segs:
                self.need_lo[i] = min(s.row0 * cols[i] + s.col0 for s in segs)
                self.need_hi[i] = max((s.row0 + s.rows - 1) * cols[i] + s.col0 + s.cols for s in segs)
                self.need_c0[i] = min(s.col0 for s in segs)
                self.need_c1[i] = max(s.col0 + s.cols for s in segs)
        self.caches: dict[str, dict[Any, Any]] = {}  # what depends only on this layout (staging's tables)

    def split_global(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Runs]:
        """Sorted global ids -> (tensor index, position, runs of the tensors)."""
        t_idx = torch.searchsorted(self.starts_t, ids, right=True) - 1
        uniq, counts = torch.unique_consecutive(t_idx, return_counts=True)
        return t_idx, ids - self.starts_t[t_idx], Runs(uniq.cpu().numpy(), counts.cpu().numpy())

    def _runs(
        self, tab: SegmentTable, ts: np.ndarray, counts: np.ndarray | None, held: np.ndarray | None
    ) -> tuple[TargetRuns | None, bool]:
        """A slot's target runs of a chunk (with `counts`), and whether the decoder says every element
        lies in the one segment that holds its tensor (`translate`)."""
        runs = None if counts is None else TargetRuns.merged(tab.target_h[ts], np.asarray(counts))
        valid = tab.flags[0, ts]
        all_held = held is not None and runs is not None and bool((valid & self.single[ts] & held).all())
        return runs, all_held

    @staticmethod
    def _shifted(tab: SegmentTable, ts: np.ndarray, all_held: bool) -> bool:
        """Every element of the chunk goes to target offset p + shift of its tensor, no mask (`translate`)."""
        valid, full, row_run = tab.flags[:3, ts]
        return bool((valid & full).all() or (all_held and (valid & row_run).all()))

    def whole_runs(
        self, tensors: np.ndarray, counts: np.ndarray, held: np.ndarray | None = None
    ) -> tuple[SegmentTable, TargetRuns, bool] | None:
        """Where `translate` returns exactly one Selection, of every element, at offsets p + shift, with
        its target runs and one owner for the whole chunk: (its segment table, the runs, the owner),
        decided on the host from the same flags; else None."""
        ts = np.asarray(tensors, dtype=np.int64)
        used = [tab for tab in self.tables if tab.flags[0, ts].any()]
        if len(used) != 1:
            return None
        tab = used[0]
        runs, all_held = self._runs(tab, ts, counts, held)
        if runs is None or not self._shifted(tab, ts, all_held):
            return None
        mine = tab.flags[3, ts][tab.flags[0, ts]]
        if not (mine == mine[0]).all():
            return None
        return tab, runs, bool(mine[0])

    def translate(
        self,
        t_idx: torch.Tensor,
        p: torch.Tensor,
        tensors: Sequence[int] | np.ndarray,
        counts: np.ndarray | None = None,
        held: np.ndarray | None = None,
    ) -> list[Selection]:
        """One Selection per segment slot that any of `tensors` (the chunk's tensor indices) uses.
        With `counts` (the chunk's elements of each of `tensors`, which come in element order), a
        Selection of every element carries its target runs (`Selection.runs`). With `held` (per run:
        the decoder knows its elements lie in the layout's share of the tensor: `Runs.held`), a slot
        that alone holds tensors split over ranks needs no mask either: no device-to-host wait."""
        out = []
        ts = np.asarray(tensors, dtype=np.int64)
        for tab in self.tables:
            valid, full, row_run, owners = tab.flags[:, ts]
            if not valid.any():
                continue
            a = tab.arrays
            target = a["target"][t_idx]
            mine = owners[valid]
            owner: torch.Tensor | bool = bool(mine[0]) if (mine == mine[0]).all() else tab.owner_t[t_idx]
            runs, all_held = self._runs(tab, ts, counts, held)
            if self._shifted(tab, ts, all_held):
                out.append(Selection(None, target, p + a["shift"][t_idx], owner, runs))
            elif all_held:  # every element in its (one) box: the box's offsets, no mask
                cols = self.cols_t[t_idx]
                r = torch.div(p, cols, rounding_mode="floor")
                offset = a["dst_offset"][t_idx] + (r - a["row0"][t_idx]) * a["dst_row_stride"][t_idx]
                offset += (p - r * cols - a["col0"][t_idx]) * a["dst_col_stride"][t_idx]
                out.append(Selection(None, target, offset, owner, runs))
            elif (valid & row_run).all():
                mask = (p >= a["pos_lo"][t_idx]) & (p < a["pos_hi"][t_idx])
                out.append(Selection(mask, target, p + a["shift"][t_idx], owner))
            else:
                cols = self.cols_t[t_idx]
                r = torch.div(p, cols, rounding_mode="floor")
                c = p - r * cols
                row0, col0 = a["row0"][t_idx], a["col0"][t_idx]
                mask = (
                    tab.valid_t[t_idx]
                    & (r >= row0)
                    & (r < row0 + a["rows"][t_idx])
                    & (c >= col0)
                    & (c < col0 + a["cols"][t_idx])
                )
                offset = a["dst_offset"][t_idx] + (r - row0) * a["dst_row_stride"][t_idx]
                offset += (c - col0) * a["dst_col_stride"][t_idx]
                out.append(Selection(mask, target, offset.masked_fill_(~mask, 0), owner))
        return out
