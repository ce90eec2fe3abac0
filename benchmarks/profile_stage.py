#!/usr/bin/env python
"""Where staging time goes: torch.profiler and cProfile over ApplyEngine.stage of one Qwen3-shaped
delta (GPU): device kernels, and the Python functions (per-tensor work shows up there).

python benchmarks/profile_stage.py [--model qwen3-8b|qwen3-30b-a3b] [--density 0.01] [--codec chunked]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from apply_gpu import build_model  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from vllm_delta.apply.engine import ApplyEngine  # noqa: E402
from vllm_delta.format import VersionFile  # noqa: E402
from vllm_delta.testing.apply_fixtures import QWEN3, QWEN3_MOE, random_changes, write_delta  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--codec", default="chunked")
    ap.add_argument(
        "--sweep",
        default="",
        help="comma-separated device chunk sizes (changed elements, e.g. 8388608,33554432): staging time, its "
        "phases and peak device memory for each, median of --reps, instead of the profiles",
    )
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    spec = {**QWEN3, **QWEN3_MOE}[args.model]
    layout, targets, hf = build_model(spec, dev)
    changes = random_changes(hf, args.density, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v1.safetensors")
        write_delta(
            path,
            version=1,
            base=0,
            codec=args.codec,
            shapes=layout.hf_shapes,
            changes=changes,
            pool=ThreadPoolExecutor(16),
        )
        del changes
        vf = VersionFile(path)
        if args.sweep:
            sweep(layout, targets, vf, dev, [int(x) for x in args.sweep.split(",")], args.reps)
            return
        engine = ApplyEngine(dict(zip(layout.targets, targets)), layout, dev)
        for _ in range(2):
            staged = engine.stage([vf])
            del staged
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        staged = engine.stage([vf])
        pr.disable()
        print({k: round(v, 1) for k, v in staged.timings.items()})
        pstats.Stats(pr).sort_stats("cumulative").print_stats(args.rows)
        del staged
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            staged = engine.stage([vf])
        print({k: round(v, 1) for k, v in staged.timings.items()})
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        print(device_summary(prof, staged.timings["total"]))


def sweep(layout, targets, vf, dev, sizes: list[int], reps: int) -> None:
    """Staging by device chunk size (`ApplyEngine(chunk_elems=...)`): median of `reps` after a first."""
    import statistics

    rows = []
    for size in sizes:
        engine = ApplyEngine(dict(zip(layout.targets, targets)), layout, dev, chunk_elems=size)
        engine.stage([vf])  # first: kernels, buffers
        runs, peak = [], 0
        for _ in range(reps):
            staged = engine.stage([vf])
            runs.append(dict(staged.timings))
            peak = max(peak, staged.memory["device_peak_bytes"])
            del staged
        engine.close()
        keys = sorted({k for r in runs for k in r})
        rows.append((size, {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}, peak))
        torch.cuda.empty_cache()
    phases = ["read", "h2d", "inflate", "decode", "translate", "gather", "partials", "plan"]
    print(f"{'chunk elems':>12} {'stage ms':>9} " + " ".join(f"{p:>9}" for p in phases) + f" {'peak MB':>8}")
    for size, t, peak in rows:
        cells = " ".join(f"{t.get(p, 0.0):>9.1f}" for p in phases)
        print(f"{size:>12} {t['total']:>9.1f} {cells} {peak / 1e6:>8.0f}")


def device_summary(prof, wall_ms: float) -> str:
    """How much of a staging's wall time the device was busy (the union of its kernels' and copies'
    intervals), and the host's waits for it: idle device time is the host's (Python, launches, waits)."""
    spans, waits = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync"):
            n, us = waits.get(e.name, (0, 0.0))
            waits[e.name] = (n + 1, us + e.time_range.end - e.time_range.start)
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    first = min((a for a, _ in spans), default=0.0)
    lines = [
        f"device busy {busy / 1e3:.1f} ms of a {wall_ms:.1f} ms staging ({busy / 1e3 / wall_ms:.0%}); "
        f"{len(spans)} device events over {(end - first) / 1e3:.1f} ms"
    ]
    lines += [f"  host {name}: {n} calls, {us / 1e3:.1f} ms" for name, (n, us) in sorted(waits.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
