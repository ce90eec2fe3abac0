#!/usr/bin/env python
"""Staging's `read` (issue 35): a fresh version file's bytes into pinned host memory, the way staging reads
them (a private memory map of the file, copied in 4 MiB pieces by a pool's threads: apply/staging.py) beside
`os.preadv` of the same pieces from an open descriptor (no page faults on the source), on tmpfs. Each file is
written just before it is read (as a publish writes it), p50 / p95 over the files, GB/s.

    python benchmarks/read_pinned.py [--mb 109] [--files 20] [--threads 16] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

PIECE = 4 << 20


def _mapped(path: str) -> np.ndarray:
    """The file's bytes through a private mapping (as version_file.VersionFile maps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return np.frombuffer(m, dtype=np.uint8)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_READ = 22  # Linux 5.14: the range's page tables filled in one call (no fault per page)
PAGE = mmap.PAGESIZE


def populate(src: np.ndarray, a: int, b: int) -> None:
    """madvise(MADV_POPULATE_READ) over src[a:b] (page-aligned outward)."""
    addr = src.ctypes.data + a
    start = addr - addr % PAGE
    if _LIBC.madvise(start, addr + (b - a) - start, MADV_POPULATE_READ) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")


def by_map(path: str, dst: np.ndarray, pool: ThreadPoolExecutor, populated: bool = False) -> None:
    src = _mapped(path)

    def copy(a: int) -> None:
        b = min(src.size, a + PIECE)
        if populated:
            populate(src, a, b)
        dst[a:b] = src[a:b]

    list(pool.map(copy, range(0, src.size, PIECE)))


def by_map_populated(path: str, dst: np.ndarray, pool: ThreadPoolExecutor) -> None:
    by_map(path, dst, pool, populated=True)


def by_pread(path: str, dst: np.ndarray, pool: ThreadPoolExecutor) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        view = memoryview(dst)

        def read(a: int) -> None:
            b = min(size, a + PIECE)
            while a < b:
                a += os.preadv(fd, [view[a:b]], a)

        list(pool.map(read, range(0, size, PIECE)))
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=109)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = ap.parse_args()
    n = args.mb << 20
    pinned = torch.cuda.is_available()
    dst_t = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    dst = dst_t.numpy()
    data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    pool = ThreadPoolExecutor(args.threads)
    ways = {"map": by_map, "pread": by_pread, "populate": by_map_populated}
    times: dict[str, list[float]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for i in range(args.files + 1):
            order = list(ways.items())
            for way, fn in order[i % len(order) :] + order[: i % len(order)]:
                path = os.path.join(d, f"{way}-{i}.bin")
                with open(path, "wb") as f:
                    f.write(data.data)
                dst[:] = 0
                t0 = time.perf_counter()
                fn(path, dst, pool)
                ms = (time.perf_counter() - t0) * 1e3
                if i:
                    times[way].append(ms)
                assert np.array_equal(dst[:4096], data[:4096]) and np.array_equal(dst[-4096:], data[-4096:])
                os.unlink(path)
    print(
        f"# read_pinned {args.mb} MiB x {args.files} fresh files on {args.dir}, {args.threads} threads, pinned={pinned}"
    )
    print(f"{'way':>6} {'p50 ms':>8} {'p95 ms':>8} {'GB/s p50':>9}")
    for way, t in times.items():
        p50, p95 = np.percentile(t, 50), np.percentile(t, 95)
        print(f"{way:>6} {p50:>8.2f} {p95:>8.2f} {n / p50 / 1e6:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
