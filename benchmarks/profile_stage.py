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
        engine = ApplyEngine(dict(zip(layout.targets, targets)), layout, dev)
        vf = VersionFile(path)
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


if __name__ == "__main__":
    main()
