"""`CompactCodec`: the compact codec's Codec: the trainer's side (`prepare`, `prepare_batch`, `pack`)
and the per-piece reader's (`unpack`/`finish`). A server's staging reads with `CompactDecoder`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import zstandard

from ...bits import INT_DTYPE, NP_INT, int_view, wrap_diff
from ...errors import CodecError
from ..base import Batch, BatchSections, Changes, Ctx, HostCopy, Sections, err
from .frames import (
    DIFF_ESCAPE,
    FRAME_ELEMS,
    GAP_ESCAPE,
    ZSTD_LEVEL,
    Frame,
    FrameOrder,
    decode_frames,
    decompress_frame,
    parse_frames,
)


def _compact_sections(
    gaps16: np.ndarray, d8: np.ndarray, gap_esc: np.ndarray, diff_esc: np.ndarray, starts: list[int], width: int
) -> Sections:
    """One tensor's compact Sections from its host arrays and its frame starts."""
    return Sections(
        {"gaps16": gaps16, "d8": d8, "gap_esc": gap_esc.astype(np.int64), "diff_esc": diff_esc},
        {"starts": starts, "width": 8 * width},
    )


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

        def put(name: str) -> torch.Tensor:
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
