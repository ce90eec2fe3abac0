"""A version file's header (`VersionHeader`, and a part file's `PartInfo`): the JSON document its
metadata holds, read by format version, checked, and written back (keys sorted, no spaces)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import wire
from ..checksums import is_hex
from ..errors import FormatError
from ..wire import Closed, Number, omit_none, omit_when, types_of
from .arrays import RowMap, TableArrays, pack, unpack
from .layout import (
    ARRAYS_FORMAT_VERSION,
    COLUMNS_FORMAT_VERSION,
    FORMAT_VERSION,
    JSON_SEPARATORS,
    PART_FORMAT_VERSION,
    READ_FORMAT_VERSIONS,
    STREAMS_FORMAT_VERSION,
    STREAMS_FORMAT_VERSIONS,
    VersionKind,
    is_kind,
)
from .table import EMPTY_TABLE, TensorTable

_TABLE_MARK = "\x00vllm-delta tensor table\x00"  # where VersionHeader.to_json puts the table's text
_TABLE_MARK_JSON = json.dumps(_TABLE_MARK)


@dataclass
class PartInfo(Closed):
    """What a part file (format version 2) says about itself."""

    index: int  # 0 <= index < count
    count: int  # parts of the version
    checksum: str  # Σ_t key(t) · (partial sum of t over the elements this part owns); parts add up to the whole
    # tensor -> [row0, row1): the dim-0 rows it owns (a dict; read from format 5: a RowMap, one array)
    rows: Mapping[str, list[int]] = field(default_factory=dict)


@dataclass
class VersionHeader(Closed):
    """The `header` of a version file's metadata: a JSON object through the wire codec (wire.py), keys
    sorted, no spaces. A header with a key this reader does not know is refused (a newer format)."""

    version: int
    kind: VersionKind
    tensors: TensorTable  # a dict of TensorEntry is taken too (made a table)
    checksum: str  # whole-model checksum at this version
    base: int | None = None  # deltas: the version they apply to
    base_checksum: str | None = None  # deltas: whole-model checksum of the base
    codec: str | None = None  # deltas
    format_version: int = FORMAT_VERSION
    created: Number = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    part: PartInfo | None = omit_none()  # part files only (one-file headers are exactly format 1)
    # format 3: the file-level codec's metadata (absent from formats 1 and 2: what their readers know)
    enc: dict[str, Any] = omit_when(lambda h: h.format_version < STREAMS_FORMAT_VERSION, default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, TensorTable):
            self.tensors = TensorTable.of(self.tensors)

    @property
    def nnz(self) -> int:
        return int(self.tensors.nnz_array().sum())

    @property
    def numel(self) -> int:
        return int(self.tensors.numel_array().sum())

    def to_json(self) -> str:
        """Keys sorted, no spaces. Format 4: the tensor table as columns and a part's rows as one list
        in the table's order (`_columns_doc`). Formats 1-3: the tensor table is written as text by the
        table itself (the same bytes `json.dumps` makes of its plain form, without a dict per tensor)
        into the rest."""
        if self.format_version == ARRAYS_FORMAT_VERSION:
            return json.dumps(self._arrays_doc(), separators=JSON_SEPARATORS, sort_keys=True)
        if self.format_version == COLUMNS_FORMAT_VERSION:
            return json.dumps(self._columns_doc(), separators=JSON_SEPARATORS, sort_keys=True)
        part = self.part
        if part is not None and type(part.rows) is not dict:
            part = dataclasses.replace(part, rows=dict(part.rows))
        doc = wire.encode(dataclasses.replace(self, tensors=EMPTY_TABLE, part=part))
        doc["tensors"] = _TABLE_MARK
        text = json.dumps(doc, separators=JSON_SEPARATORS, sort_keys=True)
        head, mark, tail = text.rpartition(_TABLE_MARK_JSON)
        if not mark or _TABLE_MARK_JSON in head:  # a field of the header holds the mark's text: no shortcut
            whole = dataclasses.replace(self, part=part)
            return json.dumps(wire.encode(whole), separators=JSON_SEPARATORS, sort_keys=True)
        return head + self.tensors.to_json() + tail

    def _columns_doc(self) -> dict[str, Any]:
        table = self.tensors
        order = table.sorted_order()
        doc: dict[str, Any] = wire.encode(dataclasses.replace(self, tensors=EMPTY_TABLE, part=None))
        doc["tensors"] = table.to_columns(order)
        if self.part is not None:
            rows = self.part.rows
            if not rows.keys() <= set(table.names):
                raise ValueError(f"part {self.part.index} owns rows of tensors the table does not list")
            part = wire.encode(dataclasses.replace(self.part, rows={}))
            part["rows"] = [rows.get(table.names[i]) for i in order]
            doc["part"] = part
        return doc

    def _arrays_doc(self) -> dict[str, Any]:
        """Format 5: the table as packed arrays (in the table's order: writers give it sorted) and a
        part's rows as one packed array in that order."""
        table = self.tensors
        doc: dict[str, Any] = wire.encode(dataclasses.replace(self, tensors=EMPTY_TABLE, part=None))
        arrays = table.arrays()
        doc["tensors"] = arrays.to_doc()
        if self.part is not None:
            rows = RowMap.of(self.part.rows, table.names, arrays.text)
            part = wire.encode(dataclasses.replace(self.part, rows={}))
            part["rows"] = pack(rows.array, "i64")
            doc["part"] = part
        return doc

    @classmethod
    def _from_arrays(cls, raw: dict[str, Any], where: str) -> VersionHeader:
        """A format-5 header: the arrays made a table and a part's rows a RowMap, the rest through the
        wire codec."""
        raw, tensors, packed = _split_table(raw)
        arrays = TableArrays.from_doc(tensors, where or "header")
        header = wire.decode(cls, raw)
        header.tensors = TensorTable.from_arrays(arrays)
        if header.part is not None:
            rows = unpack(packed, "i64", 2 * arrays.count, "part rows", where or "header")
            header.part.rows = RowMap(arrays.text, rows.reshape(-1, 2))
        return header

    @classmethod
    def _from_columns(cls, raw: dict[str, Any], where: str) -> VersionHeader:
        """A format-4 header: the columns made a table and a part's rows a mapping again, the rest
        through the wire codec."""
        raw, tensors, column = _split_table(raw)
        table = TensorTable.from_columns(tensors, where or "header")
        if isinstance(raw.get("part"), dict) and (type(column) is not list or len(column) != len(table.names)):
            raise FormatError(f"a part's rows in {where or 'header'}: one entry (a range or null) per tensor")
        header = wire.decode(cls, raw)
        header.tensors = table
        if header.part is not None and column is not None:
            header.part.rows = {n: r for n, r in zip(table.names, column) if r is not None}
        return header

    @classmethod
    def from_json(cls, text: str, *, where: str = "") -> VersionHeader:
        """A header from its text, decoded (`from_plain_doc`) and checked (`validate`)."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise FormatError(f"malformed version header in {where or 'file'}: {exc}") from None
        header = cls.from_plain_doc(raw, where=where)
        header.validate()
        return header

    @classmethod
    def from_plain_doc(cls, raw: Any, *, where: str = "") -> VersionHeader:
        """A header from its parsed JSON, by format version (format 4: `_from_columns`); not yet
        checked (`validate`)."""
        try:
            fv = raw.get("format_version") if isinstance(raw, dict) else None
            if isinstance(fv, bool) or fv not in READ_FORMAT_VERSIONS:
                raise FormatError(
                    f"unknown format version {fv!r} in {where or 'header'} (this reader knows "
                    f"{', '.join(map(str, READ_FORMAT_VERSIONS))})",
                    version=raw.get("version") if isinstance(raw, dict) else None,
                )
            if fv not in STREAMS_FORMAT_VERSIONS and (fv == PART_FORMAT_VERSION) != ("part" in raw):
                raise FormatError(f"format version {fv} {'needs' if fv == 2 else 'has no'} a part description")
            if fv not in STREAMS_FORMAT_VERSIONS and "enc" in raw:
                raise FormatError(f"format version {fv} has no file-level codec metadata")
            if fv == ARRAYS_FORMAT_VERSION:
                return cls._from_arrays(raw, where)
            return cls._from_columns(raw, where) if fv == COLUMNS_FORMAT_VERSION else wire.decode(cls, raw)
        except FormatError:
            raise
        except (ValueError, TypeError) as exc:
            raise FormatError(f"malformed version header in {where or 'file'}: {exc}") from None

    def validate(self) -> None:
        v = self.version
        if not isinstance(v, int) or v < 0:
            raise FormatError(f"bad version number {v!r}")
        if not is_kind(self.kind):
            raise FormatError(f"unknown kind {self.kind!r}", version=v)
        if self.kind == "delta" and (not isinstance(self.base, int) or self.base >= v or not self.codec):
            raise FormatError(f"delta needs a codec and a base below it (base={self.base!r})", version=v)
        if self.format_version in STREAMS_FORMAT_VERSIONS and (self.kind != "delta" or not isinstance(self.enc, dict)):
            raise FormatError(
                f"format version {self.format_version} is a delta with its file-level codec metadata", version=v
            )
        if not is_hex(self.checksum) or not (self.base_checksum is None or is_hex(self.base_checksum)):
            raise FormatError("checksum and base_checksum must be 16 lower-case hex digits", version=v)
        self.tensors.check(v)
        if self.part is not None:
            self._validate_part(self.part)

    def _validate_part(self, part: PartInfo) -> None:
        v = self.version
        ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (part.index, part.count))
        if not ok or not 0 <= part.index < part.count or not isinstance(part.rows, (dict, RowMap)):
            raise FormatError(f"bad part description {part.index!r} of {part.count!r}", version=v)
        if not is_hex(part.checksum):
            raise FormatError(f"a checksum is 16 lower-case hex digits, not {part.checksum!r:.40}", version=v)
        table = TensorTable.of(self.tensors)  # column by column: no entry object per tensor
        anchor = self.kind == "anchor"
        if _rows_fit(table, part.rows, anchor):
            return
        for name, shape, nnz in zip(table.names, table.shapes, table.nnz):
            rows = part.rows.get(name)
            if rows is None:
                if nnz:
                    raise FormatError(f"part {part.index} changes a tensor it does not own", version=v, tensor=name)
                continue
            if (
                type(rows) is not list
                or len(rows) != 2
                or not isinstance(rows[0], int)
                or not isinstance(rows[1], int)
                or not 0 <= rows[0] < rows[1] <= (shape[0] if shape else 1)  # num_rows, inlined
            ):
                raise FormatError(f"part {part.index}: bad row range {rows!r}", version=v, tensor=name)
            owned = (rows[1] - rows[0]) * (math.prod(shape[1:]) if len(shape) > 1 else 1)  # row_size
            if nnz > owned or (anchor and nnz != owned):
                raise FormatError(f"part {part.index}: nnz {nnz} for {owned} owned elements", version=v, tensor=name)
        unknown = set(part.rows) - set(self.tensors)
        if unknown:
            raise FormatError(f"part {part.index} owns rows of unknown tensors {sorted(unknown)[:3]}", version=v)


def row_column(rows: Mapping[str, Any], names: list[str]) -> tuple[list[Any], np.ndarray]:
    """A part's row ranges in `names`' order (None where it owns none), and where it owns rows."""
    column: list[Any] = list(map(rows.get, names))
    held = np.fromiter(map(operator.is_not, column, itertools.repeat(None)), dtype=bool, count=len(names))
    return column, held


def _rows_fit(table: TensorTable, rows: Mapping[str, Any], anchor: bool) -> bool:
    """Whether a part's row ranges are well formed and hold its nnz, checked as arrays: every range
    a list of two ints with 0 <= row0 < row1 <= the tensor's rows; nnz at most the owned elements
    (an anchor: exactly); nnz 0 where it owns no rows; no rows of an unlisted tensor. False sends the
    caller to its per-tensor loop, which names what is wrong."""
    if isinstance(rows, RowMap):
        return _row_array_fits(table, rows, anchor)
    names = table.names
    column, held = row_column(rows, names)
    owned = list(itertools.compress(column, held))
    if len(owned) != len(rows) or not types_of(owned) <= {list} or not set(map(len, owned)) <= {2}:
        return False
    if not types_of(itertools.chain.from_iterable(owned)) <= {int}:
        return False
    shapes = list(itertools.compress(table.shapes, held))
    try:
        r = np.fromiter(itertools.chain.from_iterable(owned), dtype=np.int64, count=2 * len(owned)).reshape(-1, 2)
        dim0 = np.fromiter(map(operator.itemgetter(0), shapes), dtype=np.int64, count=len(shapes))
        numel = np.fromiter(map(math.prod, shapes), dtype=np.int64, count=len(shapes))
        nnz = np.asarray(table.nnz, dtype=np.int64)
    except (IndexError, OverflowError):  # a scalar (shape []) or a number past int64: the loop decides
        return False
    r0, r1 = r[:, 0], r[:, 1]
    if not ((r0 >= 0) & (r0 < r1) & (r1 <= dim0)).all():
        return False
    own = (r1 - r0) * (numel // np.maximum(dim0, 1))  # rows x row size (dim0 > 0 wherever r0 < r1 <= dim0)
    mine = nnz[held]
    return bool((mine == own).all() if anchor else (mine <= own).all()) and not nnz[~held].any()


def _row_array_fits(table: TensorTable, rows: RowMap, anchor: bool) -> bool:
    """`_rows_fit` for rows held as an array (format 5), aligned with the table's names."""
    r = rows.array_for(table.names_text)
    if r is None:
        return False
    arrays = table.arrays()
    held = rows.held()
    r0, r1 = r[:, 0], r[:, 1]
    dim0, numel, nnz = arrays.dim0(), arrays.numel(), arrays.nnz
    fits = (r0 >= 0) & (r0 < r1) & (r1 <= dim0)
    if not fits[held].all():
        return False
    own = (r1 - r0) * (numel // np.maximum(dim0, 1))
    mine, theirs = nnz[held], own[held]
    return bool((mine == theirs).all() if anchor else (mine <= theirs).all()) and not nnz[~held].any()


def _split_table(raw: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
    """A columnar header (formats 4 and 5) as the wire codec decodes it: a copy without its table and
    without its part's rows, and those two as they were written (their readers check them)."""
    raw = dict(raw)
    tensors = raw.pop("tensors", None)
    raw["tensors"] = {}
    rows = None
    if isinstance(raw.get("part"), dict):
        raw["part"] = dict(raw["part"])
        rows = raw["part"].pop("rows", None)
    return raw, tensors, rows
