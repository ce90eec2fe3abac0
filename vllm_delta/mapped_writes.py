"""Positioned writes into a file's allocated pages through a shared mapping (a leaf: os, mmap, torch).

Why: Linux serializes `pwrite`s to one file on the inode's lock, so a file written by many threads
is written at one thread's copy speed into the page cache. On tmpfs (`/dev/shm`, where a local store
or the publisher's temporary file often lives) a copy into a mapping of pages that `posix_fallocate`
already allocated takes no lock per write and no allocation per page: one H100 host, 2026-11-28,
108.8 MB (the 8B delta at 1%), `benchmarks/write_paths.py`: 22.8 ms by pwrite, 8.4 ms by a mapping.
On a disk filesystem (ext4, xfs) the same mapping was 4-5x slower than `pwrite` (page faults with
block allocation and writeback), so mapped writes are used on tmpfs only.

Safety: a mapping faults with SIGBUS, not an error, where the page cannot be allocated (a full
tmpfs) or lies past the file's end. So a mapped write is only made inside the range that
`posix_fallocate` returned from successfully (every page exists, and the file's size covers it);
anything else is written by `pwrite`, which reports ENOSPC as an OSError.

Which is faster depends on the host: on this project's 2-core VM (page faults cost more there) the
mapping was slower, 52-59 ms against 32 ms by pwrite. So by default (`VLLM_DELTA_MAPPED_WRITES`
unset or "auto") a process writes its first file on tmpfs each way, then the way that wrote faster
(`WriteChooser`), and now and then the other way again, in case that changed. "1" maps always on
tmpfs, "0" never.
"""

from __future__ import annotations

import collections
import functools
import logging
import mmap
import os
import statistics
import threading
from collections.abc import Iterable

import torch

_PAGE = mmap.ALLOCATIONGRANULARITY
log = logging.getLogger(__name__)


def mount_type(mountinfo: Iterable[str], directory: str) -> str:
    """The filesystem type of the mount holding absolute `directory`: the longest mount point above
    it among `mountinfo`'s lines (proc(5): field 5 is the mount point, the type follows " - ")."""
    best, kind = "", ""
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right.split():
            continue
        point = fields[4].replace("\\040", " ")
        inside = point == "/" or directory == point or directory.startswith(point + "/")
        if inside and len(point) >= len(best):
            best, kind = point, right.split()[0]
    return kind


@functools.lru_cache(maxsize=64)
def _fs_type_of_dir(directory: str) -> str:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return mount_type(f, directory)
    except OSError:  # not Linux, or no /proc
        return ""


def fs_type(path: str) -> str:
    """The filesystem type ("tmpfs", "ext4", ...) of the folder holding `path` ("" if unknown)."""
    return _fs_type_of_dir(os.path.dirname(os.path.realpath(path)) or "/")


ENV = "VLLM_DELTA_MAPPED_WRITES"  # "auto" (default): measured; "1": always on tmpfs; "0": never


class WriteChooser:
    """Mapped writes or `pwrite` for the next file on tmpfs, by the speed measured so far.

    Each way first writes `explore` files; then the way with the higher median rate (bytes per second
    from a file's first piece begun to its last piece written, over its last `keep` files) writes, and
    every `recheck`-th file goes the other way, so that a change (another host, another load) is
    noticed. The process's first file is not counted: it pays one-time costs (on an H200 host it
    made pwrite look faster). Thread-safe."""

    def __init__(self, *, explore: int = 1, keep: int = 5, recheck: int = 50):
        self.explore, self.recheck = explore, recheck
        self._rates: dict[bool, collections.deque[float]] = {
            True: collections.deque(maxlen=keep),
            False: collections.deque(maxlen=keep),
        }
        self._chosen = 0
        self._recorded = 0
        self._faster: bool | None = None  # the last way found faster (logged when it changes)
        self._lock = threading.Lock()

    def choose(self) -> bool:
        """True: map the next file's pieces."""
        with self._lock:
            self._chosen += 1
            for mapped in (True, False):
                if len(self._rates[mapped]) < self.explore:
                    return mapped
            mapped_rate, pwrite_rate = (statistics.median(self._rates[k]) for k in (True, False))
            faster = mapped_rate >= pwrite_rate
            if faster != self._faster:
                self._faster = faster
                log.info(
                    "vllm-delta: files on tmpfs are written %s (measured: mapped %.1f GB/s, pwrite %.1f GB/s)",
                    "through a mapping" if faster else "by pwrite",
                    mapped_rate / 1e9,
                    pwrite_rate / 1e9,
                )
            return (not faster) if self._chosen % self.recheck == 0 else faster

    def record(self, mapped: bool, nbytes: int, seconds: float) -> None:
        """A file's pieces written that way: `nbytes` in `seconds` (first piece begun to last written)."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._recorded += 1
                if self._recorded > 1:  # the first file: one-time costs
                    self._rates[mapped].append(nbytes / seconds)

    def rates(self) -> dict[bool, list[float]]:
        """The rates kept, per way (bytes per second)."""
        with self._lock:
            return {k: list(v) for k, v in self._rates.items()}


CHOOSER = WriteChooser()  # the process's: files written on tmpfs by this process


def maps_well(path: str) -> bool:
    """Whether the pieces of the next file written at `path` go through a mapping: only on tmpfs,
    then as `ENV` says (by default as the process's `CHOOSER` measured)."""
    mode = os.environ.get(ENV, "auto")
    if mode == "0" or fs_type(path) != "tmpfs":
        return False
    return mode == "1" or CHOOSER.choose()


def allocate(fd: int, size: int) -> int:
    """Allocate the file's first `size` bytes (extending it to at least `size`); returns how many
    bytes are allocated: `size`, or 0 where the filesystem cannot (or has no room)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        return 0
    return size


def pwrite_all(fd: int, data: torch.Tensor, offset: int) -> None:
    """`data` (a contiguous host tensor) at `offset`, by positioned writes."""
    view = memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_mapped(fd: int, data: torch.Tensor, offset: int) -> None:
    """`data` (a contiguous uint8 host tensor) at `offset`, copied into a shared mapping of the file.
    The caller guarantees that [offset, offset + data.numel()) is allocated (`allocate`)."""
    n = data.numel()
    start = offset - offset % _PAGE
    mm = mmap.mmap(fd, offset - start + n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8)  # a writable buffer
        try:
            dst[offset - start :].copy_(data)
        finally:
            del dst  # the mapping closes only once nothing exports it
    finally:
        mm.close()


__all__ = ["ENV", "allocate", "copy_mapped", "fs_type", "maps_well", "mount_type", "pwrite_all"]
