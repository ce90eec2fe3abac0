"""A multi-part version read as one (`Version`): its part files checked against each other and merged
into the whole version's header and a row index, in named steps (`_in_order`, `_common_table`,
`_row_index`, `_merged_header`); `VersionLike`, what readers take."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import numpy as np
import torch

from .. import gc_pause
from ..checksums import sum_of_parts
from ..errors import FormatError
from .arrays import RowMap
from .header import PartInfo, VersionHeader, row_column
from .layout import num_rows
from .table import TensorTable
from .version_file import Piece, VersionFile


class Version:
    """The part files of one multi-part version, read as one: the same API as a VersionFile.

    `header` is the whole version's header (every tensor's shape, dtype and whole-tensor checksum;
    nnz summed over the parts; codec metadata lives in the pieces). `pieces(name)` gives one piece per
    part that changed the tensor, in position order; `dense(name)` assembles an anchor's tensor from
    the parts' rows. Opening checks that the parts agree and that their rows never overlap (and, for
    anchors, cover every tensor)."""

    def __init__(self, parts: list[VersionFile], *, expect_version: int | None = None):
        with gc_pause.paused():  # the merge makes columns of every tensor (gc_pause.py)
            self._merge(parts, expect_version)

    def _merge(self, parts: list[VersionFile], expect_version: int | None) -> None:
        """The parts in index order, one table they all agree on, where each holds which rows (checked
        at once: no per-tensor work per part beyond reading its header, what W ranks' parts of ~19K
        tensors need), and the whole version's header."""
        self.parts = _in_order(parts, expect_version)
        head = _common_table(self.parts)
        self._head = head
        self._names: dict[str, int] | None = None  # name -> column, at the first `owners`
        self._rows, self._order = _row_index(self.parts, head)
        self.header = _merged_header(self.parts, head)

    def owners(self, name: str) -> list[tuple[int, int, VersionFile]]:
        """The parts holding rows of `name`, in row order: (first row, end row, part)."""
        if self._names is None:
            self._names = {n: i for i, n in enumerate(self._head.names)}
        i = self._names[name]
        out = []
        for k in self._order[:, i].tolist():
            r0, r1 = (int(x) for x in self._rows[k, i])
            if r1 > r0:
                out.append((r0, r1, self.parts[k]))
        return out

    @property
    def version(self) -> int:
        return self.header.version

    def pieces(self, name: str) -> list[Piece]:
        if self.header.kind != "delta":
            raise FormatError("an anchor has no pieces: read it with dense()", version=self.version, tensor=name)
        return [piece for _, _, p in self.owners(name) for piece in p.pieces(name)]

    def dense(self, name: str) -> torch.Tensor:
        """An anchor's tensor: memory-mapped when one part holds it whole, else assembled from the rows."""
        if self.header.kind != "anchor":
            raise FormatError("a delta has no dense tensors", version=self.version, tensor=name)
        owners = self.owners(name)
        if len(owners) == 1:
            return owners[0][2].stored(name)
        return torch.cat([p.stored(name) for _, _, p in owners], dim=0)

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def __enter__(self) -> Version:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


VersionLike = VersionFile | Version  # what DeltaStore.open returns; readers use header/pieces/dense only


def _in_order(parts: list[VersionFile], expect_version: int | None) -> list[VersionFile]:
    """The part files sorted by index: one version (the expected one), indices 0..W-1 of W."""
    if not parts:
        raise FormatError("a version needs at least one part", version=expect_version)
    ordered = sorted(parts, key=lambda p: p.header.part.index if p.header.part else -1)
    v = ordered[0].header.version
    if expect_version is not None and v != expect_version:
        raise FormatError(f"parts hold version {v}, expected {expect_version}", version=expect_version)
    infos = [p.header.part for p in ordered]
    if any(info is None for info in infos):
        raise FormatError("a multi-part version is made of part files (format version 2)", version=v)
    indices = [info.index for info in infos if info is not None]
    counts = {info.count for info in infos if info is not None}
    if indices != list(range(len(ordered))) or counts != {len(ordered)}:
        raise FormatError(f"parts {indices} of {sorted(counts)}: expected 0..{len(ordered) - 1}", version=v)
    return ordered


_SAME = ("format_version", "version", "kind", "base", "base_checksum", "codec", "checksum")  # every part says


def _common_table(parts: list[VersionFile]) -> TensorTable:
    """Part 0's tensor table, after checking that every part has the same version fields and lists the
    same tensors with the same shapes, dtypes and checksums (a part listing them in another order has
    its table put in part 0's order)."""
    first = parts[0].header
    v = first.version
    head = TensorTable.of(first.tensors)
    names = head.names if not _held_as_arrays(head) else []  # format 5: the names only if a part differs
    for p in parts[1:]:
        h = p.header
        for key in _SAME:
            if getattr(h, key) != getattr(first, key):
                raise FormatError(
                    f"part {h.part.index if h.part else '?'} has {key} {getattr(h, key)!r}, "
                    f"part 0 has {getattr(first, key)!r}",
                    version=v,
                )
        table = TensorTable.of(h.tensors)
        if _same_arrays(table, head):  # format 5: whole arrays and one string compared
            continue
        names = names or head.names
        if table.names != names:  # the same tensors (writers list them in one order)
            table = h.tensors = _reordered(table, names, v)
        # column by column (lists compare in C); the odd tensor looked for only on failure
        if table.shapes != head.shapes or table.dtypes != head.dtypes or table.checksums != head.checksums:
            name = next(
                n
                for i, n in enumerate(names)
                if (table.shapes[i], table.dtypes[i], table.checksums[i])
                != (head.shapes[i], head.dtypes[i], head.checksums[i])
            )
            raise FormatError("parts disagree on the tensor's shape, dtype or checksum", version=v, tensor=name)
    return head


def _held_as_arrays(table: TensorTable) -> bool:
    return table._arrays is not None  # noqa: SLF001 - format 5 (a table read as arrays)


def _same_arrays(table: TensorTable, head: TensorTable) -> bool:
    """Two tables read as arrays (format 5) list the same tensors in the same order with the same
    shapes, dtypes and checksums (whole arrays and the names string compared)."""
    if not (_held_as_arrays(table) and _held_as_arrays(head)):
        return False
    a, b = table.arrays(), head.arrays()
    keys = ("ndim", "dims", "codes", "sums")
    return a.text == b.text and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in keys)


def _reordered(table: TensorTable, names: list[str], version: int) -> TensorTable:
    """`table` in the order of `names`, which must list the same tensors."""
    if set(table.names) != set(names):
        odd = sorted(set(table.names) ^ set(names))[0]
        raise FormatError("parts list different tensors", version=version, tensor=odd)
    order = [table.index(n) for n in names]
    return TensorTable(
        list(names),
        [table.shapes[i] for i in order],
        [table.dtypes[i] for i in order],
        [table.checksums[i] for i in order],
        [table.nnz[i] for i in order],
        [table.encs[i] for i in order],
    )


def _row_array(rows: Mapping[str, list[int]], names: list[str]) -> np.ndarray:
    """A part's (validated) rows as an array [tensors, 2] in `names`' order, (0, 0) where it owns none."""
    column, held = row_column(rows, names)
    out = np.zeros((len(names), 2), dtype=np.int64)
    n = int(held.sum())
    out[held] = np.fromiter(
        itertools.chain.from_iterable(itertools.compress(column, held)), dtype=np.int64, count=2 * n
    ).reshape(n, 2)
    return out


def _row_index(parts: list[VersionFile], head: TensorTable) -> tuple[np.ndarray, np.ndarray]:
    """Every part's rows of every tensor as an array [parts, tensors, 2] ((0, 0): not owned) and, per
    tensor, its parts by first row; the rows checked as arrays: no two parts overlap, and an anchor's
    parts cover every row of every tensor."""
    v, n = parts[0].header.version, len(head)
    rows = np.zeros((len(parts), n, 2), dtype=np.int64)
    for k, p in enumerate(parts):
        assert p.header.part is not None
        part_rows = p.header.part.rows
        aligned = part_rows.array_for(head.names_text) if isinstance(part_rows, RowMap) else None
        if aligned is not None and isinstance(part_rows, RowMap):  # format 5: an array in the table's order
            rows[k] = np.where(part_rows.held()[:, None], aligned, 0)
        else:
            rows[k] = _row_array(part_rows, head.names)
    order = np.argsort(rows[:, :, 0], axis=0, kind="stable")  # per tensor, its parts by first row
    r0 = np.take_along_axis(rows[:, :, 0], order, axis=0)
    r1 = np.take_along_axis(rows[:, :, 1], order, axis=0)
    held = r1 > r0
    covered = np.maximum.accumulate(np.where(held, r1, 0), axis=0)  # rows covered by the parts up to each
    before = np.vstack([np.zeros((1, n), dtype=np.int64), covered[:-1]])
    overlap = held & (r0 < before)
    if overlap.any():
        k, i = (int(x[0]) for x in np.nonzero(overlap))
        at = int(r0[k, i])
        raise FormatError(
            f"parts overlap at rows {at}..{min(int(r1[k, i]), int(before[k, i]))}", version=v, tensor=head.names[i]
        )
    if parts[0].header.kind == "anchor":
        total = np.array([num_rows(shape) for shape in head.shapes], dtype=np.int64)
        gap = held & (r0 > before)
        missing = gap.any(axis=0) | (covered[-1] != total)
        if missing.any():
            i = int(np.flatnonzero(missing)[0])
            ks = np.flatnonzero(gap[:, i])
            a, b = (int(before[ks[0], i]), int(r0[ks[0], i])) if ks.size else (int(covered[-1, i]), int(total[i]))
            raise FormatError(f"no part holds rows {a}..{b}", version=v, tensor=head.names[i])
    return rows, order


def _merged_header(parts: list[VersionFile], head: TensorTable) -> VersionHeader:
    """The whole version's header: part 0's fields and tensors, each tensor's nnz summed over the
    parts, no codec metadata (it lives in the pieces); the parts' checksums must add up to the
    version's."""
    first = parts[0].header
    nnz = np.zeros(len(head), dtype=np.int64)
    for p in parts:  # the columns, not an entry per tensor (~19K per part at 30B-A3B)
        nnz += TensorTable.of(p.header.tensors).nnz_array()
    if _held_as_arrays(head):  # format 5: arrays in, arrays out
        a = head.arrays()
        none = np.full(len(head), -1, dtype=np.int64)
        merged = dataclasses.replace(a, nnz=nnz, at=none, start=none)
        tensors = TensorTable.from_arrays(merged, head._names)  # noqa: SLF001 - the names, if made already
    else:
        tensors = TensorTable(
            list(head.names),
            [list(shape) for shape in head.shapes],
            list(head.dtypes),
            list(head.checksums),
            nnz.tolist(),
            [{} for _ in range(len(head))],
        )
    infos: list[PartInfo] = [p.header.part for p in parts if p.header.part is not None]
    total_sum = sum_of_parts(info.checksum for info in infos)
    if total_sum != first.checksum:
        raise FormatError(f"the parts' checksums add up to {total_sum}, not {first.checksum}", version=first.version)
    return VersionHeader(
        version=first.version,
        kind=first.kind,
        tensors=tensors,
        checksum=first.checksum,
        base=first.base,
        base_checksum=first.base_checksum,
        codec=first.codec,
        format_version=first.format_version,
        created=first.created,
        extra=dict(first.extra),
    )
