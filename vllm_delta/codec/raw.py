"""Codec `raw`: int32 (int64 when the tensor has 2^31 elements or more) positions + absolute values.

The TRL baseline, 6 B per changed bf16 element. Does not depend on the base's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..bits import int_view
from ..errors import CodecError
from .base import (
    Batch,
    BatchSections,
    Changes,
    Ctx,
    HostCopy,
    Sections,
    check_positions,
    err,
    host_array,
    position_dtype,
)


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
