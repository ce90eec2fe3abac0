"""Rank blocks (issue 35 item 3): the chunked file laid out so that a tensor-parallel rank decodes only
the chunks of its share.

vLLM splits a model over TP ranks by rows (column-parallel layers: q/k/v, gate/up, the embeddings) or
by columns (row-parallel layers: o_proj, down_proj), evenly; TP 2, 4 and 8 cut every such tensor at
the boundaries of 8 equal *blocks* (block b of n rows or columns: [ceil(b·n/8), ceil((b+1)·n/8))). A
file with rank blocks (docs/FORMAT.md, format 5, `blocks`) orders its changed elements by *region*:
region 0 holds the tensors that are not split (norms, biases, the router, anything else), whole, then
region 1 + b holds block b of every split tensor, one tensor after the other. Each region is cut into
chunks of its own (its last chunk short), so a TP=2 rank reads regions 0-4 or 0 and 5-8, a TP=8 rank
regions 0 and 1 + r: a contiguous range of chunks, whatever the model's tensor count. Inside a block
the elements keep their positions (row-major; a column block's gaps skip the other blocks' columns).

Which tensors are split, and how, is a rule on their names (`split_kind`, Hugging Face checkpoint names
of Llama/Qwen-style models and their experts); a wrong guess costs decoding time, never correctness:
the file records each tensor's split, and a reader decodes the blocks its own layout needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

RANK_BLOCKS = 8  # blocks per split tensor: the boundaries of TP 2, 4 and 8
WHOLE, ROWS, COLS = 0, 1, 2  # a tensor's split: none (region 0), by rows of dim 0, by columns (its row size)
SPAN_COLUMNS = 4  # a `spans` row: tensor (header index), split, block, elements
_BY_COLUMNS = ("o_proj.weight", "down_proj.weight", "down_proj.weight_scale")  # row-parallel in vLLM
_BY_ROWS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "embed_tokens.weight",
    "lm_head.weight",
)


def split_kind(name: str, shape: Sequence[int], blocks: int = RANK_BLOCKS) -> int:
    """How servers split tensor `name` over TP ranks (WHOLE, ROWS or COLS): a 2-D tensor of a column-
    or row-parallel layer with at least `blocks` rows (columns); every other tensor is WHOLE."""
    if blocks <= 1 or len(shape) != 2:
        return WHOLE
    if name.endswith(_BY_COLUMNS) and int(shape[1]) >= blocks:
        return COLS
    if name.endswith(_BY_ROWS) and int(shape[0]) >= blocks:
        return ROWS
    return WHOLE


def edge(b: np.ndarray | int, n: np.ndarray | int, blocks: int) -> np.ndarray:
    """The first row (column) of block b of n: ceil(b·n / blocks), elementwise."""
    return -((-np.asarray(b, dtype=np.int64) * np.asarray(n, dtype=np.int64)) // blocks)


def regions_of(
    positions: torch.Tensor,
    seg: torch.Tensor,
    kind: torch.Tensor,
    rows: torch.Tensor,
    row_size: torch.Tensor,
    blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element's region (int64: 0 for a WHOLE tensor's, 1 + its block for a split tensor's) and its
    position as the file writes it: a column block's in the block's own coordinates, q = r·w + (c - c0)
    for the block's first column c0 and width w (its gaps then skip no other block's columns); every
    other position as it is. `seg` indexes the per-tensor device columns `kind`, `rows` (dim 0) and
    `row_size`."""
    k, n, c = kind[seg], rows[seg].clamp(min=1), row_size[seg].clamp(min=1)
    r = torch.div(positions, c, rounding_mode="floor")
    col = positions - r * c
    block = torch.where(
        k == ROWS, torch.div(r * blocks, n, rounding_mode="floor"), torch.div(col * blocks, c, rounding_mode="floor")
    ).clamp_(0, blocks - 1)
    region = torch.where(k == WHOLE, torch.zeros_like(block), block + 1)
    c0 = torch.div(block * c + blocks - 1, blocks, rounding_mode="floor")  # ceil(b·C/8)
    width = torch.div((block + 1) * c + blocks - 1, blocks, rounding_mode="floor") - c0
    return region, torch.where(k == COLS, r * width + (col - c0), positions)


def from_block_positions(
    q: torch.Tensor, c0: torch.Tensor, width: torch.Tensor, row_size: torch.Tensor
) -> torch.Tensor:
    """`regions_of`'s positions undone for column-block elements (`width` > 0: the block's; 0: positions as they
    are), elementwise: p = (q // w)·C + c0 + q % w."""
    w = width.clamp(min=1)
    r = torch.div(q, w, rounding_mode="floor")
    return torch.where(width > 0, r * row_size + c0 + (q - r * w), q)


def span_bounds(
    kind: np.ndarray,
    block: np.ndarray,
    rows: np.ndarray,
    row_size: np.ndarray,
    r0: np.ndarray,
    r1: np.ndarray,
    blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Where block `block` of each tensor's rows [r0, r1) (a part's, or all) lies, as positions
    [start, stop): its first position (where its gap chain starts) and one past its last; a column
    block's in its own coordinates (`regions_of`). A WHOLE tensor's (block ignored): [r0·C, r1·C).
    Empty (start = stop) where the rows hold none of the block."""
    c = row_size
    whole = (r0 * c, r1 * c)
    b0, b1 = edge(block, rows, blocks), edge(block + 1, rows, blocks)
    lo, hi = np.maximum(b0, r0), np.minimum(b1, r1)
    by_rows = (lo * c, np.maximum(hi, lo) * c)
    width = edge(block + 1, c, blocks) - edge(block, c, blocks)
    by_cols = (r0 * width, np.maximum(r1, r0) * width)  # in the block's own coordinates (regions_of)
    start = np.select([kind == ROWS, kind == COLS], [by_rows[0], by_cols[0]], whole[0])
    stop = np.select([kind == ROWS, kind == COLS], [by_rows[1], by_cols[1]], whole[1])
    return start.astype(np.int64), stop.astype(np.int64)


def cols_meet(
    kind: np.ndarray, block: np.ndarray, row_size: np.ndarray, c0: np.ndarray, c1: np.ndarray, blocks: int
) -> np.ndarray:
    """Whether a column block meets the columns [c0, c1) a layout holds of its tensor (True for the
    other splits: their need is a range of positions)."""
    b0, b1 = edge(block, row_size, blocks), edge(block + 1, row_size, blocks)
    out: np.ndarray = (kind != COLS) | ((b0 < c1) & (b1 > c0))
    return out


@dataclass
class BlockLayout:
    """A writer's tensors (in its batch's order) by split: their kinds, shapes as rows x row size,
    and the rows [row0, row1) it owns of each (a part's, or all). Made once per tensor set and share
    (the codec keeps it: `ChunkedCodec.stream`), with its per-piece starts and device columns."""

    blocks: int
    kinds: np.ndarray
    rows: np.ndarray
    row_size: np.ndarray
    row0: np.ndarray
    row1: np.ndarray
    _starts: tuple[np.ndarray, np.ndarray] | None = None  # (starts given, piece starts), the last asked for
    _columns: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def of(
        cls, tensors: Sequence[tuple[str, Sequence[int], int, int]], blocks: int = RANK_BLOCKS
    ) -> BlockLayout | None:
        """(name, shape, row0, row1) per tensor; None when no tensor is split (the file needs no blocks)."""
        kinds = np.array([split_kind(n, s, blocks) for n, s, _, _ in tensors], dtype=np.int64)
        if not (kinds != WHOLE).any():
            return None
        rows = np.array([int(s[0]) if len(s) else 1 for _, s, _, _ in tensors], dtype=np.int64)
        size = np.array([math.prod(s[1:]) if len(s) > 1 else 1 for _, s, _, _ in tensors], dtype=np.int64)
        r0 = np.array([a for _, _, a, _ in tensors], dtype=np.int64)
        r1 = np.array([b for _, _, _, b in tensors], dtype=np.int64)
        return cls(blocks, kinds, rows, size.astype(np.int64), r0, r1)

    @property
    def tensors(self) -> int:
        return int(self.kinds.size)

    def piece_starts(self, starts: np.ndarray) -> np.ndarray:
        """Where each piece's gap chain starts ([(blocks + 1) x tensors], region-major): region 0 the
        tensors' own `starts`, region 1 + b each split tensor's block b in its rows."""
        if self._starts is not None and np.array_equal(self._starts[0], starts):
            return self._starts[1]
        out = [starts.astype(np.int64)]
        for b in range(self.blocks):
            block = np.full(self.tensors, b, dtype=np.int64)
            first, _ = span_bounds(self.kinds, block, self.rows, self.row_size, self.row0, self.row1, self.blocks)
            out.append(np.where(self.kinds == WHOLE, 0, first))
        self._starts = (starts.copy(), np.concatenate(out))
        return self._starts[1]

    def device_columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kind, rows, row size) per tensor on `device` (what `regions_of` reads)."""
        key = str(device)
        if key not in self._columns:
            host = torch.from_numpy(np.stack([self.kinds, self.rows, self.row_size]))
            kind, rows, size = host.to(device)
            self._columns[key] = (kind, rows, size)
        return self._columns[key]

    def enc(self, counts: np.ndarray) -> dict[str, Any]:
        """The file-level metadata of rank blocks: the blocks, and each region's elements."""
        return {"blocks": self.blocks, "regions": counts.reshape(self.blocks + 1, -1).sum(axis=1).tolist()}

    def spans(self, counts: np.ndarray, tensor_rows: np.ndarray) -> torch.Tensor:
        """The split tensors' non-empty pieces in file order, int32 [S, 4]: header row, split, block, elements."""
        per = counts.reshape(self.blocks + 1, -1)[1:]  # [blocks, tensors]
        block, tensor = np.nonzero(per)  # row-major: block after block, tensors in order within
        rows = np.stack([tensor_rows[tensor], self.kinds[tensor], block, per[block, tensor]], axis=1)
        return torch.from_numpy(rows.astype(np.int32).reshape(-1, SPAN_COLUMNS))


__all__ = [
    "BlockLayout",
    "COLS",
    "RANK_BLOCKS",
    "ROWS",
    "SPAN_COLUMNS",
    "WHOLE",
    "cols_meet",
    "edge",
    "from_block_positions",
    "regions_of",
    "span_bounds",
    "split_kind",
]
