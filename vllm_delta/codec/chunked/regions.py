"""Reading a chunked file with rank blocks (blocks.py): each region as a file of its own (its chunks
uniform but its last, as the decoder reads every file), and each split tensor's pieces from the file's
`spans` (one piece per block it changed, with the positions the block can hold and those a layout
needs of it). The staging decoder reads the regions one after the other as one sequence of chunks and
skips the regions (and chunks) a tensor-parallel rank does not need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ...errors import CodecError
from ..base import Ctx, err
from ..decoding import FilePieces, PieceEncs
from .blocks import COLS, ROWS, SPAN_COLUMNS, cols_meet, edge, span_bounds
from .planes import COL_GAP_ESC, COL_MAG_ESC, FIRST_PART, FRAME_ALIGN, N_PLANES, SPANS_PART


def has_blocks(enc: Any) -> bool:
    return isinstance(enc, Mapping) and "blocks" in enc


def region_payloads(
    payload: Mapping[str, torch.Tensor], enc: Any, ctx: Ctx
) -> list[tuple[dict[str, torch.Tensor], dict[str, int]]]:
    """Each region's streams (sliced from the file's) and file metadata ({chunk_elems, elems}), in
    order. CodecError where the regions do not add up to the file's elements and chunks."""
    try:
        e, n, b = int(enc["chunk_elems"]), int(enc["elems"]), int(enc["blocks"])
        sizes = np.asarray([int(x) for x in enc["regions"]], dtype=np.int64)
    except (KeyError, TypeError, ValueError):
        raise err(CodecError, f"malformed rank-block metadata {dict(enc)!r:.200}", ctx) from None
    if e <= 0 or b < 2 or sizes.size != b + 1 or (sizes < 0).any() or int(sizes.sum()) != n:
        raise err(CodecError, f"{b} blocks, regions {sizes.tolist()[:12]} for {n} elements", ctx)
    index_t = payload.get("index")
    if index_t is None or index_t.dim() != 2 or index_t.dtype != torch.int64 or index_t.shape[1] <= COL_MAG_ESC:
        raise err(CodecError, "chunked payload lacks its index", ctx)
    index = index_t.numpy()
    chunks = -(-sizes // e)
    k_at = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    if int(k_at[-1]) != index.shape[0]:
        raise err(CodecError, f"index has {index.shape[0]} chunks, the regions {int(k_at[-1])}", ctx)
    comp = index[:, :N_PLANES]
    byte_at = np.concatenate([[0], np.cumsum((-(-comp // FRAME_ALIGN) * FRAME_ALIGN).sum(axis=1))])
    gap_at = np.concatenate([[0], np.cumsum(index[:, COL_GAP_ESC])])
    mag_at = np.concatenate([[0], np.cumsum(index[:, COL_MAG_ESC])])
    out = []
    for r in range(b + 1):
        k0, k1 = int(k_at[r]), int(k_at[r + 1])
        sub = {
            "blob": payload["blob"].reshape(-1)[int(byte_at[k0]) : int(byte_at[k1])],
            "index": index_t[k0:k1],
            "gap_esc": payload["gap_esc"].reshape(-1)[int(gap_at[k0]) : int(gap_at[k1])],
            "mag_esc": payload["mag_esc"].reshape(-1)[int(mag_at[k0]) : int(mag_at[k1])],
        }
        first = payload.get(FIRST_PART)
        if first is not None:
            sub[FIRST_PART] = first.reshape(-1)[k0:k1]
        out.append((sub, {"chunk_elems": e, "elems": int(sizes[r])}))
    return out


def file_spans(payload: Mapping[str, torch.Tensor], enc: Any, ctx: Ctx) -> np.ndarray:
    """The file's spans of split tensors, int64 [S, 5]: tensor (header index), split, block, elements and
    each one's first element in its region, checked against the regions (CodecError)."""
    b = int(enc["blocks"])
    regions = [int(x) for x in enc["regions"]]
    t = payload.get(SPANS_PART)
    if t is None or t.dim() != 2 or t.shape[1] != SPAN_COLUMNS:
        raise err(CodecError, "a file with rank blocks lacks its spans", ctx)
    spans = t.numpy().astype(np.int64)
    tensor, kind, block, nnz = spans.T
    bad = (tensor < 0) | ((kind != ROWS) & (kind != COLS)) | (block < 0) | (block >= b) | (nnz <= 0)
    if bad.any() or (np.diff(block) < 0).any():
        raise err(CodecError, "malformed spans (tensor, split, block, elements) or out of block order", ctx)
    totals = np.bincount(block, weights=nnz, minlength=b).astype(np.int64)
    if totals.tolist() != regions[1:]:
        raise err(CodecError, f"spans hold {totals.tolist()} elements per block, the regions {regions[1:]}", ctx)
    ends = np.cumsum(nnz)
    region_at = np.concatenate([[0], np.cumsum(totals)])[:-1]
    at = ends - nnz - region_at[block]
    return np.column_stack([spans, at])


def region_pieces(f: FilePieces, version: int) -> list[FilePieces]:
    """A file with rank blocks as one FilePieces per region: region 0's whole tensors (their `enc`
    from the header), then each block's pieces of the split tensors (from the file's spans) that `f`
    holds (its header indices), each with its span's position bounds and the positions needed."""
    ctx = {"version": version, "tensor": f.names[0] if len(f) else None}
    regions = region_payloads(f.payload, f.file_enc, ctx)
    spans = file_spans(f.payload, f.file_enc, ctx)
    if f.header_index is None or f.row_size is None:
        raise err(CodecError, "a file with rank blocks is read with its pieces' header rows", ctx)
    encs = f.encs if isinstance(f.encs, PieceEncs) else PieceEncs.of(f.encs)
    whole = np.flatnonzero(encs.at >= 0)
    out = [_subset(f, whole, regions[0])]
    row_of = np.full(int(max(f.header_index.max(initial=-1), spans[:, 0].max(initial=-1))) + 2, -1, dtype=np.int64)
    row_of[f.header_index] = np.arange(len(f))
    piece = row_of[spans[:, 0]]
    mine = spans[piece >= 0]
    piece = piece[piece >= 0]
    split = np.flatnonzero(encs.at < 0)
    got = np.bincount(piece, weights=mine[:, 3], minlength=len(f)).astype(np.int64)
    wrong = split[got[split] != f.nnz[split]]
    if wrong.size:
        k = int(wrong[0])
        raise err(
            CodecError, f"its spans hold {got[k]} elements, the header {int(f.nnz[k])}", {**ctx, "tensor": f.names[k]}
        )
    b = int(f.file_enc["blocks"])
    for r in range(1, b + 1):
        sel = np.flatnonzero(mine[:, 2] == r - 1)
        out.append(_block_pieces(f, piece[sel], mine[sel], regions[r], b))
    return [p for p in out if len(p)]


def _subset(f: FilePieces, keep: np.ndarray, region: tuple[dict[str, torch.Tensor], dict[str, int]]) -> FilePieces:
    encs = f.encs if isinstance(f.encs, PieceEncs) else PieceEncs.of(f.encs)
    arrays: dict[str, Any] = {k: None if getattr(f, k) is None else getattr(f, k)[keep] for k in _ARRAYS}
    return replace(
        f,
        payload=region[0],
        file_enc=region[1],
        names=np.asarray(f.names, dtype=object)[keep].tolist(),
        encs=encs[keep],
        **arrays,
    )


def _block_pieces(
    f: FilePieces, piece: np.ndarray, spans: np.ndarray, region: tuple[dict[str, torch.Tensor], dict[str, int]], b: int
) -> FilePieces:
    """Block pieces: span rows (tensor, split, block, elements, at) of the pieces `piece` of `f`."""
    assert f.row_size is not None
    c = f.row_size[piece]
    r0, r1 = f.start[piece] // np.maximum(c, 1), f.stop[piece] // np.maximum(c, 1)
    kind, block = spans[:, 1], spans[:, 2]
    start, stop = span_bounds(kind, block, f.numel[piece] // np.maximum(c, 1), c, r0, r1, b)
    sub = _subset(f, piece, region)
    need_lo, need_hi = None, None
    cols = kind == COLS
    if f.need_lo is not None and f.need_hi is not None:
        # rows: the positions needed; a column block: all of it (its own coordinates) or none
        meet = cols_meet(kind, block, c, _col(f.need_c0, piece, 0), _col(f.need_c1, piece, c), b)
        need_lo = np.where(meet, np.where(cols, start, np.maximum(start, f.need_lo[piece])), 0)
        need_hi = np.where(meet, np.where(cols, stop, np.minimum(stop, f.need_hi[piece])), 0)
    c0 = edge(block, c, b)
    c1 = edge(block + 1, c, b)
    inside = None
    if f.need_lo is not None and f.need_hi is not None:  # the piece lies in what the layout needs
        lo, hi = f.need_lo[piece], f.need_hi[piece]
        by_cols = (c0 >= _col(f.need_c0, piece, 0)) & (c1 <= _col(f.need_c1, piece, c))
        by_cols &= (r0 * c + c0 >= lo) & ((r1 - 1) * c + c1 <= hi)
        inside = np.where(cols, by_cols, (start >= lo) & (stop <= hi)) & (stop > start)
    return replace(
        sub,
        inside=inside,
        encs=PieceEncs(spans[:, 4], start),
        nnz=spans[:, 3],
        start=start,
        stop=stop,
        need_lo=need_lo,
        need_hi=need_hi,
        block_c0=np.where(cols, c0, 0),
        block_width=np.where(cols, c1 - c0, 0),
    )


def _col(values: np.ndarray | None, piece: np.ndarray, default: np.ndarray | int) -> np.ndarray:
    return np.broadcast_to(np.asarray(default), piece.shape) if values is None else values[piece]


_ARRAYS = (
    "index",
    "numel",
    "nnz",
    "start",
    "stop",
    "need_lo",
    "need_hi",
    "header_index",
    "row_size",
    "need_c0",
    "need_c1",
    "block_c0",
    "block_width",
    "inside",
)

__all__ = ["file_spans", "has_blocks", "region_payloads", "region_pieces"]
