"""An opened version file (`VersionFile`: one-file version, or one part of a multi-part version),
memory-mapped and checked on open; `Piece`, one file's changes of one tensor."""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from .. import gc_pause
from ..errors import FormatError, ShapeMismatchError
from . import mapped_files
from .header import VersionHeader
from .layout import FILE_PAYLOAD, FORMAT_NAME, SEP, ST_DTYPES, STREAMS_FORMAT_VERSIONS, num_rows, row_size


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
    read goes through the mappings, or (staging's bulk reads, `mapped_files`) through the path while it
    still names the very file mapped here. A path that goes away after the open (a download cache
    shared by two servers, pruned by one while the other stages) takes nothing away from this object.
    A path missing at the open raises FileNotFoundError (not a FormatError: the file is absent, not
    malformed; `DeltaStore.open` fetches it again)."""

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
            # readers of the mapped bytes may read them from the file instead while it is open (mapped_files)
            base = mapped_files.register(self._map, os.path.abspath(self.path), os.fstat(fd))
            # once, at close or when this object goes (whichever first): a finalizer left to run later could
            # remove the registration of another file mapped at the same address by then
            self._unregister = weakref.finalize(self, mapped_files.unregister, base)
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
        dtype = ST_DTYPES.get(entry["dtype"])
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
            enc = {**entry.enc, "file": h.enc}
            if not entry.enc and "blocks" in h.enc:  # rank blocks: the codec finds the tensor's pieces by its row
                size = row_size(entry.shape)
                enc.update(
                    tensor=h.tensors.index(name), row_size=size, rows=[start // max(size, 1), stop // max(size, 1)]
                )
            return [Piece(entry.nnz, enc, self.file_payload(), start, stop)]
        return [Piece(entry.nnz, entry.enc, self.parts(name), start, stop)]

    def close(self) -> None:
        # The memory maps go with the last reference (tensors handed out keep theirs alive).
        self._unregister()
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
