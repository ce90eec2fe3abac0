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

from dataclasses import dataclass, field

import torch


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


def full_segment(target: int, shape, *, owner: bool = True) -> Segment:
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

    def translate(self, name: str, positions: torch.Tensor):
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

    def segment_elements(self, name: str, seg: Segment, device=None):
        """All (HF flat positions, target flat offsets) of one segment, row-major."""
        _, cols = hf_2d(self.hf_shapes[name])
        r = torch.arange(seg.rows, dtype=torch.int64, device=device).unsqueeze(1)
        c = torch.arange(seg.cols, dtype=torch.int64, device=device).unsqueeze(0)
        pos = ((seg.row0 + r) * cols + seg.col0 + c).reshape(-1)
        dst = (seg.dst_offset + r * seg.dst_row_stride + c * seg.dst_col_stride).reshape(-1)
        return pos, dst
