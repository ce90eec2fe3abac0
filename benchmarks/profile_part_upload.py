#!/usr/bin/env python
"""Where a sharded rank's upload of a mixture-of-experts part goes in Python, on the CPU (issue 25).

Two gloo ranks (FSDP2, `vllm_delta.testing.sharded.run_ranks`) publish versions of a module with
Qwen3-30B-A3B's 18,867 checkpoint tensors, every dimension divided by --div, ~1% of each rank's
elements changed per version (as `publish_sharded_cpu.py`). Rank 0's `VersionEncoder._write_delta`
(the upload thread's split and pack of its part) and its `store.open` of each version run under
cProfile after a warm-up version; the two profiles are printed, by cumulative and by own time.

    python benchmarks/profile_part_upload.py [--div 32] [--versions 2] [--rows 35] [--tree DIR]

--tree DIR profiles another checkout too, in the same run (benchmarks/trees.py); a table of the two
trees' totals (ms per version, under the profiler) comes last. A profile on a shared 2-core machine:
the shares are what it shows, not the times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from trees import child_output, in_tree, tree_first  # noqa: E402

tree_first()  # a child run: the measured checkout's package first


def rank_fn(rank: int, world: int, root: str, div: int, versions: int, rows: int) -> dict:
    import torch
    import torch.distributed as dist
    from publish_sharded_cpu import build_module
    from torch.distributed.fsdp import fully_shard

    from vllm_delta.store import DeltaStore
    from vllm_delta.testing.apply_fixtures import QWEN3_MOE, model_layout
    from vllm_delta.trainer import Publisher
    from vllm_delta.trainer import encode as enc_mod

    torch.set_num_threads(1)
    _, layout = model_layout(QWEN3_MOE["qwen3-30b-a3b"])
    module = build_module({n: tuple(max(2, d // div) for d in s) for n, s in layout.hf_shapes.items()})
    for layer in module.model.layers.children():
        fully_shard(layer)
    fully_shard(module)
    upload, opening = cProfile.Profile(), cProfile.Profile()
    real = enc_mod.VersionEncoder._write_delta
    timed = {"on": False}

    def profiled(self, job, path):
        if timed["on"] and rank == 0:
            return upload.runcall(real, self, job, path)
        return real(self, job, path)

    enc_mod.VersionEncoder._write_delta = profiled  # this rank process only
    gen = torch.Generator().manual_seed(1 + rank)
    store = DeltaStore(os.path.join(root, "store"))
    with Publisher(os.path.join(root, "store"), group=dist.group.WORLD, codec="chunked") as pub:
        pub.publish(module, version=0)
        pub.flush()
        for v in range(1, versions + 2):  # version 1 warms up
            with torch.no_grad():
                for p in module.parameters():
                    local = p.to_local()
                    if local.numel():
                        hit = torch.rand(local.shape, generator=gen) < 0.01
                        local.add_(hit * 0.05 * local.abs().clamp_min(1e-3))
            timed["on"] = v > 1
            dist.barrier()
            pub.publish(module, version=v).uploaded.result()
            if rank == 0 and v > 1:
                opening.runcall(lambda v=v: store.open(v).close())
                phases = {k: round(x, 1) for k, x in pub.upload_timings.get(v, {}).items()}
                print(f"version {v}: upload phases (ms) {phases}", flush=True)
            dist.barrier()
    if rank == 0:
        for name, prof in (("rank 0's _write_delta", upload), ("rank 0's store.open", opening)):
            for order in ("cumulative", "tottime"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(order).print_stats(rows)
                print(f"===== {name}, by {order}\n{out.getvalue()}", flush=True)
        timed = versions  # the versions after the warm-up one
        return {
            "write_delta_ms": pstats.Stats(upload).total_tt * 1e3 / timed,  # type: ignore[attr-defined]
            "open_ms": pstats.Stats(opening).total_tt * 1e3 / timed,  # type: ignore[attr-defined]
            "calls_write_delta": pstats.Stats(upload).total_calls / timed,  # type: ignore[attr-defined]
            "calls_open": pstats.Stats(opening).total_calls / timed,  # type: ignore[attr-defined]
        }
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--div", type=int, default=32)
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--rows", type=int, default=35)
    ap.add_argument("--tree", default="", help="another checkout, profiled beside this one")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    child_args = ["--div", str(args.div), "--versions", str(args.versions), "--rows", str(args.rows)]
    if not args.child:  # each tree in a child of its own, this one first
        trees = [("this", os.path.dirname(HERE))] + ([("other", os.path.abspath(args.tree))] if args.tree else [])
        results = [(label, in_tree(tree, __file__, child_args)) for label, tree in trees]
        print(f"# rank 0 under cProfile, ms per version (calls per version), div {args.div}; cpus={os.cpu_count()}")
        print(f"{'tree':>6} {'_write_delta':>14} {'calls':>9} {'store.open':>12} {'calls':>9}")
        for label, r in results:
            print(
                f"{label:>6} {r['write_delta_ms']:>14.1f} {r['calls_write_delta']:>9.0f} "
                f"{r['open_ms']:>12.1f} {r['calls_open']:>9.0f}"
            )
        return 0
    import profile_part_upload  # the ranks import rank_fn by this name

    from vllm_delta.testing.sharded import run_ranks

    with tempfile.TemporaryDirectory() as root:
        out = run_ranks(profile_part_upload.rank_fn, 2, (root, args.div, args.versions, args.rows), timeout=900)
    child_output(args.child, out[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
