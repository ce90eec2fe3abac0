"""The one delta writer: per-tensor changes -> a version's header and payload (layout: format.py).

    header, payload = encode_delta(version=7, base=6, base_checksum=..., codec="compact",
                                   shapes=..., dtypes=..., changes={name: (positions, new, old)}, sums=...)
    format.write(path, header, payload)

The Publisher splits the same work in two, so that the training thread does only the device part:
`prepare_changes` (detection output -> codec sections, on the parameters' device) at `publish`,
`assemble_delta` (zstd packing on a thread pool, header) on the upload thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from . import codec as codecs
from .checksums import combine, to_hex
from .format import DTYPE_NAMES, TensorEntry, VersionHeader, payload_key

Changes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (positions int64, new bits, old bits)


@dataclass
class PreparedTensor:
    """One tensor of a delta after the codec's device work: everything the header needs, and host
    sections that `assemble_delta` packs (None when nothing changed)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: int  # the tensor's positional sum at this version
    nnz: int
    sections: codecs.Sections | None = None


def prepare_changes(
    codec: codecs.Codec,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    checksum: int,
    changes: Changes,
) -> PreparedTensor:
    """The codec's device part for one tensor's changes (positions, new bits, old bits)."""
    pos, new, old = changes
    numel = 1
    for d in shape:
        numel *= int(d)
    sections = codec.prepare(pos, new, old, numel) if pos.numel() else None
    return PreparedTensor(tuple(shape), dtype, checksum, int(pos.numel()), sections)


def assemble_delta(
    *,
    version: int,
    base: int,
    base_checksum: str | None,
    codec: codecs.Codec,
    tensors: Mapping[str, PreparedTensor],
    pool: Executor | None = None,
    created: float = 0.0,
) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
    """Pack every changed tensor (on `pool` if given: zstd releases the GIL) into a delta's header
    and payload. The whole-model checksum is combined from the tensors' sums."""
    changed = [n for n, t in tensors.items() if t.sections is not None]

    def pack(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        sections = tensors[name].sections
        assert sections is not None
        return codec.pack(sections, tensors[name].dtype)

    packed = dict(zip(changed, pool.map(pack, changed) if pool is not None else map(pack, changed)))
    entries, payload = {}, {}
    for name, t in tensors.items():
        parts, meta = packed.get(name, ({}, {}))
        entries[name] = TensorEntry(
            shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype], checksum=to_hex(t.checksum), nnz=t.nnz, enc=meta
        )
        payload.update({payload_key(name, part): p for part, p in parts.items()})
    header = VersionHeader(
        version=version,
        kind="delta",
        tensors=entries,
        checksum=to_hex(combine((n, t.checksum) for n, t in tensors.items())),
        base=base,
        base_checksum=base_checksum,
        codec=codec.name,
        created=created,
    )
    return header, payload


def encode_delta(
    *,
    version: int,
    base: int,
    base_checksum: str | None,
    codec: str | codecs.Codec,
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, torch.dtype],
    changes: Mapping[str, Changes],
    sums: Mapping[str, int],
    pool: Executor | None = None,
) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
    """A delta from {name: (positions, new bits, old bits)} over every tensor of `shapes` (tensors
    without changes are listed with nnz 0). `sums`: each tensor's positional sum at this version."""
    c = codecs.get_codec(codec) if isinstance(codec, str) else codec
    empty = torch.zeros(0, dtype=torch.int64)
    tensors = {
        name: prepare_changes(c, shape, dtypes[name], sums.get(name, 0), changes.get(name, (empty, empty, empty)))
        for name, shape in shapes.items()
    }
    return assemble_delta(version=version, base=base, base_checksum=base_checksum, codec=c, tensors=tensors, pool=pool)


def encode_anchor(
    version: int, tensors: Mapping[str, torch.Tensor], sums: Mapping[str, int], *, created: float = 0.0
) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
    """An anchor: every tensor whole, under its Hugging Face name (a loadable checkpoint shard)."""
    header = VersionHeader(
        version=version,
        kind="anchor",
        tensors={
            n: TensorEntry(shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype], checksum=to_hex(sums[n]), nnz=t.numel())
            for n, t in tensors.items()
        },
        checksum=to_hex(combine(sums.items())),
        created=created,
    )
    return header, {n: t.contiguous() for n, t in tensors.items()}


__all__ = ["Changes", "PreparedTensor", "assemble_delta", "encode_anchor", "encode_delta", "prepare_changes"]
