"""Writing a version file: at once from its header and payload (`write`, `serialize`), or while its
payload is produced, header last (`PayloadWriter`: the chunked codec's pipelined upload)."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import torch
from safetensors.torch import save, save_file

from .. import mapped_writes
from .header import VersionHeader
from .layout import FORMAT_NAME, JSON_SEPARATORS, ST_NAMES


def file_metadata(header: VersionHeader) -> dict[str, str]:
    """The safetensors `__metadata__` of a version file: the format's name, its version, the header."""
    return {"format": FORMAT_NAME, "format_version": str(header.format_version), "header": header.to_json()}


def serialize(header: VersionHeader, payload: dict[str, torch.Tensor]) -> bytes:
    """The version file's bytes. `payload`: HF names (anchor) or `name::part` keys (delta)."""
    header.validate()
    return save({k: v.contiguous() for k, v in payload.items()}, metadata=file_metadata(header))


def write(path: str, header: VersionHeader, payload: dict[str, torch.Tensor]) -> None:
    """The version file `serialize` makes, written to `path`."""
    header.validate()
    save_file({k: v.contiguous() for k, v in payload.items()}, path, metadata=file_metadata(header))


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
        self._prefix = json.dumps({"__metadata__": file_metadata(header)}, separators=JSON_SEPARATORS)[:-1].encode()
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
            doc[key] = {"dtype": ST_NAMES[dtype], "shape": shape, "data_offsets": [start, end]}
        if not doc:
            return self._prefix + b"}"
        return self._prefix + b"," + json.dumps(doc, separators=JSON_SEPARATORS)[1:].encode()

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
