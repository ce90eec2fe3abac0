"""Codecs for the changed elements of one tensor (layouts: docs/FORMAT.md).

A change set is (positions, new bit patterns) with positions the sorted, unique row-major flat
indices of the changed elements. Every codec runs in four steps, so that the device work and the
host work can be placed where they belong (trainer: detect on the GPU, compress on a background
thread; server: decompress before the pause, finish on a side stream):

    prepare (device)  -> Sections (host arrays) -> pack (host)   -> file tensors + JSON meta
    unpack  (host)    -> Sections (host arrays) -> finish (device) -> Changes

`raw`     int32 (int64 when the tensor has 2^31 elements or more) positions + absolute values: the
          TRL baseline, 6 B per changed bf16 element. Does not depend on the base's values.
`compact` gap-coded positions (uint16, byte-planed, escapes for gaps >= 65535) + the difference of
          the bit patterns new - old mod 2^bits (int8, escapes for |d| > 127), zstd-compressed in
          independent frames of at most FRAME_ELEMS elements. Its values need the base's values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import zstandard

from .errors import CodecError, PositionError

FRAME_ELEMS = 1 << 22
ZSTD_LEVEL = 3
GAP_ESCAPE = 0xFFFF
DIFF_ESCAPE = -128

INT_DTYPE = {2: torch.int16, 4: torch.int32}
NP_INT = {2: np.int16, 4: np.int32}


@dataclass
class Changes:
    """Decoded changes of one tensor, on one device. New values come from `new_bits(old)`."""

    positions: torch.Tensor  # int64, sorted, unique
    values: torch.Tensor | None = None  # absolute bit patterns (int16/int32), codecs without a base
    diffs: torch.Tensor | None = None  # new - old mod 2^bits, as int64

    @property
    def needs_base(self) -> bool:
        return self.values is None

    def new_bits(self, old_bits: torch.Tensor | None) -> torch.Tensor:
        """New bit patterns (same integer dtype as `old_bits`) for the changed positions."""
        if self.values is not None:
            return self.values
        if old_bits is None:
            raise CodecError("this codec's values are relative to the base; pass the base values")
        width = old_bits.element_size() * 8
        new = (old_bits.to(torch.int64) + self.diffs) & ((1 << width) - 1)
        new = torch.where(new >= (1 << (width - 1)), new - (1 << width), new)
        return new.to(old_bits.dtype)


@dataclass
class Sections:
    """Host-side intermediate form of a codec: named numpy arrays plus small metadata."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def int_view(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        if t.element_size() not in INT_DTYPE:
            raise CodecError(f"unsupported element type {t.dtype}")
        return t.view(INT_DTYPE[t.element_size()])
    return t


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def _err(exc_type, msg, ctx):
    return exc_type(msg, version=ctx.get("version"), tensor=ctx.get("tensor"))


def position_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= np.iinfo(np.int32).max else torch.int64


class RawCodec:
    name = "raw"
    needs_base = False

    def prepare(self, positions, new_bits, old_bits, numel) -> Sections:
        return Sections(
            {
                "idx": _host(positions.to(position_dtype(numel))),
                "val": _host(int_view(new_bits)),
            }
        )

    def pack(self, sections: Sections, dtype: torch.dtype):
        val = torch.from_numpy(sections.arrays["val"]).view(dtype)
        return {"idx": torch.from_numpy(sections.arrays["idx"]), "val": val}, {}

    def unpack(self, tensors, meta, *, numel, nnz, dtype, ctx) -> Sections:
        idx, val = tensors.get("idx"), tensors.get("val")
        if idx is None or val is None:
            raise _err(CodecError, "raw payload lacks 'idx' or 'val'", ctx)
        if idx.dtype not in (torch.int32, torch.int64) or val.dtype != dtype:
            raise _err(CodecError, f"raw payload dtypes {idx.dtype}/{val.dtype}, expected int/{dtype}", ctx)
        if idx.ndim != 1 or val.ndim != 1 or idx.numel() != nnz or val.numel() != nnz:
            raise _err(CodecError, f"raw payload holds {idx.numel()}/{val.numel()} entries, header says {nnz}", ctx)
        return Sections({"idx": idx.numpy(), "val": int_view(val).numpy()})

    def finish(self, sections: Sections, *, numel, device, ctx) -> Changes:
        pos = torch.from_numpy(sections.arrays["idx"]).to(device, non_blocking=True).to(torch.int64)
        check_positions(pos, numel, ctx)
        vals = torch.from_numpy(sections.arrays["val"]).to(device, non_blocking=True)
        return Changes(positions=pos, values=vals)


class CompactCodec:
    name = "compact"
    needs_base = True

    def __init__(self, level: int = ZSTD_LEVEL, frame_elems: int = FRAME_ELEMS):
        self.level = level
        self.frame_elems = frame_elems

    # -- trainer side ------------------------------------------------------------------------
    def prepare(self, positions, new_bits, old_bits, numel) -> Sections:
        """Device work: gaps and bit differences, escapes split off. Returns host arrays."""
        pos = positions.to(torch.int64)
        n = pos.numel()
        width = int_view(new_bits).element_size() * 8
        prev = torch.empty_like(pos)
        if n:
            prev[0] = -1
            prev[1:] = pos[:-1]
        # Frames restart the gap chain so that each decodes alone: a frame's first gap is
        # relative to the frame's `start` (the position after the previous frame's last element).
        starts = [0]
        for f in range(self.frame_elems, n, self.frame_elems):
            starts.append(int(pos[f - 1].item()) + 1)
            prev[f] = starts[-1] - 1
        gaps = pos - prev - 1
        esc = gaps >= GAP_ESCAPE
        g16 = torch.clamp(gaps, max=GAP_ESCAPE)
        g16 = torch.where(g16 >= 1 << 15, g16 - (1 << 16), g16).to(torch.int16)  # uint16 bits
        diffs = (int_view(new_bits).to(torch.int64) - int_view(old_bits).to(torch.int64)) & ((1 << width) - 1)
        diffs = torch.where(diffs >= (1 << (width - 1)), diffs - (1 << width), diffs)
        small = (diffs >= -127) & (diffs <= 127)
        d8 = torch.where(small, diffs, torch.full_like(diffs, DIFF_ESCAPE)).to(torch.int8)
        # One device-to-host copy per tensor (the trainer publishes hundreds of tensors per step).
        parts = [g16, d8, gaps[esc], diffs[~small].to(INT_DTYPE[width // 8])]
        host = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts]).cpu().numpy()
        gaps16 = host[: 2 * n].view(np.uint16)
        k = int(np.count_nonzero(gaps16 == GAP_ESCAPE))
        return Sections(
            {
                "gaps16": gaps16,
                "d8": host[2 * n : 3 * n].view(np.int8),
                "gap_esc": host[3 * n : 3 * n + 8 * k].view(np.int64),
                "diff_esc": host[3 * n + 8 * k :].view(NP_INT[width // 8]),
            },
            {"starts": starts, "width": width},
        )

    def pack(self, sections: Sections, dtype: torch.dtype):
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
            planes = g.view(np.uint8).reshape(-1, 2).T  # [low bytes | high bytes]
            raw = b"".join([planes.tobytes(), a["d8"][lo:hi].tobytes(), ge.astype("<i8").tobytes(), de.tobytes()])
            blob = cctx.compress(raw)
            blobs.append(blob)
            frames.append([len(blob), hi - lo, start, int(ge.size), int(de.size)])
        data = np.frombuffer(b"".join(blobs), dtype=np.uint8).copy()
        return {"blob": torch.from_numpy(data)}, {"frames": frames}

    # -- server side -------------------------------------------------------------------------
    def unpack(self, tensors, meta, *, numel, nnz, dtype, ctx) -> Sections:
        """Host work: decompress each frame into compact fixed-width arrays (3 B per element plus
        escapes), ready for one host-to-device copy. Value checks happen in `finish`."""
        blob = tensors.get("blob")
        frames = meta.get("frames")
        if blob is None or blob.dtype != torch.uint8 or not isinstance(frames, list):
            raise _err(CodecError, "compact payload lacks its 'blob' tensor or frame table", ctx)
        width = torch.empty((), dtype=dtype).element_size()
        try:
            table = np.array([[int(x) for x in f] for f in frames], dtype=np.int64).reshape(-1, 5)
        except (TypeError, ValueError) as exc:
            raise _err(CodecError, f"malformed frame table: {exc}", ctx) from None
        sizes, counts, n_ge, n_de = table[:, 0], table[:, 1], table[:, 3], table[:, 4]
        if (table < 0).any() or int(sizes.sum()) != blob.numel() or int(counts.sum()) != nnz:
            raise _err(
                CodecError,
                f"frame table covers {int(sizes.sum())} B / {int(counts.sum())} elements, payload has "
                f"{blob.numel()} B / header nnz {nnz}",
                ctx,
            )
        gaps16 = np.empty(nnz, dtype=np.uint16)
        d8 = np.empty(nnz, dtype=np.int8)
        gap_esc = np.empty(int(n_ge.sum()), dtype=np.int64)
        diff_esc = np.empty(int(n_de.sum()), dtype=NP_INT[width])
        raw = memoryview(blob.numpy())
        dctx = zstandard.ZstdDecompressor()
        offset = at = at_ge = at_de = 0
        for size, n, _start, k, m in table.tolist():
            want = 3 * n + 8 * k + width * m
            try:
                buf = dctx.decompress(raw[offset : offset + size], max_output_size=want)
            except zstandard.ZstdError as exc:
                raise _err(CodecError, f"zstd frame at byte {offset} is corrupt: {exc}", ctx) from None
            if len(buf) != want:
                raise _err(CodecError, f"zstd frame at byte {offset} holds {len(buf)} B, expected {want}", ctx)
            planes = np.frombuffer(buf, dtype=np.uint8, count=2 * n).reshape(2, n)
            as_bytes = gaps16[at : at + n].view(np.uint8).reshape(n, 2)
            as_bytes[:, 0] = planes[0]  # little-endian uint16: low byte first
            as_bytes[:, 1] = planes[1]
            d8[at : at + n] = np.frombuffer(buf, dtype=np.int8, count=n, offset=2 * n)
            gap_esc[at_ge : at_ge + k] = np.frombuffer(buf, dtype="<i8", count=k, offset=3 * n)
            diff_esc[at_de : at_de + m] = np.frombuffer(buf, dtype=NP_INT[width], count=m, offset=3 * n + 8 * k)
            offset, at, at_ge, at_de = offset + size, at + n, at_ge + k, at_de + m
        return Sections(
            {
                "gaps16": gaps16,
                "d8": d8,
                "gap_esc": gap_esc,
                "diff_esc": diff_esc,
                "frame_n": counts.copy(),
                "frame_start": table[:, 2].copy(),
            },
            {"width": width},
        )

    def finish(self, sections: Sections, *, numel, device, ctx) -> Changes:
        """Device work: widen, patch escapes, positions from the gap chain, validate."""
        a = sections.arrays
        dev = torch.device(device)

        def put(name):
            return torch.from_numpy(a[name]).to(dev, non_blocking=True)

        gaps = put("gaps16").view(torch.int16).to(torch.int64) & 0xFFFF
        esc = gaps == GAP_ESCAPE
        gap_esc = put("gap_esc")
        if int(esc.sum()) != gap_esc.numel():
            raise _err(CodecError, "gap escapes do not match their escape table", ctx)
        gaps[esc] = gap_esc
        diffs = put("d8").to(torch.int64)
        desc = diffs == DIFF_ESCAPE
        diff_esc = put("diff_esc")
        if int(desc.sum()) != diff_esc.numel():
            raise _err(CodecError, "value escapes do not match their escape table", ctx)
        diffs[desc] = diff_esc.to(torch.int64)
        positions = torch.cumsum(gaps + 1, 0) - 1
        counts = torch.from_numpy(a["frame_n"])
        if counts.numel() > 1 or (counts.numel() == 1 and int(a["frame_start"][0]) != 0):
            # Each frame's chain starts at its own `start`: shift the frame by the difference.
            first = torch.cumsum(counts, 0) - counts
            before = torch.full((counts.numel(),), -1, dtype=torch.int64)
            inner = first > 0
            before[inner] = positions[first[inner].to(dev) - 1].cpu()
            shift = torch.from_numpy(a["frame_start"]) - (before + 1)
            positions += torch.repeat_interleave(shift, counts).to(dev, non_blocking=True)
        check_positions(positions, numel, ctx)
        return Changes(positions=positions, diffs=diffs)


def check_positions(pos: torch.Tensor, numel: int, ctx: dict) -> None:
    """Sorted, unique, within [0, numel). Raises PositionError naming the first offender."""
    if pos.numel() == 0:
        return
    if int(pos.min()) < 0 or int(pos.max()) >= numel:
        bad = int(pos[(pos < 0) | (pos >= numel)][0])
        raise _err(PositionError, f"position {bad} out of range for {numel} elements", ctx)
    if pos.numel() > 1:
        step = pos[1:] - pos[:-1]
        if bool((step <= 0).any()):
            i = int((step <= 0).nonzero()[0])
            kind = "duplicated" if int(step[i]) == 0 else "unsorted"
            raise _err(PositionError, f"positions {kind} at entry {i + 1} ({int(pos[i])}, {int(pos[i + 1])})", ctx)


CODECS = {"raw": RawCodec(), "compact": CompactCodec()}


def get_codec(name: str, ctx: dict | None = None):
    try:
        return CODECS[name]
    except KeyError:
        raise _err(CodecError, f"unknown codec {name!r} (known: {', '.join(CODECS)})", ctx or {}) from None


def encode(codec: str, positions, new_bits, old_bits, numel: int, dtype: torch.dtype):
    """One-shot encode: returns (file tensors by suffix, JSON meta)."""
    c = get_codec(codec)
    return c.pack(c.prepare(positions, new_bits, old_bits, numel), dtype)


def decode(codec: str, tensors, meta, *, numel: int, nnz: int, dtype, device="cpu", ctx=None) -> Changes:
    """One-shot decode of one tensor's payload into Changes on `device`."""
    ctx = ctx or {}
    c = get_codec(codec, ctx)
    return c.finish(
        c.unpack(tensors, meta, numel=numel, nnz=nnz, dtype=dtype, ctx=ctx), numel=numel, device=device, ctx=ctx
    )
