"""The header's tensor table: `TensorEntry` (one tensor's shape, dtype, checksum, nnz and codec
metadata) and `TensorTable`, the same as columns, read, checked and written without an object per
tensor (formats 1-3: a JSON object per tensor; format 4: one list per field; format 5: packed arrays,
`arrays.py`)."""

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

import numpy as np
import torch

from .. import wire
from ..checksums import is_hex
from ..errors import FormatError
from ..wire import Closed, types_of
from .arrays import NAME_SEP, TableArrays, join_names, split_names
from .layout import DTYPE_CODES, DTYPES, JSON_SEPARATORS


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

    Its columns are held as lists (formats 1-4, `TensorTable(...)`) or as arrays (format 5,
    `from_arrays`): each form is made from the other on first use, so readers that work on arrays
    (`arrays()`, `names_text`) never make a Python object per tensor for a table read as arrays, and
    the list attributes (`names`, `shapes`, `dtypes`, `checksums`, `nnz`, `encs`) stay what they were.
    """

    __slots__ = ("_names", "_shapes", "_dtypes", "_checksums", "_nnz", "_encs", "_arrays", "_text", "_index")

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
        self._names: list[str] | None = names
        self._shapes: list[list[int]] | None = shapes
        self._dtypes: list[str] | None = dtypes
        self._checksums: list[str] | None = checksums
        self._nnz: list[int] | None = nnz
        self._encs: list[dict[str, Any]] | None = encs
        self._arrays: TableArrays | None = None
        self._text: str | None = None
        self._index: dict[str, int] | None = None

    @classmethod
    def from_arrays(cls, arrays: TableArrays, names: list[str] | None = None) -> TensorTable:
        """A table held as arrays (format 5); `names`: the names as a list, if the caller has them."""
        table = cls.__new__(cls)
        table._names = names
        table._shapes = table._dtypes = table._checksums = table._nnz = table._encs = None
        table._arrays, table._text, table._index = arrays, arrays.text, None
        return table

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

    # -- the columns as lists (made from the arrays on first use) ---------------------------------
    @property
    def names(self) -> list[str]:
        if self._names is None:
            assert self._arrays is not None
            self._names = split_names(self._arrays.text, self._arrays.count)
        return self._names

    @property
    def shapes(self) -> list[list[int]]:
        if self._shapes is None:
            a = self._require()
            off = a.shape_offsets().tolist()
            dims = a.dims.tolist()
            self._shapes = [dims[off[i] : off[i + 1]] for i in range(a.count)]
        return self._shapes

    @property
    def dtypes(self) -> list[str]:
        if self._dtypes is None:
            codes = self._require().codes
            if codes.size and int(codes.max()) >= len(DTYPE_CODES):
                raise FormatError("unknown dtype code in a tensor table")
            self._dtypes = np.array(DTYPE_CODES, dtype=object)[codes].tolist()
        return self._dtypes

    @property
    def checksums(self) -> list[str]:
        if self._checksums is None:
            text = self._require().sums.astype(">u8").tobytes().hex()
            self._checksums = [text[i : i + 16] for i in range(0, len(text), 16)]
        return self._checksums

    @property
    def nnz(self) -> list[int]:
        if self._nnz is None:
            self._nnz = self._require().nnz.tolist()
        return self._nnz

    @property
    def encs(self) -> list[dict[str, Any]]:
        if self._encs is None:
            a = self._require()
            self._encs = [{} if x < 0 else {"at": x, "start": y} for x, y in zip(a.at.tolist(), a.start.tolist())]
        return self._encs

    def _require(self) -> TableArrays:
        assert self._arrays is not None, "a table holds its columns as lists or as arrays"
        return self._arrays

    # -- the columns as arrays (made from the lists on first use) ---------------------------------
    @property
    def names_text(self) -> str:
        """The names joined by "\n" (format 5's form; a key that equals only for the same names in the
        same order)."""
        if self._text is None:
            self._text = NAME_SEP.join(self.names)
        return self._text

    def arrays(self) -> TableArrays:
        """The table as arrays (ValueError where a value has no array form: an `enc` other than a
        file-level codec's {at, start}, a dtype other than format 5's, an unsigned checksum that is not
        16 hex digits)."""
        if self._arrays is None:
            self._arrays = self._to_arrays()
        return self._arrays

    def _to_arrays(self) -> TableArrays:
        names, shapes, n = self.names, self.shapes, len(self.names)
        codes = {name: i for i, name in enumerate(DTYPE_CODES)}
        try:
            if not all(not e or (len(e) == 2 and "at" in e and "start" in e) for e in self.encs):
                raise TypeError("an enc other than a file-level codec's {at, start}")
            at = np.fromiter((e.get("at", -1) if e else -1 for e in self.encs), dtype=np.int64, count=n)
            start = np.fromiter((e.get("start", -1) if e else -1 for e in self.encs), dtype=np.int64, count=n)
            hexes = "".join(self.checksums)
            if not (set(map(len, self.checksums)) <= {16} and _HEX_RUN.fullmatch(hexes)):
                raise ValueError("a checksum is not 16 lower-case hex digits")
            return TableArrays(
                text=join_names(names),
                count=n,
                ndim=np.fromiter(map(len, shapes), dtype=np.uint8, count=n),
                dims=np.fromiter(itertools.chain.from_iterable(shapes), dtype=np.int64),
                codes=np.fromiter(map(codes.__getitem__, self.dtypes), dtype=np.uint8, count=n),
                sums=np.frombuffer(bytes.fromhex(hexes), dtype=">u8").astype(np.uint64),
                nnz=np.fromiter(self.nnz, dtype=np.int64, count=n),
                at=at,
                start=start,
            )
        except (KeyError, TypeError, OverflowError, AttributeError) as exc:
            raise ValueError(f"the tensor table has no array form: {exc}") from None

    def set_key(self) -> tuple[object, ...]:
        """The tensor set (names in order, shapes, dtypes) as a hashable value of immutable copies: a
        string and bytes for a table read as arrays (what readers key their per-set work by, with no
        object per tensor), tuples otherwise."""
        if self._arrays is not None:
            a = self._arrays
            return (a.text, a.ndim.tobytes(), a.dims.tobytes(), a.codes.tobytes())
        return (tuple(self.names), tuple(map(tuple, self.shapes)), tuple(self.dtypes))

    def sum_values(self) -> list[int]:
        """The per-tensor checksums as ints (a table read as arrays: its column, no hex per tensor)."""
        if self._arrays is not None:
            out: list[int] = self._arrays.sums.tolist()
            return out
        return [int(c, 16) for c in self.checksums]

    def numel_array(self) -> np.ndarray:
        """Elements per tensor (int64)."""
        if self._arrays is not None:
            return self._arrays.numel()
        return np.fromiter(map(math.prod, self.shapes), dtype=np.int64, count=len(self))

    def nnz_array(self) -> np.ndarray:
        if self._arrays is not None:
            return self._arrays.nnz
        return np.fromiter(self.nnz, dtype=np.int64, count=len(self))

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
        if self._arrays is not None and self._shapes is None:
            out: list[int] = self._arrays.numel().tolist()
            return out
        return list(map(math.prod, self.shapes))

    def check(self, version: int) -> None:
        """Every entry well formed (FormatError naming the first bad tensor): columns at C speed, the
        bad tensor looked for only when a column fails (a table read as arrays: array operations)."""
        if self._arrays is not None:
            bad = np.flatnonzero(self._arrays.bad())
            if bad.size:
                i = int(bad[0])
                a = self._arrays
                raise FormatError(
                    f"bad entry: shape {self.shapes[i]}, dtype code {int(a.codes[i])}, nnz {int(a.nnz[i])}, "
                    f"at {int(a.at[i])}, start {int(a.start[i])}",
                    version=version,
                    tensor=self.names[i],
                )
            return
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
        """Replace (or add) one tensor's entry: tests that craft a bad header, and nothing on a hot path.
        The table is held as lists from here on."""
        for _ in (self.names, self.shapes, self.dtypes, self.checksums, self.nnz, self.encs):
            pass  # each list made, from the arrays if need be
        self._arrays, self._text = None, None
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
        return self._arrays.count if self._names is None and self._arrays is not None else len(self.names)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable) and self._arrays is not None and other._arrays is not None:
            a, b = self._arrays, other._arrays
            keys = ("ndim", "dims", "codes", "sums", "nnz", "at", "start")
            return a.text == b.text and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in keys)
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
