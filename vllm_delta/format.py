"""Version files <-> tensors. The only module that knows the on-disk layout (docs/FORMAT.md).

A version file is a safetensors file. Its `__metadata__` holds `format` ("vllm-delta"),
`format_version` and `header`, a JSON document (`VersionHeader`). An anchor stores every tensor
under its Hugging Face name, so an anchor file is itself a loadable checkpoint shard. A delta stores
each changed tensor's codec payload under `<hf name>::<part>`.

A version is one file (format version 1, what a single-process Publisher writes) or several *part*
files (format version 2, one per rank of a sharded publisher). Format version 3 is a delta (one file
or a part) written with a *file-level* codec (`chunked`): its payload is one set of streams for
every changed tensor, stored under `::<part>` keys (an empty tensor name), the file's codec metadata
in the header's `enc`, and each tensor's place in the streams in its own `enc`. Format version 4 (what
writers write for a file-level codec) is format 3 with the header's tensor table written as columns
(one list per field, `TensorTable.to_columns`) and a part's rows as one list in the table's order: a
header is parsed without a JSON object per tensor, and a part's header without each name twice.
A part file's header is the whole version's header (every tensor's shape, dtype and whole-tensor
checksum) with the part's own `nnz` and codec metadata per tensor, plus `part`: its index, the part
count, the rows of dim 0 it owns of each tensor, and the additive checksum of what it contributes.
`Version` reads the parts of one version as one: readers see the same API (`header`, `pieces`,
`dense`) for one file and for many.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import mmap
import operator
import os
import re
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quote
from typing import Any, Literal, NamedTuple, TypeGuard, get_args

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save, save_file

from . import gc_pause, mapped_writes, wire
from .checksums import is_hex, sum_of_parts
from .errors import FormatError, ShapeMismatchError
from .wire import Closed, Number, omit_none, omit_when, types_of

FORMAT_NAME = "vllm-delta"
FORMAT_VERSION = 1  # one-file versions
PART_FORMAT_VERSION = 2  # part files of multi-part versions
STREAMS_FORMAT_VERSION = 3  # deltas of a file-level codec (one file or a part)
COLUMNS_FORMAT_VERSION = 4  # format 3 with the tensor table and a part's rows written as columns
STREAMS_FORMAT_VERSIONS = (STREAMS_FORMAT_VERSION, COLUMNS_FORMAT_VERSION)  # what a file-level codec's deltas are
READ_FORMAT_VERSIONS = (FORMAT_VERSION, PART_FORMAT_VERSION, STREAMS_FORMAT_VERSION, COLUMNS_FORMAT_VERSION)
FILE_PAYLOAD = ""  # the tensor name of a file-level codec's payload keys (`::<part>`)
VersionKind = Literal["anchor", "delta"]  # what a version is: a full image, or the changes since its base
KINDS: tuple[VersionKind, ...] = get_args(VersionKind)
SEP = "::"

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Every safetensors dtype a version file's payload uses (codec parts: positions, blobs, values).
_ST_DTYPES = {
    **DTYPES,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def is_kind(value: object) -> TypeGuard[VersionKind]:
    """Whether `value` is a version kind (the check where a kind comes in as a plain string)."""
    return value in KINDS


def num_rows(shape: list[int] | tuple[int, ...]) -> int:
    """Rows of dim 0 (a 0-d tensor is one row of one element): the unit parts own."""
    return int(shape[0]) if len(shape) else 1


def row_size(shape: list[int] | tuple[int, ...]) -> int:
    """Elements per row of dim 0."""
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n


@dataclass
class TensorEntry(Closed):
    shape: list[int]
    dtype: str  # "BF16" | "F16" | "F32"
    checksum: str  # per-tensor positional sum of the whole tensor at this version (16 hex digits)
    nnz: int = 0  # changed elements (deltas); stored elements for anchors (numel in one-file versions)
    enc: dict[str, Any] = field(default_factory=dict)  # codec metadata (deltas, changed tensors only)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


_ENTRY_KEYS = frozenset(("shape", "dtype", "checksum", "nnz", "enc"))
_ENTRY_REQUIRED = frozenset(("shape", "dtype", "checksum"))
_HEX_RUN = re.compile(r"[0-9a-f]*")


class TensorTable(Mapping[str, TensorEntry]):
    """A header's tensors: one column per field, the entries made on demand.

    A header lists every tensor of the model (a mixture of experts: tens of thousands), and every
    reader parses it and every publish writes it. As columns it is read from JSON, checked and written
    back with a handful of list passes instead of an object and a generic decode per tensor (issue 25:
    per-tensor Python on the publish-to-live path); `table[name]` and iteration still give
    `TensorEntry`s (made afresh: changing one changes nothing; `table[name] = entry` replaces one).
    """

    __slots__ = ("names", "shapes", "dtypes", "checksums", "nnz", "encs", "_index")

    def __init__(
        self,
        names: list[str],
        shapes: list[list[int]],
        dtypes: list[str],
        checksums: list[str],
        nnz: list[int],
        encs: list[dict[str, Any]],
    ):
        if not len(names) == len(shapes) == len(dtypes) == len(checksums) == len(nnz) == len(encs):
            raise ValueError("a tensor table's columns differ in length")
        self.names, self.shapes, self.dtypes = names, shapes, dtypes
        self.checksums, self.nnz, self.encs = checksums, nnz, encs
        self._index: dict[str, int] | None = None

    @classmethod
    def of(cls, entries: Mapping[str, TensorEntry]) -> TensorTable:
        if isinstance(entries, TensorTable):
            return entries
        values = list(entries.values())
        return cls(
            list(entries),
            [e.shape for e in values],
            [e.dtype for e in values],
            [e.checksum for e in values],
            [e.nnz for e in values],
            [e.enc for e in values],
        )

    # -- the plain form (wire.py) ----------------------------------------------------------------
    def to_plain(self) -> dict[str, dict[str, Any]]:
        return {
            n: {"checksum": c, "dtype": d, "enc": e, "nnz": k, "shape": s}
            for n, s, d, c, k, e in zip(self.names, self.shapes, self.dtypes, self.checksums, self.nnz, self.encs)
        }

    @classmethod
    def from_plain(cls, data: Any, where: Any) -> TensorTable:
        """The table of a parsed header; anything but well-formed entries goes through the generic
        decoder (wire.decode_as), whose error names the tensor and the field."""
        if type(data) is dict:
            entries = list(data.values())
            if _well_keyed(entries):
                shapes = [e["shape"] for e in entries]
                dtypes = [e["dtype"] for e in entries]
                checksums = [e["checksum"] for e in entries]
                nnz = [e.get("nnz", 0) for e in entries]
                encs = [e.get("enc", _NO_ENC) for e in entries]
                if (
                    types_of(shapes) <= {list}
                    and types_of(itertools.chain.from_iterable(shapes)) <= {int}
                    and types_of(dtypes) <= {str}
                    and types_of(checksums) <= {str}
                    and types_of(nnz) <= {int}
                    and types_of(encs) <= {dict}
                ):
                    return cls(
                        list(data), shapes, dtypes, checksums, nnz, [dict(e) if e is _NO_ENC else e for e in encs]
                    )
        return cls.of(wire.decode_as(dict[str, TensorEntry], data, where))

    def to_json(self) -> str:
        """The table as `json.dumps(self.to_plain(), sort_keys=True, separators=(",", ":"))` writes it,
        made as text: columns of exact ints and strings are formatted directly (checked column by
        column first); a value of any other type sends the table through json.dumps."""
        names, shapes = self.names, self.shapes
        if not (
            all(type(x) is str for x in names)
            and all(type(x) is str for x in self.dtypes)
            and all(type(x) is str for x in self.checksums)
            and all(type(x) is int for x in self.nnz)
            and all(type(d) is int for s in shapes for d in s)
        ):
            return json.dumps(self.to_plain(), separators=_SEPARATORS, sort_keys=True)
        quoted = list(map(_quote, names))
        dtypes = list(map(_quote, self.dtypes))
        checksums = list(map(_quote, self.checksums))
        encs = list(map(_enc_text, self.encs))
        dims = [",".join(map(str, s)) for s in shapes]
        nnz = self.nnz
        order = sorted(range(len(names)), key=names.__getitem__)
        return (
            "{"
            + ",".join(
                f'{quoted[i]}:{{"checksum":{checksums[i]},"dtype":{dtypes[i]},"enc":{encs[i]},'
                f'"nnz":{nnz[i]},"shape":[{dims[i]}]}}'
                for i in order
            )
            + "}"
        )

    # -- the column form (format version 4) ---------------------------------------------------------
    def sorted_order(self) -> list[int]:
        """The columns' positions in name order (what every written table lists)."""
        return sorted(range(len(self.names)), key=self.names.__getitem__)

    def to_columns(self, order: list[int]) -> dict[str, Any]:
        """The table as format 4 writes it, in `order`: `{"checksum": [...], "dtype": [...], "enc":
        {"at": [...], "start": [...]}, "name": [...], "nnz": [...], "shape": [[...], ...]}`. A tensor's
        `enc` is a file-level codec's place in the streams, `{"at", "start"}` (both ints), or empty
        (both null): any other `enc` has no column form (ValueError)."""
        at: list[int | None] = []
        start: list[int | None] = []
        for i in order:
            e = self.encs[i]
            if not e:
                at.append(None)
                start.append(None)
            elif len(e) == 2 and type(e.get("at")) is int and type(e.get("start")) is int:
                at.append(e["at"])
                start.append(e["start"])
            else:
                raise ValueError(f"tensor {self.names[i]}: enc {e!r} has no column form (format 4 takes at, start)")
        return {
            "checksum": [self.checksums[i] for i in order],
            "dtype": [self.dtypes[i] for i in order],
            "enc": {"at": at, "start": start},
            "name": [self.names[i] for i in order],
            "nnz": [self.nnz[i] for i in order],
            "shape": [self.shapes[i] for i in order],
        }

    @classmethod
    def from_columns(cls, data: Any, where: str) -> TensorTable:
        """The table of a format-4 header (`to_columns`), its columns' types checked column by column
        in C. Values (hex checksums, known dtypes, nnz within the shape) are `check`'s business."""
        if type(data) is not dict or data.keys() != _COLUMN_KEYS:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise FormatError(f"malformed tensor columns in {where}: fields {keys}, expected {sorted(_COLUMN_KEYS)}")
        enc = data["enc"]
        if type(enc) is not dict or enc.keys() != {"at", "start"}:
            raise FormatError(f"malformed tensor columns in {where}: enc must hold the columns at and start")
        names, shapes, dtypes, checksums, nnz = (data[k] for k in ("name", "shape", "dtype", "checksum", "nnz"))
        at, start = enc["at"], enc["start"]
        columns = (names, shapes, dtypes, checksums, nnz, at, start)
        if not types_of(columns) <= {list} or len(set(map(len, columns))) != 1:
            raise FormatError(f"malformed tensor columns in {where}: every column is a list, all of one length")
        if not (
            types_of(names) <= {str}
            and types_of(dtypes) <= {str}
            and types_of(checksums) <= {str}
            and types_of(nnz) <= {int}
            and types_of(shapes) <= {list}
            and types_of(itertools.chain.from_iterable(shapes)) <= {int}
            and types_of(at) <= {int, type(None)}
            and types_of(start) <= {int, type(None)}
            and list(map(operator.is_, at, itertools.repeat(None)))
            == list(map(operator.is_, start, itertools.repeat(None)))
        ):
            raise FormatError(
                f"malformed tensor columns in {where}: names, dtypes and checksums are strings, nnz ints, "
                "shapes lists of ints, enc at and start ints (null together)"
            )
        if len(set(names)) != len(names):
            dup = next(n for n, c in collections.Counter(names).items() if c > 1)
            raise FormatError(f"tensor {dup} is listed twice in {where}")
        encs = [{} if a is None else {"at": a, "start": s} for a, s in zip(at, start)]
        return cls(names, shapes, dtypes, checksums, nnz, encs)

    def shape_map(self) -> dict[str, tuple[int, ...]]:
        """name -> shape (what a layout is probed with)."""
        return dict(zip(self.names, map(tuple, self.shapes)))

    # -- checks ----------------------------------------------------------------------------------
    def numels(self) -> list[int]:
        return list(map(math.prod, self.shapes))

    def check(self, version: int) -> None:
        """Every entry well formed (FormatError naming the first bad tensor): columns at C speed, the
        bad tensor looked for only when a column fails."""
        try:
            numels = self.numels()
            if (
                types_of(self.checksums) <= {str}
                and set(map(len, self.checksums)) <= {16}
                and _HEX_RUN.fullmatch("".join(self.checksums))  # every one 16 long: each is 16 hex digits
                and set(self.dtypes) <= DTYPES.keys()
                and min(itertools.chain.from_iterable(self.shapes), default=0) >= 0
                and min(self.nnz, default=0) >= 0
                and all(map(operator.le, self.nnz, numels))
            ):
                return
        except TypeError:  # a value of the wrong type: the loop below names its tensor
            pass
        for name, t in self.items():
            if not is_hex(t.checksum):
                raise FormatError("the checksum must be 16 lower-case hex digits", version=version, tensor=name)
            if t.dtype not in DTYPES:
                raise FormatError(f"unsupported dtype {t.dtype!r}", version=version, tensor=name)
            if not all(isinstance(d, int) and d >= 0 for d in t.shape) or not 0 <= t.nnz <= t.numel:
                raise FormatError(f"bad shape {t.shape} or nnz {t.nnz}", version=version, tensor=name)

    # -- Mapping ---------------------------------------------------------------------------------
    def index(self, name: str) -> int:
        """The position of `name` in the columns (KeyError if absent)."""
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        return self._index[name]

    def __getitem__(self, name: str) -> TensorEntry:
        i = self.index(name)
        return TensorEntry(self.shapes[i], self.dtypes[i], self.checksums[i], self.nnz[i], self.encs[i])

    def __setitem__(self, name: str, entry: TensorEntry) -> None:
        """Replace (or add) one tensor's entry: tests that craft a bad header, and nothing on a hot path."""
        i = self.index(name) if name in self else None
        cols = (self.shapes, self.dtypes, self.checksums, self.nnz, self.encs)
        vals = (entry.shape, entry.dtype, entry.checksum, entry.nnz, entry.enc)
        if i is None:
            self.names.append(name)
            self._index = None
            for col, val in zip(cols, vals):
                col.append(val)  # type: ignore[attr-defined]
        else:
            for col, val in zip(cols, vals):
                col[i] = val  # type: ignore[index]

    def __contains__(self, name: object) -> bool:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable) and self.names == other.names:
            return (
                self.shapes == other.shapes
                and self.dtypes == other.dtypes
                and self.checksums == other.checksums
                and self.nnz == other.nnz
                and self.encs == other.encs
            )
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]  # a mapping

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors)"


def _well_keyed(entries: list[Any]) -> bool:
    """Whether every entry is a dict with the required keys and no others. Fast path: every entry has
    all five keys (what writers write), seen from the entries' lengths and the union of their keys."""
    if not types_of(entries) <= {dict}:
        return False
    if set(map(len, entries)) <= {len(_ENTRY_KEYS)} and set().union(*entries) <= _ENTRY_KEYS:
        return True  # five distinct keys, all of the five allowed: each entry has exactly those
    return all(_ENTRY_REQUIRED <= e.keys() <= _ENTRY_KEYS for e in entries)


_COLUMN_KEYS = frozenset(("checksum", "dtype", "enc", "name", "nnz", "shape"))
_NO_ENC: dict[str, Any] = {}  # marks a missing `enc` (each entry gets its own empty dict)
_EMPTY_TABLE = TensorTable([], [], [], [], [], [])
_TABLE_MARK = "\x00vllm-delta tensor table\x00"  # where VersionHeader.to_json puts the table's text
_TABLE_MARK_JSON = json.dumps(_TABLE_MARK)
_SEPARATORS = (",", ":")


def _enc_text(enc: dict[str, Any]) -> str:
    """One entry's `enc` as json.dumps(sort_keys) writes it; the chunked codec's {at, start} directly."""
    if len(enc) == 2 and type(enc.get("at")) is int and type(enc.get("start")) is int:
        return f'{{"at":{enc["at"]},"start":{enc["start"]}}}'
    if not enc:
        return "{}"
    return json.dumps(enc, separators=_SEPARATORS, sort_keys=True)


@dataclass
class PartInfo(Closed):
    """What a part file (format version 2) says about itself."""

    index: int  # 0 <= index < count
    count: int  # parts of the version
    checksum: str  # Σ_t key(t) · (partial sum of t over the elements this part owns); parts add up to the whole
    rows: dict[str, list[int]] = field(default_factory=dict)  # tensor -> [row0, row1): the dim-0 rows it owns


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
        return sum(self.tensors.nnz)

    @property
    def numel(self) -> int:
        return sum(self.tensors.numels())

    def to_json(self) -> str:
        """Keys sorted, no spaces. Format 4: the tensor table as columns and a part's rows as one list
        in the table's order (`_columns_doc`). Formats 1-3: the tensor table is written as text by the
        table itself (the same bytes `json.dumps` makes of its plain form, without a dict per tensor)
        into the rest."""
        if self.format_version == COLUMNS_FORMAT_VERSION:
            return json.dumps(self._columns_doc(), separators=_SEPARATORS, sort_keys=True)
        doc = wire.encode(dataclasses.replace(self, tensors=_EMPTY_TABLE))
        doc["tensors"] = _TABLE_MARK
        text = json.dumps(doc, separators=(",", ":"), sort_keys=True)
        head, mark, tail = text.rpartition(_TABLE_MARK_JSON)
        if not mark or _TABLE_MARK_JSON in head:  # a field of the header holds the mark's text: no shortcut
            return json.dumps(wire.encode(self), separators=(",", ":"), sort_keys=True)
        return head + self.tensors.to_json() + tail

    def _columns_doc(self) -> dict[str, Any]:
        table = self.tensors
        order = table.sorted_order()
        doc: dict[str, Any] = wire.encode(dataclasses.replace(self, tensors=_EMPTY_TABLE, part=None))
        doc["tensors"] = table.to_columns(order)
        if self.part is not None:
            rows = self.part.rows
            if not rows.keys() <= set(table.names):
                raise ValueError(f"part {self.part.index} owns rows of tensors the table does not list")
            part = wire.encode(dataclasses.replace(self.part, rows={}))
            part["rows"] = [rows.get(table.names[i]) for i in order]
            doc["part"] = part
        return doc

    @classmethod
    def _from_columns(cls, raw: dict[str, Any], where: str) -> VersionHeader:
        """A format-4 header: the columns made a table and a part's rows a mapping again, the rest
        through the wire codec."""
        raw = dict(raw)
        table = TensorTable.from_columns(raw.pop("tensors", None), where or "header")
        raw["tensors"] = {}
        column = None
        if isinstance(raw.get("part"), dict):
            raw["part"] = dict(raw["part"])
            column = raw["part"].pop("rows", None)
            if type(column) is not list or len(column) != len(table.names):
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
        if not ok or not 0 <= part.index < part.count or not isinstance(part.rows, dict):
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


def _row_column(rows: dict[str, Any], names: list[str]) -> tuple[list[Any], np.ndarray]:
    """A part's row ranges in `names`' order (None where it owns none), and where it owns rows."""
    column: list[Any] = list(map(rows.get, names))
    held = np.fromiter(map(operator.is_not, column, itertools.repeat(None)), dtype=bool, count=len(names))
    return column, held


def _rows_fit(table: TensorTable, rows: dict[str, Any], anchor: bool) -> bool:
    """Whether a part's row ranges are well formed and hold its nnz, checked as arrays: every range
    a list of two ints with 0 <= row0 < row1 <= the tensor's rows; nnz at most the owned elements
    (an anchor: exactly); nnz 0 where it owns no rows; no rows of an unlisted tensor. False sends the
    caller to its per-tensor loop, which names what is wrong."""
    names = table.names
    column, held = _row_column(rows, names)
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


def _row_array(rows: dict[str, list[int]], names: list[str]) -> np.ndarray:
    """A part's (validated) rows as an array [tensors, 2] in `names`' order, (0, 0) where it owns none."""
    column, held = _row_column(rows, names)
    out = np.zeros((len(names), 2), dtype=np.int64)
    n = int(held.sum())
    out[held] = np.fromiter(
        itertools.chain.from_iterable(itertools.compress(column, held)), dtype=np.int64, count=2 * n
    ).reshape(n, 2)
    return out


def payload_key(name: str, part: str) -> str:
    return f"{name}{SEP}{part}"


def _metadata(header: VersionHeader) -> dict[str, str]:
    return {"format": FORMAT_NAME, "format_version": str(header.format_version), "header": header.to_json()}


def serialize(header: VersionHeader, payload: dict[str, torch.Tensor]) -> bytes:
    """The version file's bytes. `payload`: HF names (anchor) or `name::part` keys (delta)."""
    header.validate()
    return save({k: v.contiguous() for k, v in payload.items()}, metadata=_metadata(header))


def write(path: str, header: VersionHeader, payload: dict[str, torch.Tensor]) -> None:
    header.validate()
    save_file({k: v.contiguous() for k, v in payload.items()}, path, metadata=_metadata(header))


class PayloadWriter:
    """A version file written while its payload is produced (the chunked codec's pipelined upload):
    the data section first, every payload part appended in order at the next offset by positioned
    writes (on `pool`'s threads when given, each after its `ready()`: a device-to-host copy; on tmpfs,
    copies into a mapping of the space allocated ahead, `mapped_writes`), the
    header last, into room reserved before the data and padded with spaces (which safetensors
    allows). The same file as `write` up to the order of the payload and the header's padding.

    `parts`: every payload key the file will hold, in the order they come, with its dtype and
    number of dimensions (the room for the header is reserved from them). Appends to a part
    concatenate along dimension 0; each part starts aligned to its element size."""

    PIECE_BYTES = 8 << 20  # a large append is written by several threads in pieces of this size
    _BOUND = 10**15  # every size and offset in the header is below this (1 PB)

    def __init__(
        self,
        path: str,
        header: VersionHeader,
        parts: Sequence[tuple[str, torch.dtype, int]],
        pool: Executor | None = None,
        size_hint: int = 0,
    ):
        """`size_hint`: the payload's expected bytes: allocated for the file up front, on the pool,
        while the payload is still being encoded (a write into allocated pages is a copy; on tmpfs
        allocating is half of a write's time, and pieces inside the allocated bytes are copied
        through a mapping). The file ends at its real size whatever the hint."""
        header.validate()
        self.path = path
        # '{"__metadata__":{...}' once: the metadata holds the header as a string (~2 MB for a mixture
        # of experts) that json.dumps would escape again for every header written (placeholder, final)
        self._prefix = json.dumps({"__metadata__": _metadata(header)}, separators=_SEPARATORS)[:-1].encode()
        self._parts = list(parts)
        self._pool = pool
        placeholder = {key: (dtype, [self._BOUND] * ndim, self._BOUND, self._BOUND) for key, dtype, ndim in self._parts}
        self._room = -(-len(self._header_bytes(placeholder)) // 8) * 8
        # read and write: a shared mapping of the file (mapped_writes) needs both
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._futures: list[Future[Any]] = []
        self._restart()
        # Bytes of the file allocated up front (mapped_writes.allocate), once that has run; pieces
        # inside them go through a mapping where the filesystem is tmpfs.
        self._allocated: Future[int] | None = None
        self._mapped = False
        self._measured = False  # the pieces' speed goes to mapped_writes.CHOOSER (a file on tmpfs)
        self._spent: list[tuple[int, float, float]] = []  # (bytes, start, end) per piece written the file's way
        if size_hint > 0 and self._pool is not None:
            self._measured = mapped_writes.fs_type(path) == "tmpfs"
            self._mapped = mapped_writes.maps_well(path)
            self._allocated = self._pool.submit(mapped_writes.allocate, self._fd, 8 + self._room + size_hint)
            self._futures.append(self._allocated)

    def _restart(self) -> None:
        self._at = 0  # next offset in the data section
        self._tensors: dict[str, tuple[torch.dtype, list[int], int, int]] = {}  # key -> dtype, shape, start, end
        self._next = 0  # parts started

    def _header_bytes(self, tensors: Mapping[str, tuple[torch.dtype, list[int], int, int]]) -> bytes:
        """The safetensors header: the bytes of `json.dumps({"__metadata__": meta, key: entry, ...},
        separators=(",", ":"))`, with the metadata's text made once (`_prefix`)."""
        doc: dict[str, Any] = {}
        for key, (dtype, shape, start, end) in tensors.items():
            doc[key] = {"dtype": _ST_NAMES[dtype], "shape": shape, "data_offsets": [start, end]}
        if not doc:
            return self._prefix + b"}"
        return self._prefix + b"," + json.dumps(doc, separators=_SEPARATORS)[1:].encode()

    def append(self, part: str, data: torch.Tensor, ready: Callable[[], None] | None = None) -> None:
        """Append host tensor `data` to payload `part` (the current part, or the next in order)."""
        if self._fd is None:
            raise ValueError("the file is closed")
        if part not in self._tensors:  # the next part starts
            if self._next >= len(self._parts) or self._parts[self._next][0] != part:
                order = [k for k, _, _ in self._parts]
                raise ValueError(f"payload part {part!r} out of order (parts: {order}, {self._next} started)")
            self._next += 1
        elif part != self._parts[self._next - 1][0]:
            raise ValueError(f"payload part {part!r} was finished: the next part began")
        _, dtype, ndim = self._parts[self._next - 1]
        if data.dtype != dtype or data.dim() != ndim or data.device.type != "cpu":
            raise ValueError(
                f"payload part {part!r} takes {ndim}-d {dtype} host tensors, not {data.dtype} {data.shape}"
            )
        size = data.element_size()
        if part not in self._tensors:
            if self._at % size:
                raise ValueError(f"payload part {part!r} would start at an offset not aligned to {size} bytes")
            self._tensors[part] = (dtype, [0, *data.shape[1:]], self._at, self._at)
        dt, shape, start, end = self._tensors[part]
        if list(data.shape[1:]) != shape[1:]:
            raise ValueError(f"payload part {part!r}: rows of {list(data.shape[1:])}, earlier {shape[1:]}")
        nbytes = data.numel() * size
        self._tensors[part] = (dt, [shape[0] + int(data.shape[0]), *shape[1:]], start, end + nbytes)
        at = self._at
        self._at += nbytes
        if not nbytes:
            return
        raw = data.contiguous().reshape(-1).view(torch.uint8)
        for a in range(0, nbytes, self.PIECE_BYTES):
            piece = raw[a : a + self.PIECE_BYTES]
            offset = 8 + self._room + at + a
            if self._pool is None:
                self._write_piece(self._fd, piece, offset, ready)
            else:
                self._futures.append(self._pool.submit(self._write_piece, self._fd, piece, offset, ready))

    def _write_piece(self, fd: int, piece: torch.Tensor, offset: int, ready: Callable[[], None] | None) -> None:
        if ready is not None:
            ready()
        t0 = time.perf_counter()
        # The allocation was submitted to the pool before any piece, so it runs first: no deadlock.
        mapped = self._mapped and self._allocated is not None and offset + piece.numel() <= self._allocated.result()
        if mapped:
            mapped_writes.copy_mapped(fd, piece, offset)
        else:
            mapped_writes.pwrite_all(fd, piece, offset)
        if mapped == self._mapped:  # the file's way (not a piece past the allocated bytes)
            self._spent.append((piece.numel(), t0, time.perf_counter()))  # list.append: atomic

    def _drain(self) -> BaseException | None:
        first = None
        for f in self._futures:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised after every write ended
                first = first or exc
        self._futures = []
        return first

    def restart(self) -> None:
        """Drop what was appended (a codec falling back to another path writes the payload again)."""
        self._drain()
        self._restart()
        self._spent.clear()  # the file's speed is that of the pass that stays, not of the dropped one

    def close(self) -> None:
        """Wait for every write, then write the header; raises the first write error."""
        if self._fd is None:
            return
        try:
            error = self._drain()
            if error is not None:
                raise error
            missing = [k for k, _, _ in self._parts if k not in self._tensors]
            if missing:
                raise ValueError(f"payload parts never written: {missing}")
            text = self._header_bytes(self._tensors)
            if len(text) > self._room:  # pragma: no cover - the room was reserved with bounds on every number
                raise ValueError("the header outgrew the room reserved for it")
            head = struct.pack("<Q", self._room) + text + b" " * (self._room - len(text))
            os.pwrite(self._fd, head, 0)
            os.ftruncate(self._fd, 8 + self._room + self._at)
            if self._measured and self._spent:
                # the pieces run side by side (and pwrites wait on each other): the span they took
                # together, not the sum of their times
                span = max(e for _, _, e in self._spent) - min(b for _, b, _ in self._spent)
                mapped_writes.CHOOSER.record(self._mapped, sum(n for n, _, _ in self._spent), span)
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop: wait for the writes in flight and close the file (the caller removes it)."""
        self._drain()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> PayloadWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Piece(NamedTuple):
    """One part's changes of one tensor in a delta: decoded with the version's codec like a one-file
    delta's payload. Its positions lie in [start, stop) (the rows the part owns); the pieces of one
    tensor hold disjoint positions and come in position order."""

    nnz: int
    enc: dict[str, Any]
    payload: dict[str, torch.Tensor]
    start: int = 0
    stop: int = 0


def header_text(path: str | os.PathLike[str]) -> str | None:
    """The header text a version file's metadata holds, read without parsing it (safetensors checks
    the container on open); None when the file is unreadable or not a vllm-delta file (`VersionFile`
    says why)."""
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError):
        return None
    if meta.get("format") != FORMAT_NAME:
        return None
    return meta.get("header")


def _held_path(fd: int, path: str) -> str:
    """A path that opens the file `fd` holds, even after `path` was unlinked or replaced: Linux's
    /proc/self/fd/N (elsewhere `path` itself, and the window between two opens stays)."""
    held = f"/proc/self/fd/{fd}"
    return held if os.path.exists(held) else path


class VersionFile:
    """A local version file (one-file version, or one part of a multi-part version), memory-mapped.
    Validates the container and header on open.

    The file is opened once, here, and mapped whole (no page is read until a tensor is); every later
    read goes through the mappings, never the path. A path that goes away after the open (a download
    cache shared by two servers, pruned by one while the other stages) takes nothing away from this
    object. A path missing at the open raises FileNotFoundError (not a FormatError: the file is
    absent, not malformed; `DeltaStore.open` fetches it again)."""

    def __init__(self, path: str | os.PathLike[str], *, expect_version: int | None = None):
        self.path = os.fspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise FormatError(f"not a readable safetensors file {self.path}: {exc}", version=expect_version) from None
        try:
            self._f = safe_open(_held_path(fd, self.path), framework="pt", device="cpu")
            meta = self._f.metadata() or {}
            keys = list(self._f.keys())
            # our own private (copy-on-write) mapping of the payload (see `_tensor`)
            self._map: mmap.mmap | None = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except (SafetensorError, OSError, ValueError) as exc:
            raise FormatError(f"not a readable safetensors file {self.path}: {exc}", version=expect_version) from None
        finally:
            os.close(fd)  # the mappings hold the file from here on (Python's mmap keeps a duplicate)
        if meta.get("format") != FORMAT_NAME or "header" not in meta:
            raise FormatError(f"{self.path} is not a vllm-delta version file", version=expect_version)
        self._keys = set(keys)
        self._entries: dict[str, dict[str, Any]] | None = None  # the container's table, read at first use
        self._base = 0
        self._parts: dict[str, list[str]] = {}
        self._file_payload: dict[str, torch.Tensor] | None = None
        for k in keys:
            if SEP in k:
                self._parts.setdefault(k.split(SEP, 1)[0], []).append(k)
        with gc_pause.paused():  # ~10^5 small objects for a mixture of experts' header (gc_pause.py)
            self.header = VersionHeader.from_json(meta["header"], where=self.path)
        if expect_version is not None and self.header.version != expect_version:
            raise FormatError(
                f"file holds version {self.header.version}, expected {expect_version}", version=expect_version
            )
        self._check_payload()

    def _check_payload(self) -> None:
        h = self.header
        if h.kind != "anchor":
            return
        for name, entry in h.tensors.items():
            rows = self.rows(name)
            if rows is None:
                if name in self._keys:
                    raise FormatError("part stores a tensor it does not own", version=h.version, tensor=name)
                continue
            if name not in self._keys:
                raise FormatError("anchor lacks the tensor", version=h.version, tensor=name)
            want = _slice_shape(entry.shape, rows)
            sl = self._f.get_slice(name)
            shape, dtype = list(sl.get_shape()), sl.get_dtype()
            if shape != want or dtype != entry.dtype:
                raise ShapeMismatchError(
                    f"stored {dtype}{shape}, header says {entry.dtype}{want}", version=h.version, tensor=name
                )

    @property
    def version(self) -> int:
        return self.header.version

    def rows(self, name: str) -> tuple[int, int] | None:
        """The rows of dim 0 of `name` this file owns (a one-file version owns every tensor whole)."""
        entry = self.header.tensors[name]
        if self.header.part is None:
            return 0, num_rows(entry.shape)
        rows = self.header.part.rows.get(name)
        return (rows[0], rows[1]) if rows is not None else None

    def stored(self, name: str) -> torch.Tensor:
        """An anchor's stored tensor: the whole tensor, or a part's rows of it (memory-mapped)."""
        return self._tensor(name)

    def dense(self, name: str) -> torch.Tensor:
        """An anchor's tensor (memory-mapped)."""
        rows = self.rows(name)
        if rows != (0, num_rows(self.header.tensors[name].shape)):
            raise FormatError(
                f"this part holds rows {rows} of the tensor only: open the whole version",
                version=self.version,
                tensor=name,
            )
        return self._tensor(name)

    def _tensor(self, key: str) -> torch.Tensor:
        """One stored tensor, a view of a private (copy-on-write) mapping of the file.

        Not `safe_open.get_tensor`: safetensors 0.8's torch path leaks two small Python objects per
        call, which a server applying tens of thousands of versions would accumulate. The container
        was validated by safe_open; its header gives each tensor's dtype, shape and byte range."""
        if self._map is None:
            raise ValueError(f"{self.path} was closed")
        if self._entries is None:
            (n,) = struct.unpack_from("<Q", self._map, 0)
            self._entries = json.loads(self._map[8 : 8 + n])
            self._base = 8 + n
        entry = self._entries[key]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            stored: torch.Tensor = self._f.get_tensor(key)
            return stored
        start, end = entry["data_offsets"]
        if end == start:
            return torch.empty(entry["shape"], dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - start, offset=self._base + start)
        return raw.view(dtype).reshape(entry["shape"])

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        """A delta's payload for one tensor, by part name (empty if the tensor did not change)."""
        return {k.split(SEP, 1)[1]: self._tensor(k) for k in self._parts.get(name, ())}

    def file_payload(self) -> dict[str, torch.Tensor]:
        """A format-3 file's streams (the file-level codec's payload), by part name; one dict per
        file, the same object for every piece of it (readers group pieces by it)."""
        if self._file_payload is None:
            self._file_payload = self.parts(FILE_PAYLOAD)
        return self._file_payload

    def pieces(self, name: str) -> list[Piece]:
        """A delta's changes of one tensor: one piece, or none if it did not change here.

        For a file-level codec (format 3) the piece's payload is the file's streams and its `enc`
        the tensor's own with the file's metadata under "file"."""
        h = self.header
        if h.kind != "delta":
            raise FormatError("an anchor has no pieces: read it with dense()", version=h.version, tensor=name)
        entry = h.tensors[name]
        if not entry.nnz:
            return []
        if h.part is None:  # one file: the whole tensor (the common case, kept cheap: MoE files list ~20K tensors)
            start, stop = 0, entry.numel
        else:
            rows = self.rows(name)
            if rows is None:
                return []
            size = row_size(entry.shape)
            start, stop = rows[0] * size, rows[1] * size
        if h.format_version in STREAMS_FORMAT_VERSIONS:
            return [Piece(entry.nnz, {**entry.enc, "file": h.enc}, self.file_payload(), start, stop)]
        return [Piece(entry.nnz, entry.enc, self.parts(name), start, stop)]

    def close(self) -> None:
        # The memory maps go with the last reference (tensors handed out keep theirs alive).
        self._f = None  # type: ignore[assignment]
        self._map = None
        self._file_payload = None

    def __enter__(self) -> VersionFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slice_shape(shape: list[int], rows: tuple[int, int]) -> list[int]:
    if not shape:
        return []
    return [rows[1] - rows[0], *shape[1:]]


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
        if not parts:
            raise FormatError("a version needs at least one part", version=expect_version)
        self.parts = sorted(parts, key=lambda p: p.header.part.index if p.header.part else -1)
        first = self.parts[0].header
        v = first.version
        if expect_version is not None and v != expect_version:
            raise FormatError(f"parts hold version {v}, expected {expect_version}", version=expect_version)
        infos = [p.header.part for p in self.parts]
        if any(info is None for info in infos):
            raise FormatError("a multi-part version is made of part files (format version 2)", version=v)
        indices = [info.index for info in infos if info is not None]
        counts = {info.count for info in infos if info is not None}
        if indices != list(range(len(self.parts))) or counts != {len(self.parts)}:
            raise FormatError(f"parts {indices} of {sorted(counts)}: expected 0..{len(self.parts) - 1}", version=v)
        same = ("format_version", "version", "kind", "base", "base_checksum", "codec", "checksum")
        head = TensorTable.of(first.tensors)
        names = head.names
        for p in self.parts[1:]:
            h = p.header
            for key in same:
                if getattr(h, key) != getattr(first, key):
                    raise FormatError(
                        f"part {h.part.index if h.part else '?'} has {key} {getattr(h, key)!r}, "
                        f"part 0 has {getattr(first, key)!r}",
                        version=v,
                    )
            table = TensorTable.of(h.tensors)
            if table.names != names:  # the same tensors (writers list them in one order)
                if set(table.names) != set(names):
                    odd = sorted(set(table.names) ^ set(names))[0]
                    raise FormatError("parts list different tensors", version=v, tensor=odd)
                order = [table.index(n) for n in names]
                table = TensorTable(
                    list(names),
                    [table.shapes[i] for i in order],
                    [table.dtypes[i] for i in order],
                    [table.checksums[i] for i in order],
                    [table.nnz[i] for i in order],
                    [table.encs[i] for i in order],
                )
                h.tensors = table
            # column by column (lists compare in C); the odd tensor looked for only on failure
            if table.shapes != head.shapes or table.dtypes != head.dtypes or table.checksums != head.checksums:
                name = next(
                    n
                    for i, n in enumerate(names)
                    if (table.shapes[i], table.dtypes[i], table.checksums[i])
                    != (head.shapes[i], head.dtypes[i], head.checksums[i])
                )
                raise FormatError("parts disagree on the tensor's shape, dtype or checksum", version=v, tensor=name)
        # Every part's rows of every tensor as arrays [parts, tensors] ((0, 0): not owned), checked at once:
        # no per-tensor work per part beyond reading its header (what W ranks' parts of ~19K tensors need).
        w, t = len(self.parts), len(names)
        self._names = {n: i for i, n in enumerate(names)}
        rows = np.zeros((w, t, 2), dtype=np.int64)
        for k, p in enumerate(self.parts):
            assert p.header.part is not None
            rows[k] = _row_array(p.header.part.rows, names)
        self._rows = rows
        self._order = np.argsort(rows[:, :, 0], axis=0, kind="stable")  # per tensor, its parts by first row
        r0 = np.take_along_axis(rows[:, :, 0], self._order, axis=0)
        r1 = np.take_along_axis(rows[:, :, 1], self._order, axis=0)
        held = r1 > r0
        covered = np.maximum.accumulate(np.where(held, r1, 0), axis=0)  # rows covered by the parts up to each
        before = np.vstack([np.zeros((1, t), dtype=np.int64), covered[:-1]])
        overlap = held & (r0 < before)
        if overlap.any():
            k, i = (int(x[0]) for x in np.nonzero(overlap))
            at = int(r0[k, i])
            raise FormatError(
                f"parts overlap at rows {at}..{min(int(r1[k, i]), int(before[k, i]))}", version=v, tensor=names[i]
            )
        if first.kind == "anchor":
            total = np.array([num_rows(shape) for shape in head.shapes], dtype=np.int64)
            gap = held & (r0 > before)
            missing = gap.any(axis=0) | (covered[-1] != total)
            if missing.any():
                i = int(np.flatnonzero(missing)[0])
                ks = np.flatnonzero(gap[:, i])
                a, b = (int(before[ks[0], i]), int(r0[ks[0], i])) if ks.size else (int(covered[-1, i]), int(total[i]))
                raise FormatError(f"no part holds rows {a}..{b}", version=v, tensor=names[i])
        nnz = np.zeros(t, dtype=np.int64)
        for p in self.parts:  # the columns, not an entry per tensor (~19K per part at 30B-A3B)
            nnz += np.asarray(TensorTable.of(p.header.tensors).nnz, dtype=np.int64)
        tensors = TensorTable(
            list(names),
            [list(shape) for shape in head.shapes],
            list(head.dtypes),
            list(head.checksums),
            nnz.tolist(),
            [{} for _ in range(t)],
        )
        total_sum = sum_of_parts(info.checksum for info in infos if info is not None)
        if total_sum != first.checksum:
            raise FormatError(f"the parts' checksums add up to {total_sum}, not {first.checksum}", version=v)
        self.header = VersionHeader(
            version=v,
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

    def owners(self, name: str) -> list[tuple[int, int, VersionFile]]:
        """The parts holding rows of `name`, in row order: (first row, end row, part)."""
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
