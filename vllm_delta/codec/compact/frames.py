"""The compact codec's frame layer: a frame's table row (`Frame`), the table parsed and checked
against the payload (`parse_frames`), one frame decompressed into its sections
(`decompress_frame`), and consecutive frames turned into positions and differences on the device
(`decode_frames`, `FrameOrder`). Shared by `CompactCodec` (per piece) and `CompactDecoder` (staging).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import zstandard

from ...bits import NP_INT
from ...errors import CodecError, PositionError
from ..base import Ctx, err, segment_ids

FRAME_ELEMS = 1 << 22
ZSTD_LEVEL = 3
GAP_ESCAPE = 0xFFFF
DIFF_ESCAPE = -128


class Frame(NamedTuple):
    """One row of a compact payload's frame table (`enc["frames"]`, docs/FORMAT.md)."""

    nbytes: int  # compressed size in the blob
    elems: int  # changed elements in the frame
    start: int  # the position the frame's gap chain starts from
    gap_escapes: int  # entries of its gap escape table
    diff_escapes: int  # entries of its value escape table

    def raw_size(self, width: int) -> int:
        """Decompressed bytes: gap planes, diff codes, int64 gap escapes, value escapes."""
        return 3 * self.elems + 8 * self.gap_escapes + width * self.diff_escapes


class FrameArrays(NamedTuple):
    """One decompressed frame, as numpy views into its buffer."""

    gap_lo: np.ndarray  # uint8: low bytes of the uint16 gaps
    gap_hi: np.ndarray  # uint8: high bytes
    d8: np.ndarray  # int8: bit differences, DIFF_ESCAPE where escaped
    gap_esc: np.ndarray  # int64: gaps >= GAP_ESCAPE, in order
    diff_esc: np.ndarray  # int16/int32: differences outside [-127, 127], in order


def parse_frames(blob: torch.Tensor | None, meta: Any, nnz: int, ctx: Ctx) -> list[Frame]:
    """The frame table of one tensor's compact payload, checked against the blob and the header's nnz."""
    table = meta.get("frames") if isinstance(meta, dict) else None
    if blob is None or blob.dtype != torch.uint8 or not isinstance(table, list):
        raise err(CodecError, "compact payload lacks its 'blob' tensor or frame table", ctx)
    try:
        frames = [Frame(*(int(x) for x in row)) for row in table]
    except (TypeError, ValueError) as exc:
        raise err(CodecError, f"malformed frame table: {exc}", ctx) from None
    size, count = sum(f.nbytes for f in frames), sum(f.elems for f in frames)
    if any(min(f) < 0 for f in frames) or size != blob.numel() or count != nnz:
        raise err(
            CodecError,
            f"frame table covers {size} B / {count} elements, payload has {blob.numel()} B / header nnz {nnz}",
            ctx,
        )
    return frames


def decompress_frame(
    dctx: zstandard.ZstdDecompressor, blob: memoryview, offset: int, frame: Frame, width: int, numel: int, ctx: Ctx
) -> FrameArrays:
    """Decompress the frame at `offset` of `blob` and split it into its sections (checked sizes; gap
    escapes within the tensor's `numel`)."""
    want = frame.raw_size(width)
    try:
        buf = dctx.decompress(blob[offset : offset + frame.nbytes], max_output_size=want)
    except zstandard.ZstdError as exc:
        raise err(CodecError, f"zstd frame at byte {offset} is corrupt: {exc}", ctx) from None
    if len(buf) != want:
        raise err(CodecError, f"zstd frame at byte {offset} holds {len(buf)} B, expected {want}", ctx)
    n, k = frame.elems, frame.gap_escapes
    raw = np.frombuffer(buf, dtype=np.uint8)
    gap_esc = np.frombuffer(buf, dtype="<i8", count=k, offset=3 * n)
    if k and (int(gap_esc.min()) < 0 or int(gap_esc.max()) >= numel):
        raise err(PositionError, f"gap escape out of range for {numel} elements", ctx)
    return FrameArrays(
        gap_lo=raw[:n],
        gap_hi=raw[n : 2 * n],
        d8=raw[2 * n : 3 * n].view(np.int8),
        gap_esc=gap_esc,
        diff_esc=np.frombuffer(buf, dtype=NP_INT[width], count=frame.diff_escapes, offset=3 * n + 8 * k),
    )


def patch_escapes(
    codes: torch.Tensor, code: int, table: torch.Tensor, frame_first: np.ndarray, expected: Sequence[int]
) -> int | None:
    """Replace each `code` in `codes` by the next entry of `table` (in place).

    `frame_first[f]` is frame f's first element, `expected[f]` its escape count. Returns the first
    frame whose number of codes differs from its count (nothing replaced then), else None."""
    at = (codes == code).nonzero().reshape(-1)
    per_frame = np.bincount(np.searchsorted(frame_first, at.cpu().numpy(), side="right") - 1, minlength=len(expected))
    bad = np.flatnonzero(per_frame != np.asarray(expected, dtype=np.int64))
    if bad.size:
        return int(bad[0])
    if at.numel():
        codes[at] = table.to(codes.dtype)
    return None


def decode_frames(
    gaps: torch.Tensor,
    diffs: torch.Tensor,
    gap_esc: torch.Tensor,
    diff_esc: torch.Tensor,
    frames: Sequence[Frame],
    ctx_of: Callable[[int], Ctx],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device finish of consecutive frames: escapes patched, positions from the gap chains.

    `gaps` int64 (the uint16 codes, consumed), `diffs` the int8 codes widened to the value width
    (patched in place), escape tables on the same device. Within frame f, element i sits at
    start_f + Σ_{j<=i}(gap_j + 1) - 1. Returns (positions int64, diffs, frame index of each element).
    Errors name the frame's
    tensor through `ctx_of(frame index)`."""
    dev = gaps.device
    counts = np.array([f.elems for f in frames], dtype=np.int64)
    first = np.cumsum(counts) - counts
    escapes = (
        ("gap", gaps, GAP_ESCAPE, gap_esc, [f.gap_escapes for f in frames]),
        ("value", diffs, DIFF_ESCAPE, diff_esc, [f.diff_escapes for f in frames]),
    )
    for kind, codes, code, table, expected in escapes:
        bad = patch_escapes(codes, code, table, first, expected)
        if bad is not None:
            raise err(CodecError, f"{kind} escapes do not match their escape table", ctx_of(bad))
    n = gaps.numel()
    if n == 0:
        return gaps, diffs, gaps.clone()
    c = torch.cumsum(gaps.add_(1), 0)
    small = torch.from_numpy(np.concatenate([first, counts, np.array([f.start for f in frames], dtype=np.int64)]))
    small = small.to(dev, non_blocking=dev.type == "cuda")
    k = len(frames)
    first_d, counts_d, starts = small[:k], small[k : 2 * k], small[2 * k :]
    before = torch.where(first_d > 0, c[(first_d - 1).clamp_(min=0)], torch.zeros_like(first_d))
    frame_of = segment_ids(counts_d, n)
    return c.add_((starts - 1 - before)[frame_of]), diffs, frame_of


class FrameOrder:
    """Positions of one tensor keep rising across its frames (and chunks) and stay below numel.

    `begin(key, start)` makes a key's positions start at `start` (a piece of a multi-part version:
    its positions lie in the rows its part owns; pass the piece's end as `numel` to `check`)."""

    def __init__(self) -> None:
        self._last: dict[object, int] = {}

    def begin(self, key: object, start: int) -> None:
        self._last[key] = start - 1

    def check(self, key: object, frame: Frame, last: int | None, numel: int, ctx: Ctx) -> None:
        prev = self._last.get(key, -1)
        if frame.start <= prev:
            raise err(PositionError, f"positions unsorted: frame starts at {frame.start}, not after {prev}", ctx)
        if last is not None:
            if last >= numel:
                raise err(PositionError, f"position {last} out of range for {numel} elements", ctx)
            self._last[key] = last
