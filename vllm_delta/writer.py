"""The one delta writer: per-tensor changes -> a version's header and payload (layout: format/).

    header, payload = encode_delta(version=7, base=6, base_checksum=..., codec="chunked",
                                   shapes=..., dtypes=..., changes={name: (positions, new, old)}, sums=...)
    format.write(path, header, payload)

The Publisher splits the same work in two, so that the training thread does only the device part:
the codec's `prepare_batch` (detection output of all tensors -> codec sections, on the parameters'
device) at `publish`, `write_delta` (packing on a thread pool or nvCOMP, header, file) on the upload
thread; for the chunked codec the file is written while it is encoded (format.PayloadWriter).
A sharded publisher writes one *part* per rank: `assemble_delta(..., part=PartInfo)` and
`encode_anchor_part` build a part file's header (the whole version's tensor table, the part's own
nnz and payload).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import codec as codecs
from .checksums import combine, to_hex
from .format import (
    ARRAYS_FORMAT_VERSION,
    COLUMNS_FORMAT_VERSION,
    DTYPE_CODES,
    DTYPE_NAMES,
    FILE_PAYLOAD,
    FORMAT_VERSION,
    PART_FORMAT_VERSION,
    STREAMS_FORMAT_VERSION,
    PartInfo,
    PayloadWriter,
    RowMap,
    TableArrays,
    TensorTable,
    VersionHeader,
    join_names,
    payload_key,
    write,
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
    columns: bool = True,
) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
    """Pack every changed tensor (on `pool` if given: zstd releases the GIL) into a delta's header
    and payload (a file-level codec packs them all into one set of streams: format 4, or 3 without
    `columns`). The
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
        format_version = COLUMNS_FORMAT_VERSION if columns else STREAMS_FORMAT_VERSION
    else:

        def pack(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            t0 = time.perf_counter()
            out = codec.pack(_sections(tensors[name]), tensors[name].dtype)
            if busy_ms is not None:
                busy_ms.append((time.perf_counter() - t0) * 1e3)
            return out

        packed = dict(zip(changed, pool.map(pack, changed) if pool is not None else map(pack, changed)))
        format_version = FORMAT_VERSION if part is None else PART_FORMAT_VERSION
    for name, (parts, _) in packed.items():
        payload.update({payload_key(name, key): p for key, p in parts.items()})
    header = _delta_header(
        DeltaOf(version, base, base_checksum, created, checksum, part, columns),
        codec,
        tensors,
        {n: meta for n, (_, meta) in packed.items()},
        file_enc,
        format_version,
    )
    return header, payload


@dataclass(frozen=True)
class DeltaOf:
    """What a delta is, besides its tensors: its version, base, creation time, and for a part file
    the part and the whole version's checksum (None: combined from the tensors' sums)."""

    version: int
    base: int
    base_checksum: str | None
    created: float = 0.0
    checksum: str | None = None
    part: PartInfo | None = None
    # a file-level codec's header as columns (format 4); False: format 3, for readers from before format 4
    columns: bool = True

    def header(
        self,
        table: TensorTable,
        codec: str,
        checksum: str,
        format_version: int,
        enc: dict[str, Any],
        part: PartInfo | None,
    ) -> VersionHeader:
        """This delta's header, given its table, its whole checksum, its file-level `enc` and its part."""
        return VersionHeader(
            version=self.version,
            kind="delta",
            tensors=table,
            checksum=checksum,
            base=self.base,
            base_checksum=self.base_checksum,
            codec=codec,
            created=self.created,
            format_version=format_version,
            part=part,
            enc=enc,
        )


def _delta_header(
    of: DeltaOf,
    codec: codecs.Codec,
    tensors: Mapping[str, PreparedTensor],
    tensor_enc: Mapping[str, dict[str, Any]],
    file_enc: dict[str, Any],
    format_version: int,
) -> VersionHeader:
    names, values = list(tensors), list(tensors.values())
    table = TensorTable(  # columns: no object per tensor (a model of tens of thousands of tensors)
        names,
        [list(t.shape) for t in values],
        [DTYPE_NAMES[t.dtype] for t in values],
        [to_hex(t.checksum) for t in values],
        [t.nnz for t in values],
        [tensor_enc.get(name) or {} for name in names],
    )
    checksum = of.checksum or to_hex(combine((n, t.checksum) for n, t in tensors.items()))
    return of.header(table, codec.name, checksum, format_version, file_enc, of.part)


def write_delta(
    path: str,
    of: DeltaOf,
    codec: codecs.Codec,
    tensors: Mapping[str, PreparedTensor],
    *,
    pool: Executor | None = None,
    busy_ms: list[float] | None = None,
    timings: dict[str, float] | None = None,
) -> VersionHeader:
    """`assemble_delta` written to `path`. A file-level codec streams its payload into the file as it
    is encoded (format.PayloadWriter: the GPU path compresses, copies and writes in overlapping
    runs; the header goes in last); other codecs pack everything, then write. `timings` gets "pack"
    (ms until the codec's packing returned: for a streamed file, with the writes it overlapped) and
    "write" (the rest: the whole write, or the writes still in flight and the header)."""
    times = timings if timings is not None else {}
    t0 = time.perf_counter()
    changed = [n for n, t in tensors.items() if t.sections is not None]
    if not (codecs.is_file_level(codec) and changed):
        header, payload = assemble_delta(
            version=of.version,
            base=of.base,
            base_checksum=of.base_checksum,
            codec=codec,
            tensors=tensors,
            pool=pool,
            created=of.created,
            checksum=of.checksum,
            part=of.part,
            busy_ms=busy_ms,
            columns=of.columns,
        )
        t1 = time.perf_counter()
        write(path, header, payload)
    else:
        plan = codec.plan_file([(n, _sections(tensors[n])) for n in changed])
        format_version = COLUMNS_FORMAT_VERSION if of.columns else STREAMS_FORMAT_VERSION
        header = _delta_header(of, codec, tensors, plan.tensor_enc, plan.enc, format_version)
        return _stream_file(path, header, plan, pool, busy_ms, times, t0)
    times["pack"], times["write"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    return header


def _stream_file(
    path: str,
    header: VersionHeader,
    plan: codecs.FileWrite,
    pool: Executor | None,
    busy_ms: list[float] | None,
    times: dict[str, float],
    t0: float,
) -> VersionHeader:
    """A file-level codec's `plan` streamed into `path` under `header` (format.PayloadWriter); `times`
    gets "pack" (from `t0` until the plan's writes were handed on) and "write" (the rest)."""
    parts = [(payload_key(FILE_PAYLOAD, key), dtype, ndim) for key, dtype, ndim in plan.parts]
    with PayloadWriter(path, header, parts, pool, size_hint=plan.size_hint) as out:
        plan.write_to(_FileParts(out), pool, busy_ms)
        t1 = time.perf_counter()
    times["pack"], times["write"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    return header


@dataclass(frozen=True)
class TableTemplate:
    """What a delta's tensor table holds that depends only on its tensor set and this writer's share of
    it (the same for every version of a run): the names in header order (sorted) and joined, shapes and
    dtypes as arrays, where each tensor of the source order and each owned tensor lands in the header,
    and a part's rows as an array. Made once (`of`); each version then adds its own columns (`table`)
    as array operations: format 5, written with no object per tensor."""

    source: list[str]  # the tensor set in the caller's order (what `sums` lists)
    names: list[str]  # header order
    text: str
    order: np.ndarray  # header position -> source index
    owned_at: np.ndarray  # owned tensor (in the caller's owned order) -> header position
    ndim: np.ndarray
    dims: np.ndarray
    codes: np.ndarray
    rows: np.ndarray  # [T, 2] in header order: the rows the writer owns, -1, -1 where none

    @classmethod
    def of(
        cls,
        shapes: Mapping[str, tuple[int, ...]],
        dtype: torch.dtype,
        owned: Sequence[tuple[str, int, int]],
    ) -> TableTemplate:
        """`shapes`: every tensor of the version; `owned`: (name, row0, row1) of each tensor this
        writer changes, in the order its batch lists them."""
        source = list(shapes)
        order = np.array(sorted(range(len(source)), key=source.__getitem__), dtype=np.int64)
        names = [source[i] for i in order.tolist()]
        pos = {n: i for i, n in enumerate(names)}
        ordered = [shapes[n] for n in names]
        n = len(names)
        rows = np.full((n, 2), -1, dtype=np.int64)
        owned_at = np.fromiter((pos[name] for name, _, _ in owned), dtype=np.int64, count=len(owned))
        if len(owned):
            rows[owned_at] = np.array([(r0, r1) for _, r0, r1 in owned], dtype=np.int64)
        return cls(
            source=source,
            names=names,
            text=join_names(names),
            order=order,
            owned_at=owned_at,
            ndim=np.fromiter(map(len, ordered), dtype=np.uint8, count=n),
            dims=np.fromiter(itertools.chain.from_iterable(ordered), dtype=np.int64),
            codes=np.full(n, DTYPE_CODES.index(DTYPE_NAMES[dtype]), dtype=np.uint8),
            rows=rows,
        )

    def table(
        self, sums: Mapping[str, int] | np.ndarray, counts: Sequence[int], at: np.ndarray, start: np.ndarray
    ) -> TensorTable:
        """One version's table: whole-tensor checksums `sums` (every tensor, in the source order: a
        mapping by name, or a uint64 array), and per owned tensor its changed elements and place in the
        streams (`at`, `start`: -1 for none)."""
        n = len(self.names)
        if isinstance(sums, np.ndarray):
            if sums.shape != (n,):
                raise ValueError(f"the version's checksums are {sums.shape[0]} values, not one per tensor ({n})")
            by_source = sums.astype(np.uint64, copy=False)
        else:
            if len(sums) != n or list(sums) != self.source:  # list compare: the same str objects, in C
                raise ValueError("the version's checksums do not list the table's tensors in its order")
            by_source = np.fromiter(sums.values(), dtype=np.uint64, count=n)
        nnz = np.zeros(n, dtype=np.int64)
        at_col = np.full(n, -1, dtype=np.int64)
        start_col = np.full(n, -1, dtype=np.int64)
        nnz[self.owned_at] = np.asarray(counts, dtype=np.int64)
        at_col[self.owned_at] = at
        start_col[self.owned_at] = start
        arrays = TableArrays(
            self.text, n, self.ndim, self.dims, self.codes, by_source[self.order], nnz, at_col, start_col
        )
        return TensorTable.from_arrays(arrays, self.names)


def write_delta_arrays(
    path: str,
    of: DeltaOf,
    codec: codecs.FileCodec,
    batch: codecs.BatchSections,
    template: TableTemplate,
    sums: Mapping[str, int] | np.ndarray,
    counts: Sequence[int],
    *,
    pool: Executor | None = None,
    busy_ms: list[float] | None = None,
    timings: dict[str, float] | None = None,
) -> VersionHeader:
    """`write_delta` for a file-level codec's whole batch, in format 5: the header's table made from
    arrays (`template` and this version's `sums`, `counts` and the codec's places), no dict,
    `PreparedTensor` or `Sections` per tensor. `of.checksum`: the whole version's (required)."""
    if of.checksum is None:
        raise ValueError("write_delta_arrays needs the version's checksum")
    times = timings if timings is not None else {}
    t0 = time.perf_counter()
    plan = codec.plan_batch(batch)
    plan.set_tensor_rows(template.owned_at)  # a file with rank blocks names its tensors by header row
    at, start = plan.enc_arrays()
    table = template.table(sums, counts, at, start)
    part = of.part
    if part is not None:
        part = dataclasses.replace(part, rows=RowMap(template.text, template.rows, template.names))
    header = of.header(table, codec.name, of.checksum, ARRAYS_FORMAT_VERSION, plan.enc, part)
    return _stream_file(path, header, plan, pool, busy_ms, times, t0)


class _FileParts:
    """A file-level codec's parts, stored under `::<part>` (codecs.PayloadSink)."""

    def __init__(self, out: PayloadWriter):
        self.out = out

    def append(self, part: str, data: torch.Tensor, ready: Callable[[], None] | None = None) -> None:
        self.out.append(payload_key(FILE_PAYLOAD, part), data, ready)

    def restart(self) -> None:
        self.out.restart()


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
        tensors=TensorTable(
            list(tensors),
            [list(t.shape) for t in tensors.values()],
            [DTYPE_NAMES[t.dtype] for t in tensors.values()],
            [to_hex(sums[n]) for n in tensors],
            [t.numel() for t in tensors.values()],
            [{} for _ in tensors],
        ),
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
    names = list(shapes)
    table = TensorTable(
        names,
        [[int(d) for d in shape] for shape in shapes.values()],
        [DTYPE_NAMES[dtype]] * len(names),
        [to_hex(sums[name]) for name in names],
        [int(s.numel()) if (s := slices.get(name)) is not None else 0 for name in names],
        [{} for _ in names],
    )
    header = VersionHeader(
        version=version,
        kind="anchor",
        tensors=table,
        checksum=checksum,
        created=created,
        format_version=PART_FORMAT_VERSION,
        part=part,
    )
    return header, {n: t.contiguous() for n, t in slices.items()}


__all__ = [
    "Changes",
    "DeltaOf",
    "PreparedTensor",
    "TableTemplate",
    "assemble_delta",
    "encode_anchor",
    "encode_anchor_part",
    "encode_delta",
    "prepare_changes",
    "write_delta",
    "write_delta_arrays",
]
