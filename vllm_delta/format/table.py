"""The header's tensor table: `TensorEntry` (one tensor's shape, dtype, checksum, nnz and codec
metadata) and `TensorTable`, the same as columns, read, checked and written without an object per
tensor (formats 1-3: a JSON object per tensor; format 4: one list per field)."""

from __future__ import annotations

import collections
import itertools
import json
import math
import operator
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

import torch

from .. import wire
from ..checksums import is_hex
from ..errors import FormatError
from ..wire import Closed, types_of
from .layout import DTYPES, JSON_SEPARATORS


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
_COLUMN_KEYS = frozenset(("checksum", "dtype", "enc", "name", "nnz", "shape"))
_NO_ENC: dict[str, Any] = {}  # marks a missing `enc` (each entry gets its own empty dict)


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
            return json.dumps(self.to_plain(), separators=JSON_SEPARATORS, sort_keys=True)
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


EMPTY_TABLE = TensorTable([], [], [], [], [], [])  # a header's table left out (VersionHeader.to_json)


def _well_keyed(entries: list[Any]) -> bool:
    """Whether every entry is a dict with the required keys and no others. Fast path: every entry has
    all five keys (what writers write), seen from the entries' lengths and the union of their keys."""
    if not types_of(entries) <= {dict}:
        return False
    if set(map(len, entries)) <= {len(_ENTRY_KEYS)} and set().union(*entries) <= _ENTRY_KEYS:
        return True  # five distinct keys, all of the five allowed: each entry has exactly those
    return all(_ENTRY_REQUIRED <= e.keys() <= _ENTRY_KEYS for e in entries)


def _enc_text(enc: dict[str, Any]) -> str:
    """One entry's `enc` as json.dumps(sort_keys) writes it; the chunked codec's {at, start} directly."""
    if len(enc) == 2 and type(enc.get("at")) is int and type(enc.get("start")) is int:
        return f'{{"at":{enc["at"]},"start":{enc["start"]}}}'
    if not enc:
        return "{}"
    return json.dumps(enc, separators=JSON_SEPARATORS, sort_keys=True)
