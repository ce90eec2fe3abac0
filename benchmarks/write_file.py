#!/usr/bin/env python
"""Writing a version file while its payload arrives (format.PayloadWriter), with and without the
space allocated ahead (`size_hint`), on the CPU: what the upload thread's `write` phase costs after
the GPU encode (issue 17).

The payload (`--mb` of random bytes, default 109: Qwen3-8B at 1%) arrives in 8 MB pieces after
`--encode-ms` (the time nvCOMP takes to compress it, during which the allocation runs); the time is
from the first piece to the file being complete. A CPU benchmark: on a shared machine it measures
contention too.

    python benchmarks/write_file.py [--dir /dev/shm] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from vllm_delta.format import PayloadWriter, VersionHeader  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--mb", type=int, default=109)
    ap.add_argument("--encode-ms", type=float, default=25.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    blob = torch.randint(0, 256, (args.mb * 10**6,), dtype=torch.uint8)
    header = VersionHeader(version=0, kind="anchor", tensors={}, checksum="0" * 16)
    piece = 8 << 20
    rows = []
    with ThreadPoolExecutor(args.threads) as pool:
        for hint in (0, blob.numel()):
            times = []
            for _ in range(args.reps):
                path = os.path.join(args.dir, "write-file-bench.safetensors")
                with PayloadWriter(path, header, [("blob", torch.uint8, 1)], pool, size_hint=hint) as out:
                    time.sleep(args.encode_ms / 1e3)  # the GPU compresses meanwhile
                    t0 = time.perf_counter()
                    for a in range(0, blob.numel(), piece):
                        out.append("blob", blob[a : a + piece])
                times.append((time.perf_counter() - t0) * 1e3)
                os.unlink(path)
            rows.append((hint, statistics.median(times)))
    print(f"# {args.mb} MB into {args.dir}, {args.threads} writer threads, median of {args.reps} (ms after the encode)")
    for hint, ms in rows:
        print(f"{'allocated ahead' if hint else 'allocated by the writes':>24} {ms:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
