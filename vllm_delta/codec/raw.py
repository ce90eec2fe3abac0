"""Codec `raw`: int32 (int64 when the tensor has 2^31 elements or more) positions + absolute values.

The TRL baseline, 6 B per changed bf16 element. Does not depend on the base's values. `RawCodec`
is the codec; `RawDecoder` a server's staging decoder (codec/decoding.py's interface): every
piece's positions and values copied through one pinned buffer, then checked on the device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..bits import INT_DTYPE, int_view
from ..errors import CodecError, PositionError
from .base import (
    Batch,
    BatchSections,
    Changes,
    Ctx,
    HostCopy,
    Sections,
    check_piece,
    check_positions,
    err,
    host_array,
    position_dtype,
    segment_ids,
)
from .decoding import Chunk, Fetch, Item, Pieces, StagingHost, ctx_of, piece_list


class RawCodec:
    name = "raw"
    needs_base = False

    def prepare(
        self, positions: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, numel: int, start: int = 0
    ) -> Sections:
        return Sections(
            {
                "idx": host_array(positions.to(position_dtype(numel))),
                "val": host_array(int_view(new_bits)),
            }
        )

    def prepare_batch(self, batch: Batch) -> BatchSections:
        """`prepare` for many tensors' changes at once: two device-to-host copies, no per-tensor work."""
        pos = batch.positions
        host = HostCopy(batch.positions.device)
        pos_h = host.add(pos)
        val_h = host.add(int_view(batch.new))
        host.done()

        def split() -> list[Sections | None]:
            host.wait()
            out: list[Sections | None] = []
            at = 0
            for n, numel in zip(batch.counts, batch.numels):
                if not n:
                    out.append(None)
                    continue
                idx = pos_h.numpy()[at : at + n].astype(np.int32 if position_dtype(numel) == torch.int32 else np.int64)
                out.append(Sections({"idx": idx, "val": val_h.numpy()[at : at + n]}))
                at += n
            return out

        return BatchSections(split, host.wait)

    def pack(self, sections: Sections, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        val = torch.from_numpy(sections.arrays["val"]).view(dtype)
        return {"idx": torch.from_numpy(sections.arrays["idx"]), "val": val}, {}

    def unpack(
        self, tensors: Mapping[str, torch.Tensor], meta: Any, *, numel: int, nnz: int, dtype: torch.dtype, ctx: Ctx
    ) -> Sections:
        idx, val = tensors.get("idx"), tensors.get("val")
        if idx is None or val is None:
            raise err(CodecError, "raw payload lacks 'idx' or 'val'", ctx)
        if idx.dtype not in (torch.int32, torch.int64) or val.dtype != dtype:
            raise err(CodecError, f"raw payload dtypes {idx.dtype}/{val.dtype}, expected int/{dtype}", ctx)
        if idx.ndim != 1 or val.ndim != 1 or idx.numel() != nnz or val.numel() != nnz:
            raise err(CodecError, f"raw payload holds {idx.numel()}/{val.numel()} entries, header says {nnz}", ctx)
        return Sections({"idx": idx.numpy(), "val": int_view(val).numpy()})

    def finish(self, sections: Sections, *, numel: int, device: torch.device | str, ctx: Ctx) -> Changes:
        pos = torch.from_numpy(sections.arrays["idx"]).to(device, non_blocking=True).to(torch.int64)
        check_positions(pos, numel, ctx)
        vals = torch.from_numpy(sections.arrays["val"]).to(device, non_blocking=True)
        return Changes(positions=pos, values=vals)


class RawDecoder:
    """The raw codec's staging decoder (stateless: each `plan` holds one decode's state)."""

    def plan(self, version: int, pieces: Pieces, width: int, host: StagingHost) -> _RawPlan:
        return _RawPlan(version, piece_list(pieces, "raw", version), width, host)


class _RawPlan:
    """One unit: every piece's positions and values copied into one pinned buffer each (host), one
    host-to-device copy, then checked and handed out in groups of whole pieces (device)."""

    units = (0,)

    def __init__(self, version: int, items: list[Item], width: int, host: StagingHost):
        self.version, self.items, self.width, self.host = version, items, width, host
        codec = RawCodec()
        self.sections = [
            codec.unpack(it.parts, it.enc, numel=it.numel, nnz=it.nnz, dtype=it.dtype, ctx=ctx_of(version, it.name))
            for it in items
        ]
        total = sum(it.nnz for it in items)
        self.pos_t = host.buffer(total, torch.int64)
        self.val_t = host.buffer(total, INT_DTYPE[width])
        self.bounds: list[tuple[int, int]] = []
        at = 0
        for it in items:
            self.bounds.append((at, at + it.nnz))
            at += it.nnz

    def _copy(self) -> None:
        pos, val = self.pos_t.numpy(), self.val_t.numpy()
        for (a, b), sec in zip(self.bounds, self.sections):
            pos[a:b] = sec.arrays["idx"]
            val[a:b] = sec.arrays["val"]

    def fetch(self, unit: int) -> Fetch:
        return Fetch([self.host.submit(self._copy)])

    def decode(self, unit: int, fetched: Fetch) -> Iterator[Chunk]:
        items, bounds, dev = self.items, self.bounds, self.host.device
        nb = dev.type == "cuda"
        pos_d = self.pos_t.to(dev, non_blocking=nb)
        val_d = self.val_t.to(dev, non_blocking=nb)
        self.host.mark("h2d")
        for group in _groups([it.nnz for it in items], self.host.chunk_elems):
            a, b = bounds[group[0]][0], bounds[group[-1]][1]
            p = pos_d[a:b]
            idx = torch.tensor([items[k].index for k in group], dtype=torch.int64, device=dev)
            cnt = torch.tensor([items[k].nnz for k in group], dtype=torch.int64, device=dev)
            seg = segment_ids(cnt, b - a)
            t_idx = idx[seg]
            lo = torch.tensor([items[k].start for k in group], dtype=torch.int64, device=dev)
            hi = torch.tensor([items[k].end for k in group], dtype=torch.int64, device=dev)
            bad = (p < lo[seg]) | (p >= hi[seg])
            if b - a > 1:
                bad[1:] |= (p[1:] <= p[:-1]) & (t_idx[1:] == t_idx[:-1])
            if bool(bad.any()):
                for k in group:  # find the tensor and raise the codec's own message
                    s, e = bounds[k]
                    ctx = ctx_of(self.version, items[k].name)
                    check_positions(pos_d[s:e], items[k].numel, ctx)
                    check_piece(pos_d[s:e], items[k].start, items[k].end, ctx)
                raise PositionError("invalid positions", version=self.version, tensor=items[group[0]].name)
            self.host.mark("decode")
            yield Chunk(
                t_idx=t_idx, p=p, diffs=None, values=val_d[a:b], runs=[(items[k].index, items[k].nnz) for k in group]
            )


def _groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of `sizes` in groups of at most `limit` in total (or one alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for k, n in enumerate(sizes):
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    if cur:
        out.append(cur)
    return out
