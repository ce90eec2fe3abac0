#!/usr/bin/env python
"""Writing a version file while its payload arrives (format.PayloadWriter), with and without the
space allocated ahead (`size_hint`), and on tmpfs by positioned writes beside copies into a mapping
(`mapped_writes`), on the CPU: what the upload thread's `write` phase costs after the GPU encode
(issues 17, 25).

The payload (`--mb` of random bytes, default 109: Qwen3-8B at 1%) arrives in 8 MB pieces after
`--encode-ms` (the time nvCOMP takes to compress it, during which the allocation runs); the time is
from the first piece to the file being complete. A CPU benchmark: on a shared machine it measures
contention too.

    python benchmarks/write_file.py [--dirs /dev/shm,/tmp] [--reps 5] [--threads 16]
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

from vllm_delta import mapped_writes  # noqa: E402
from vllm_delta.format import PayloadWriter, VersionHeader  # noqa: E402

# (label, size hint given, mapped writes allowed)
MODES = [
    ("allocated by the writes", False, False),
    ("allocated ahead, pwrite", True, False),
    ("allocated ahead, mapped", True, True),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_dirs = [d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]
    ap.add_argument("--dirs", default=",".join(default_dirs))
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
        for folder in args.dirs.split(","):
            path = os.path.join(folder, "write-file-bench.safetensors")
            kind = mapped_writes.fs_type(path) or "?"
            for label, hinted, mapped in MODES:
                if mapped and kind != "tmpfs":
                    continue  # not tmpfs: the writer never maps there
                os.environ[mapped_writes.ENV] = "1" if mapped else "0"
                times = []
                for _ in range(args.reps):
                    with PayloadWriter(
                        path, header, [("blob", torch.uint8, 1)], pool, size_hint=blob.numel() if hinted else 0
                    ) as out:
                        time.sleep(args.encode_ms / 1e3)  # the GPU compresses meanwhile
                        t0 = time.perf_counter()
                        for a in range(0, blob.numel(), piece):
                            out.append("blob", blob[a : a + piece])
                    times.append((time.perf_counter() - t0) * 1e3)
                    os.unlink(path)
                rows.append((f"{folder} ({kind})", label, statistics.median(times)))
    os.environ.pop(mapped_writes.ENV, None)
    print(
        f"# {args.mb} MB, {args.threads} writer threads, {os.cpu_count()} CPUs, "
        f"median of {args.reps} (ms after the encode)"
    )
    for folder, label, ms in rows:
        print(f"{folder:>24} {label:>26} {ms:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
