"""Which open version file a mapped address belongs to (a leaf: os, threading, numpy).

Staging copies a run's compressed bytes into pinned memory. Copied out of the file's private mapping,
each page faults on the way (a fresh 109 MiB file on an H200 host's tmpfs, 16 threads: 13.1 / 17.9 ms
p50 / p95); read from the file with `preadv`, no page of the source is mapped (6.7 / 8.7 ms;
`benchmarks/read_pinned.py`, 2026-11-29). A `VersionFile` registers its mapping here while it is open,
so a reader that holds only the mapped bytes (a tensor view) finds the file and the bytes' offset in
it. The file is opened again by path and used only if it is the very file that was mapped (same
device and inode: the mapping keeps that inode alive, so its number is not reused meanwhile); a file
removed or replaced since is read from the mapping, as before.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import NamedTuple

import numpy as np


class FileSpan(NamedTuple):
    """Mapped bytes' file: its path, the bytes' offset in it, and the mapped file's (st_dev, st_ino)."""

    path: str
    offset: int
    ident: tuple[int, int]


_lock = threading.Lock()
_maps: dict[int, tuple[int, str, tuple[int, int]]] = {}  # base address -> (end address, path, ident)


def base_address(m: mmap.mmap) -> int:
    """Where a mapping starts in this process's memory."""
    view = np.frombuffer(m, dtype=np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


def register(m: mmap.mmap, path: str, st: os.stat_result) -> int:
    """A version file's whole mapping (while it is open); returns its base address (for `unregister`)."""
    base = base_address(m)
    with _lock:
        _maps[base] = (base + len(m), path, (st.st_dev, st.st_ino))
    return base


def unregister(base: int) -> None:
    with _lock:
        _maps.pop(base, None)


def span_of(addr: int, nbytes: int) -> FileSpan | None:
    """The registered file whose mapping holds [addr, addr + nbytes), or None."""
    with _lock:
        for base, (end, path, ident) in _maps.items():
            if base <= addr and addr + nbytes <= end:
                return FileSpan(path, addr - base, ident)
    return None


def open_span(span: FileSpan) -> int | None:
    """A descriptor of the span's file if the path still names the file that was mapped, else None."""
    try:
        fd = os.open(span.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if (st.st_dev, st.st_ino) != span.ident:
        os.close(fd)
        return None
    return fd


def pread_into(dst: np.ndarray, at: int, fd: int, offset: int, nbytes: int) -> None:
    """dst[at : at + nbytes] = the file's bytes at `offset` (OSError if the file ends before them)."""
    view = dst.data[at : at + nbytes]  # numpy's buffer, as a memoryview
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"version file ended {nbytes - done} bytes short of a read at offset {offset}")
        done += got


__all__ = ["FileSpan", "base_address", "open_span", "pread_into", "register", "span_of", "unregister"]
