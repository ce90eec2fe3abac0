"""Codec `compact` (formats 1 and 2): per tensor, gap-coded positions and ULP differences in zstd frames.

Gap-coded positions (uint16, byte-planed, escapes for gaps >= 65535) + the difference of the bit
patterns new - old mod 2^bits (int8, escapes for |d| > 127), zstd-compressed in independent frames
of at most FRAME_ELEMS elements, one payload (`<name>::blob`) per tensor. Its values need the
base's values. Layout: docs/FORMAT.md. The frame layer (`Frame`, `parse_frames`,
`decompress_frame`, `decode_frames`) is shared with the server's staging decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import zstandard

from ..bits import INT_DTYPE, NP_INT, int_view, wrap_diff
from ..errors import CodecError, PositionError
from .base import Batch, BatchSections, Changes, Ctx, HostCopy, Sections, err, segment_ids

FRAME_ELEMS = 1 << 22
ZSTD_LEVEL = 3
GAP_ESCAPE = 0xFFFF
DIFF_ESCAPE = -128


def _compact_sections(
    gaps16: np.ndarray, d8: np.ndarray, gap_esc: np.ndarray, diff_esc: np.ndarray, starts: list[int], width: int
) -> Sections:
    """One tensor's compact Sections from its host arrays and its frame starts."""
    return Sections(
        {"gaps16": gaps16, "d8": d8, "gap_esc": gap_esc.astype(np.int64), "diff_esc": diff_esc},
        {"starts": starts, "width": 8 * width},
    )


# -- the compact frame layer (shared by CompactCodec and the server's staging decoder) -------------


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


class CompactCodec:
    name = "compact"
    needs_base = True

    def __init__(self, level: int = ZSTD_LEVEL, frame_elems: int = FRAME_ELEMS):
        self.level = level
        self.frame_elems = frame_elems

    # -- trainer side ------------------------------------------------------------------------
    def prepare(
        self, positions: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, numel: int, start: int = 0
    ) -> Sections:
        """Device work: gaps and bit differences, escapes split off. Returns host arrays.

        `start`: where the first frame's gap chain starts (0; a part's pieces start at its rows)."""
        pos = positions.to(torch.int64)
        n = pos.numel()
        width = int_view(new_bits).element_size()
        prev = torch.empty_like(pos)
        if n:
            prev[0] = start - 1
            prev[1:] = pos[:-1]
        # Frames restart the gap chain so that each decodes alone: a frame's first gap is
        # relative to the frame's `start` (the position after the previous frame's last element).
        starts = [start]
        for f in range(self.frame_elems, n, self.frame_elems):
            starts.append(int(pos[f - 1].item()) + 1)
            prev[f] = starts[-1] - 1
        gaps = pos - prev - 1
        esc = gaps >= GAP_ESCAPE
        g16 = torch.clamp(gaps, max=GAP_ESCAPE)
        g16 = torch.where(g16 >= 1 << 15, g16 - (1 << 16), g16).to(torch.int16)  # uint16 bits
        diffs = wrap_diff(int_view(new_bits), int_view(old_bits), width)
        small = (diffs >= -127) & (diffs <= 127)
        d8 = torch.where(small, diffs, torch.full_like(diffs, DIFF_ESCAPE)).to(torch.int8)
        # One device-to-host copy per tensor (the trainer publishes hundreds of tensors per step).
        parts = [g16, d8, gaps[esc], diffs[~small].to(INT_DTYPE[width])]
        host = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts]).cpu().numpy()
        gaps16 = host[: 2 * n].view(np.uint16)
        k = int(np.count_nonzero(gaps16 == GAP_ESCAPE))
        return Sections(
            {
                "gaps16": gaps16,
                "d8": host[2 * n : 3 * n].view(np.int8),
                "gap_esc": host[3 * n : 3 * n + 8 * k].view(np.int64),
                "diff_esc": host[3 * n + 8 * k :].view(NP_INT[width]),
            },
            {"starts": starts, "width": 8 * width},
        )

    def prepare_batch(self, batch: Batch) -> BatchSections:
        """`prepare` for many tensors' changes at once (the trainer's detection output), vectorized:
        the same Sections per tensor, from a few device kernels, one synchronization (the escape
        count) and device-to-host copies that the returned `split` waits for (an event on CUDA, so
        the caller's thread is not held while they run). Frame starts (the position after each
        frame's last element) are gathered on the device, a few per tensor."""
        pos, seg = batch.positions, batch.seg
        dev, n = pos.device, pos.numel()
        width = int_view(batch.new).element_size()
        starts_t = torch.tensor(batch.starts, dtype=torch.int64).to(dev, non_blocking=True)
        prev = torch.empty_like(pos)
        if n:
            prev[1:] = pos[:-1]
            first = torch.ones(n, dtype=torch.bool, device=dev)
            first[1:] = seg[1:] != seg[:-1]
            prev = torch.where(first, starts_t[seg] - 1, prev)
        gaps = pos - prev - 1
        gesc = gaps >= GAP_ESCAPE
        g16 = torch.clamp(gaps, max=GAP_ESCAPE)
        g16 = torch.where(g16 >= 1 << 15, g16 - (1 << 16), g16).to(torch.int16)  # uint16 bits
        diffs = wrap_diff(int_view(batch.new), int_view(batch.old), width)
        small = (diffs >= -127) & (diffs <= 127)
        d8 = torch.where(small, diffs, torch.full_like(diffs, DIFF_ESCAPE)).to(torch.int8)
        at = (gesc | ~small).nonzero().reshape(-1)  # escapes are rare: one small synchronization
        esc = torch.stack([seg[at], gaps[at], diffs[at], gesc[at].to(torch.int64)]) if at.numel() else None
        frame = self.frame_elems
        counts = np.asarray(batch.counts, dtype=np.int64)
        first_at = np.cumsum(counts) - counts
        last_of_frame = [int(a + f - 1) for a, c in zip(first_at, counts) for f in range(frame, int(c), frame)]
        host = HostCopy(dev)
        g_h = host.add(g16)
        d_h = host.add(d8)
        e_h = host.add(esc) if esc is not None else None
        # (Built on the host, copied without waiting: a tensor made on the device would sync the stream.)
        f_at = torch.tensor(last_of_frame, dtype=torch.int64).to(dev, non_blocking=True) if last_of_frame else None
        f_h = host.add(pos[f_at]) if f_at is not None else None
        host.done()

        def split() -> list[Sections | None]:
            host.wait()
            g_all = g_h.numpy().view(np.uint16)
            d_all = d_h.numpy()
            e = e_h.numpy() if e_h is not None else np.zeros((4, 0), dtype=np.int64)
            later = (f_h.numpy() + 1).tolist() if f_h is not None else []  # frame starts after the first
            bounds = np.searchsorted(e[0], np.arange(len(batch.counts) + 1))
            out: list[Sections | None] = []
            a = f = 0
            for t, (count, start) in enumerate(zip(batch.counts, batch.starts)):
                if not count:
                    out.append(None)
                    continue
                g, d = g_all[a : a + count], d_all[a : a + count]
                et = e[:, bounds[t] : bounds[t + 1]]
                gap_esc = np.ascontiguousarray(et[1][et[3] == 1])
                diff_esc = et[2][(et[2] < -127) | (et[2] > 127)].astype(NP_INT[width])
                frames = (count - 1) // frame  # frames after the first
                out.append(_compact_sections(g, d, gap_esc, diff_esc, [start, *later[f : f + frames]], width))
                a += count
                f += frames
            return out

        return BatchSections(split, host.wait)

    def pack(self, sections: Sections, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Host work: split into frames, byte-plane the gaps, zstd each frame."""
        a = sections.arrays
        n = a["gaps16"].size
        gap_esc_at = np.flatnonzero(a["gaps16"] == GAP_ESCAPE)
        diff_esc_at = np.flatnonzero(a["d8"] == DIFF_ESCAPE)
        cctx = zstandard.ZstdCompressor(level=self.level, write_checksum=True)
        blobs, frames = [], []
        for i, start in enumerate(sections.meta["starts"]):
            lo, hi = i * self.frame_elems, min(n, (i + 1) * self.frame_elems)
            g = a["gaps16"][lo:hi]
            ge = a["gap_esc"][(gap_esc_at >= lo) & (gap_esc_at < hi)]
            de = a["diff_esc"][(diff_esc_at >= lo) & (diff_esc_at < hi)]
            # [low bytes | high bytes | d8 | gap escapes | diff escapes], assembled by numpy copies
            # (they release the GIL: the packing threads run this part in parallel too).
            m = hi - lo
            ge8, de8 = ge.astype("<i8").view(np.uint8), np.ascontiguousarray(de).view(np.uint8)
            raw = np.empty(3 * m + ge8.size + de8.size, dtype=np.uint8)
            gb = g.view(np.uint8)
            raw[:m] = gb[0::2]
            raw[m : 2 * m] = gb[1::2]
            raw[2 * m : 3 * m] = a["d8"][lo:hi].view(np.uint8)
            raw[3 * m : 3 * m + ge8.size] = ge8
            raw[3 * m + ge8.size :] = de8
            blob = cctx.compress(raw.data)
            blobs.append(blob)
            frames.append(list(Frame(len(blob), hi - lo, start, int(ge.size), int(de.size))))
        data = np.frombuffer(b"".join(blobs), dtype=np.uint8).copy()
        return {"blob": torch.from_numpy(data)}, {"frames": frames}

    # -- server side -------------------------------------------------------------------------
    def unpack(
        self, tensors: Mapping[str, torch.Tensor], meta: Any, *, numel: int, nnz: int, dtype: torch.dtype, ctx: Ctx
    ) -> Sections:
        """Host work: decompress each frame into compact fixed-width arrays (3 B per element plus
        escapes), ready for one host-to-device copy. Value checks happen in `finish`."""
        blob = tensors.get("blob")
        frames = parse_frames(blob, meta, nnz, ctx)
        assert blob is not None  # parse_frames checked it
        width = torch.empty((), dtype=dtype).element_size()
        gaps16 = np.empty(nnz, dtype=np.uint16)
        d8 = np.empty(nnz, dtype=np.int8)
        gap_esc = np.empty(sum(f.gap_escapes for f in frames), dtype=np.int64)
        diff_esc = np.empty(sum(f.diff_escapes for f in frames), dtype=NP_INT[width])
        raw = blob.numpy().data
        dctx = zstandard.ZstdDecompressor()
        offset = at = at_ge = at_de = 0
        for f in frames:
            fa = decompress_frame(dctx, raw, offset, f, width, numel, ctx)
            as_bytes = gaps16[at : at + f.elems].view(np.uint8).reshape(f.elems, 2)
            as_bytes[:, 0] = fa.gap_lo  # little-endian uint16: low byte first
            as_bytes[:, 1] = fa.gap_hi
            d8[at : at + f.elems] = fa.d8
            gap_esc[at_ge : at_ge + f.gap_escapes] = fa.gap_esc
            diff_esc[at_de : at_de + f.diff_escapes] = fa.diff_esc
            offset, at = offset + f.nbytes, at + f.elems
            at_ge, at_de = at_ge + f.gap_escapes, at_de + f.diff_escapes
        return Sections(
            {
                "gaps16": gaps16,
                "d8": d8,
                "gap_esc": gap_esc,
                "diff_esc": diff_esc,
                "frame_n": np.array([f.elems for f in frames], dtype=np.int64),
                "frame_start": np.array([f.start for f in frames], dtype=np.int64),
            },
            {"width": width},
        )

    def finish(self, sections: Sections, *, numel: int, device: torch.device | str, ctx: Ctx) -> Changes:
        """Device work: widen, patch escapes, positions from the gap chain, validate."""
        a = sections.arrays
        dev = torch.device(device)

        def put(name):
            return torch.from_numpy(a[name]).to(dev, non_blocking=True)

        # Sections keep the escape tables of all frames end to end: check the totals, then give
        # each frame the escapes its own codes ask for (the tables are consumed in order).
        counts = a["frame_n"].astype(np.int64)
        first = np.cumsum(counts) - counts
        gap_codes = a["gaps16"] == GAP_ESCAPE
        diff_codes = a["d8"] == DIFF_ESCAPE
        per = [(int(gap_codes[s : s + n].sum()), int(diff_codes[s : s + n].sum())) for s, n in zip(first, counts)]
        if sum(g for g, _ in per) != a["gap_esc"].size:
            raise err(CodecError, "gap escapes do not match their escape table", ctx)
        if sum(d for _, d in per) != a["diff_esc"].size:
            raise err(CodecError, "value escapes do not match their escape table", ctx)
        frames = [Frame(0, int(n), int(s), g, d) for n, s, (g, d) in zip(counts, a["frame_start"], per)]
        gaps = put("gaps16").view(torch.int16).to(torch.int64) & 0xFFFF
        diffs = put("d8").to(torch.int64)
        positions, diffs, _ = decode_frames(gaps, diffs, put("gap_esc"), put("diff_esc"), frames, lambda _: ctx)
        order = FrameOrder()
        lasts = positions[torch.from_numpy(first + counts - 1)[counts > 0].to(dev)].tolist()
        nonempty = iter(lasts)
        for f in frames:
            order.check(0, f, next(nonempty) if f.elems else None, numel, ctx)
        return Changes(positions=positions, diffs=diffs)
