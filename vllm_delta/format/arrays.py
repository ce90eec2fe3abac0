"""Format 5: a header's tensor table and a part's rows as packed arrays (docs/FORMAT.md, "Arrays").

Each numeric column is the hex digits of its little-endian values, the names one string joined by "\\n".
Written from arrays and read into arrays: no Python object per tensor and field on the way (a mixture
of experts lists ~19K tensors, in every part of every version, on the publisher and on every reader).
`TableArrays` is the table's columns as arrays; `RowMap` is a part's rows over its table's names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError
from .layout import DTYPE_CODES

NAME_SEP = "\n"
_TABLE_KEYS = frozenset(("at", "checksum", "count", "dims", "dtype", "name", "ndim", "nnz", "start"))
_LE = {"u8": "<u1", "i64": "<i8", "u64": "<u8"}


def pack(values: np.ndarray, kind: str) -> str:
    """`values` as the hex digits of their little-endian bytes (`kind`: "u8", "i64" or "u64"). Hex, not
    base64: bytes.fromhex reads ~4x faster than base64 decodes, which outweighs the longer text."""
    return np.ascontiguousarray(values, dtype=_LE[kind]).tobytes().hex()


def unpack(text: Any, kind: str, count: int, what: str, where: str) -> np.ndarray:
    """A packed column of `count` values (FormatError naming it otherwise), in native byte order."""
    if type(text) is not str:
        raise FormatError(f"malformed tensor arrays in {where}: {what} is not a string of hex digits")
    dtype = np.dtype(_LE[kind])
    nbytes = count * dtype.itemsize
    if len(text) != 2 * nbytes:
        raise FormatError(f"malformed tensor arrays in {where}: {what} holds {len(text) // 2} B, not {count} values")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise FormatError(f"malformed tensor arrays in {where}: {what} is not hex digits") from None
    if len(raw) != nbytes:  # fromhex skips whitespace: fewer bytes than digits/2
        raise FormatError(f"malformed tensor arrays in {where}: {what} is not hex digits")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=False)


@dataclass
class TableArrays:
    """A tensor table as arrays: names (one string, "\\n" between), shapes (dimensions per tensor and
    every dimension, tensor after tensor), dtype codes (`DTYPE_CODES`), per-tensor checksums, nnz, and
    each tensor's place in a file-level codec's streams (`at`, `start`; -1, -1: none)."""

    text: str
    count: int
    ndim: np.ndarray  # uint8 [T]
    dims: np.ndarray  # int64 [sum(ndim)]
    codes: np.ndarray  # uint8 [T]
    sums: np.ndarray  # uint64 [T]
    nnz: np.ndarray  # int64 [T]
    at: np.ndarray  # int64 [T]
    start: np.ndarray  # int64 [T]

    def shape_offsets(self) -> np.ndarray:
        """Where each tensor's dimensions start in `dims` ([T + 1])."""
        out = np.zeros(self.count + 1, dtype=np.int64)
        np.cumsum(self.ndim, out=out[1:])
        return out

    def shape_matrix(self) -> np.ndarray:
        """The shapes as [T, max ndim], padded with 1 (what products over dimensions need)."""
        width = int(self.ndim.max()) if self.count else 0
        out = np.ones((self.count, max(width, 1)), dtype=np.int64)
        if self.dims.size:
            rows = np.repeat(np.arange(self.count), self.ndim.astype(np.int64))
            cols = np.arange(self.dims.size) - np.repeat(self.shape_offsets()[:-1], self.ndim.astype(np.int64))
            out[rows, cols] = self.dims
        return out

    def numel(self) -> np.ndarray:
        return np.prod(self.shape_matrix(), axis=1, dtype=np.int64) if self.count else np.zeros(0, np.int64)

    def dim0(self) -> np.ndarray:
        """Rows of dim 0 (a 0-d tensor: one row)."""
        return self.shape_matrix()[:, 0] if self.count else np.zeros(0, np.int64)

    def row_size(self) -> np.ndarray:
        """Elements per row of dim 0."""
        m = self.shape_matrix()
        return np.prod(m[:, 1:], axis=1, dtype=np.int64) if self.count else np.zeros(0, np.int64)

    def bad(self) -> np.ndarray:
        """Tensors whose values break format 5's rules (FORMAT.md), as a boolean array."""
        dims_bad = np.zeros(self.count, dtype=bool)
        if self.dims.size:
            neg = self.dims < 0
            if neg.any():
                dims_bad[np.repeat(np.arange(self.count), self.ndim.astype(np.int64))[neg]] = True
        enc = ((self.at == -1) & (self.start == -1)) | ((self.at >= 0) & (self.start >= 0))
        out: np.ndarray = (
            dims_bad | (self.codes >= len(DTYPE_CODES)) | (self.nnz < 0) | (self.nnz > self.numel()) | ~enc
        )
        return out

    def to_doc(self) -> dict[str, Any]:
        return {
            "at": pack(self.at, "i64"),
            "checksum": pack(self.sums, "u64"),
            "count": self.count,
            "dims": pack(self.dims, "i64"),
            "dtype": pack(self.codes, "u8"),
            "name": self.text,
            "ndim": pack(self.ndim, "u8"),
            "nnz": pack(self.nnz, "i64"),
            "start": pack(self.start, "i64"),
        }

    @classmethod
    def from_doc(cls, data: Any, where: str) -> TableArrays:
        """The arrays of a format-5 header's `tensors` (their types and lengths checked here; values by
        `bad`)."""
        if type(data) is not dict or data.keys() != _TABLE_KEYS:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise FormatError(f"malformed tensor arrays in {where}: fields {keys}, expected {sorted(_TABLE_KEYS)}")
        n, text = data["count"], data["name"]
        if type(n) is not int or n < 0 or type(text) is not str:
            raise FormatError(f"malformed tensor arrays in {where}: count is an int >= 0 and name a string")
        if (text.count(NAME_SEP) + 1 if text else 0) != n:
            raise FormatError(f"malformed tensor arrays in {where}: name does not hold {n} names")
        ndim = unpack(data["ndim"], "u8", n, "ndim", where)
        total = int(ndim.sum(dtype=np.int64))
        return cls(
            text=text,
            count=n,
            ndim=ndim,
            dims=unpack(data["dims"], "i64", total, "dims", where),
            codes=unpack(data["dtype"], "u8", n, "dtype", where),
            sums=unpack(data["checksum"], "u64", n, "checksum", where),
            nnz=unpack(data["nnz"], "i64", n, "nnz", where),
            at=unpack(data["at"], "i64", n, "at", where),
            start=unpack(data["start"], "i64", n, "start", where),
        )


def join_names(names: list[str]) -> str:
    """The names as format 5 writes them (ValueError for a name holding the separator)."""
    text = NAME_SEP.join(names)
    if text.count(NAME_SEP) != max(len(names) - 1, 0) or (len(names) == 1 and not names[0]):
        bad = next((n for n in names if NAME_SEP in n or not n), "")
        raise ValueError(f"tensor name {bad!r} cannot be written in format 5 (empty, or holds a line break)")
    return text


def split_names(text: str, count: int) -> list[str]:
    return text.split(NAME_SEP) if count else []


class RowMap(Mapping[str, list[int]]):
    """A part's rows (`PartInfo.rows`) as one int64 array [T, 2] in its table's order (-1, -1: rows of
    none): `rows[name]` and iteration as the dict of formats 2-4 gives them (only tensors it owns rows
    of), `array_for(names_text)` for readers that work on arrays."""

    __slots__ = ("text", "array", "_names", "_index")

    def __init__(self, text: str, array: np.ndarray, names: list[str] | None = None):
        self.text, self.array = text, array
        self._names = names
        self._index: dict[str, int] | None = None

    @classmethod
    def of(cls, rows: Mapping[str, list[int]], names: list[str], text: str) -> RowMap:
        """`rows` (a dict) over the table `names` (`text`: them joined): ValueError for rows of a tensor
        the table does not list."""
        if isinstance(rows, RowMap) and rows.text == text:
            return rows
        index = {n: i for i, n in enumerate(names)}
        array = np.full((len(names), 2), -1, dtype=np.int64)
        for name, r in rows.items():
            i = index.get(name)
            if i is None:
                raise ValueError(f"rows of tensor {name!r}, which the table does not list")
            array[i] = r
        return cls(text, array, names)

    @property
    def names(self) -> list[str]:
        if self._names is None:
            self._names = split_names(self.text, len(self.array))
        return self._names

    def array_for(self, text: str) -> np.ndarray | None:
        """The rows in the order of the table whose names are `text` (None: another table)."""
        return self.array if text == self.text else None

    def held(self) -> np.ndarray:
        """Where the part owns rows (anything but -1, -1: a malformed range is the checks' business)."""
        return np.asarray((self.array[:, 0] != -1) | (self.array[:, 1] != -1))

    def __getitem__(self, name: str) -> list[int]:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        r0, r1 = self.array[self._index[name]].tolist()
        if r0 == -1 and r1 == -1:
            raise KeyError(name)
        return [r0, r1]

    def __iter__(self) -> Iterator[str]:
        names = self.names
        for i in np.flatnonzero(self.held()).tolist():
            yield names[i]

    def __len__(self) -> int:
        return int(self.held().sum())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowMap) and other.text == self.text:
            return bool(np.array_equal(self.array, other.array))
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]  # a mapping

    def __repr__(self) -> str:
        return f"RowMap({len(self)} of {len(self.array)} tensors)"


__all__ = ["NAME_SEP", "RowMap", "TableArrays", "join_names", "pack", "split_names", "unpack"]
