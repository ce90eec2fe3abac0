"""The one delta writer: per-tensor changes -> a version's header and payload (layout: format.py).

    header, payload = encode_delta(version=7, base=6, base_checksum=..., codec="chunked",
                                   shapes=..., dtypes=..., changes={name: (positions, new, old)}, sums=...)
    format.write(path, header, payload)

The Publisher splits the same work in two, so that the training thread does only the device part:
the codec's `prepare_batch` (detection output of all tensors -> codec sections, on the parameters'
device) at `publish`, `assemble_delta` (zstd packing on a thread pool, header) on the upload thread.
A sharded publisher writes one *part* per rank: `assemble_delta(..., part=PartInfo)` and
`encode_anchor_part` build a part file's header (the whole version's tensor table, the part's own
nnz and payload).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from . import codec as codecs
from .checksums import combine, to_hex
from .format import (
    DTYPE_NAMES,
    FILE_PAYLOAD,
    FORMAT_VERSION,
    PART_FORMAT_VERSION,
    STREAMS_FORMAT_VERSION,
    PartInfo,
    TensorEntry,
    VersionHeader,
    payload_key,
)

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
    return PreparedTensor(tuple(int(d) for d in shape), dtype, checksum, int(pos.numel()), sections)


def assemble_delta(
    *,
    version: int,
    base: int,
    base_checksum: str | None,
    codec: codecs.Codec,
    tensors: Mapping[str, PreparedTensor],
    pool: Executor | None = None,
    created: float = 0.0,
    checksum: str | None = None,
    part: PartInfo | None = None,
    busy_ms: list[float] | None = None,
) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
    """Pack every changed tensor (on `pool` if given: zstd releases the GIL) into a delta's header
    and payload (a file-level codec packs them all into one set of streams: format 3). The
    whole-model checksum is combined from the tensors' sums unless given. With `busy_ms`, each
    tensor's (or the file's) packing time is appended (their sum over the wall time: the parallelism).

    A part file (`part`): `tensors` lists every tensor of the version with its whole-tensor checksum
    and this part's changes (nnz, sections); pass the whole version's `checksum`."""
    changed = [n for n, t in tensors.items() if t.sections is not None]
    payload: dict[str, torch.Tensor] = {}
    file_enc: dict[str, Any] = {}
    if codecs.is_file_level(codec):
        # one set of streams for the whole file (format 3): the codec packs every changed tensor
        packed: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {n: ({}, {}) for n in changed}
        if changed:
            streams = codec.pack_file([(n, _sections(tensors[n])) for n in changed], pool, busy_ms)
            payload.update({payload_key(FILE_PAYLOAD, key): t for key, t in streams.payload.items()})
            packed = {n: ({}, streams.tensor_enc[n]) for n in changed}
            file_enc = streams.enc
        format_version = STREAMS_FORMAT_VERSION
    else:

        def pack(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            t0 = time.perf_counter()
            out = codec.pack(_sections(tensors[name]), tensors[name].dtype)
            if busy_ms is not None:
                busy_ms.append((time.perf_counter() - t0) * 1e3)
            return out

        packed = dict(zip(changed, pool.map(pack, changed) if pool is not None else map(pack, changed)))
        format_version = FORMAT_VERSION if part is None else PART_FORMAT_VERSION
    entries = {}
    for name, t in tensors.items():
        parts, meta = packed.get(name, ({}, {}))
        entries[name] = TensorEntry(
            shape=list(t.shape), dtype=DTYPE_NAMES[t.dtype], checksum=to_hex(t.checksum), nnz=t.nnz, enc=meta
        )
        payload.update({payload_key(name, key): p for key, p in parts.items()})
    header = VersionHeader(
        version=version,
        kind="delta",
        tensors=entries,
        checksum=checksum or to_hex(combine((n, t.checksum) for n, t in tensors.items())),
        base=base,
        base_checksum=base_checksum,
        codec=codec.name,
        created=created,
        format_version=format_version,
        part=part,
        enc=file_enc,
    )
    return header, payload


def _sections(t: PreparedTensor) -> codecs.Sections:
    assert t.sections is not None
    return t.sections


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


def encode_anchor_part(
    version: int,
    shapes: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype,
    sums: Mapping[str, int],
    checksum: str,
    slices: Mapping[str, torch.Tensor],
    part: PartInfo,
    *,
    created: float = 0.0,
) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
    """One part of a sharded anchor: every tensor's shape and whole-tensor checksum (`sums`), and the
    rows this part owns (`slices`, under the tensors' names; `part.rows` says which rows)."""
    entries = {}
    for name, shape in shapes.items():
        owned = slices.get(name)
        entries[name] = TensorEntry(
            shape=[int(d) for d in shape],
            dtype=DTYPE_NAMES[dtype],
            checksum=to_hex(sums[name]),
            nnz=int(owned.numel()) if owned is not None else 0,
        )
    header = VersionHeader(
        version=version,
        kind="anchor",
        tensors=entries,
        checksum=checksum,
        created=created,
        format_version=PART_FORMAT_VERSION,
        part=part,
    )
    return header, {n: t.contiguous() for n, t in slices.items()}


__all__ = [
    "Changes",
    "PreparedTensor",
    "assemble_delta",
    "encode_anchor",
    "encode_anchor_part",
    "encode_delta",
    "prepare_changes",
]
