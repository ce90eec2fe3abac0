#!/usr/bin/env python
"""nvCOMP's zstd compression space by batch (issue 35 item 6): what `nvcompBatchedZstdCompressGetTempSize` asks
for a batch of n frames of at most `max_in` bytes, and the largest compressed frame it allows, beside the time
one launch of that batch takes on this card (random bytes shaped like the chunked codec's planes: a gap plane
of small values). Prints one table.

    python benchmarks/nvcomp_temp.py
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_delta.codec.chunked import nvcomp_c  # noqa: E402
from vllm_delta.codec.chunked.gpu import _host_sizes  # noqa: E402


def temp_bytes(c_api: nvcomp_c.ZstdC, n: int, max_in: int) -> int:
    out = nvcomp_c._SIZE_T(0)  # noqa: SLF001 - the C API's own types
    status = c_api._lib.nvcompBatchedZstdCompressGetTempSize(  # noqa: SLF001
        n, max_in, c_api._copts, ctypes.byref(out), n * max_in, None
    )
    if status != nvcomp_c.SUCCESS:
        raise RuntimeError(f"GetTempSize({n}, {max_in}) returned {status}")
    return int(out.value)


def launch_ms(c_api: nvcomp_c.ZstdC, n: int, size: int, dev: torch.device, reps: int = 3) -> float:
    gen = torch.Generator(device=dev).manual_seed(0)
    src = torch.randint(0, 24, (n * size,), dtype=torch.uint8, device=dev, generator=gen)
    cap = -(-c_api.max_compressed_bytes(size) // 16) * 16
    slots = torch.empty(n * cap, dtype=torch.uint8, device=dev)
    frames = np.stack(
        [np.arange(n) * size, np.full(n, size), np.arange(n) * cap, np.zeros(n, dtype=np.int64)], axis=1
    ).astype(np.int64)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        _host_sizes(c_api.compress(src, slots, frames))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times[1:]))


def main() -> int:
    c_api, why = nvcomp_c.load()
    if c_api is None or not torch.cuda.is_available():
        print(f"needs nvCOMP's C API and CUDA ({why})")
        return 2
    dev = torch.device("cuda", 0)
    print(f"# nvcomp_temp {torch.cuda.get_device_name(dev)} torch {torch.__version__}")
    print(f"{'frames':>7} {'max_in':>7} {'temp MB':>9} {'temp KB/frame':>14} {'max out':>8} {'launch ms':>10}")
    shapes = [(625, 65536), (1250, 65536), (2500, 65536), (6250, 65536), (2500, 8192), (6250, 8192), (6250, 16384)]
    for n, size in shapes:
        t = temp_bytes(c_api, n, size)
        ms = launch_ms(c_api, n, size, dev)
        out = c_api.max_compressed_bytes(size)
        print(f"{n:>7} {size:>7} {t / 1e6:>9.1f} {t / n / 1e3:>14.1f} {out:>8} {ms:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
