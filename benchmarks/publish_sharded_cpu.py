#!/usr/bin/env python
"""What a sharded publish costs in Python per tensor at a model's tensor count, on CPU (issue 25 item 3).

W ranks (gloo; `vllm_delta.testing.sharded.run_ranks`) publish versions of a module whose parameters
are a model's checkpoint tensors (Qwen3-30B-A3B by default: 18,867), same names, every dimension
divided by --div, so that the tensor count is the model's and the bytes fit a small machine. Each
decoder layer and the root are FSDP2-sharded (`fully_shard`). Before each publish every rank changes
about 1% of its local elements in place, as an optimizer step would. The GPU benchmark
(`publish_gpu.py`) measures the same path with the real shapes. This one shows the Python per tensor
apart from the device work, on any machine, and can put two checkouts side by side.

For each tree, the medians over the timed steps, ms:
* rank 0's training thread: `publish` and its phases (agree, detect, prepare, sums, job, queue);
* its upload thread: split, pack, write, put_part, commit, and `upload` (publish returned -> the
  version visible);
* rank 0's `store.open` of the version (the W part headers parsed and merged).

    python benchmarks/publish_sharded_cpu.py [--model qwen3-30b-a3b] [--world 2] [--steps 3] [--div 32]
                                             [--tree DIR] [--repeat 2] [--out DIR] [--keep DIR]

--tree DIR measures another checkout beside this one (for example the commit before a change:
`git worktree add /tmp/base <rev>`). Its package comes first on the ranks' path, and the two trees run
alternately, --repeat times each. On a 2-core machine the ranks and their upload threads share the
cores, so compare trees only within one run. Prints a table last. With --out it writes
publish_sharded_cpu.json and publish_sharded_cpu.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TREE_ENV = "PUBLISH_SHARDED_TREE"  # set in a child run (and so in its ranks): the checkout it measures
sys.path.insert(0, os.environ.get(TREE_ENV) or ROOT)

TRAINING = ("publish", "agree", "detect", "prepare", "sums", "job", "queue")
UPLOAD = ("split", "pack", "write", "put_part", "commit", "upload")


def build_module(shapes: dict[str, tuple[int, ...]]):
    """A module tree whose named_parameters() are exactly `shapes` (fp32, N(0, 0.02))."""
    import torch
    from torch import nn

    root = nn.Module()
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, nn.Parameter(torch.randn(shape, generator=gen) * 0.02))
    return root


def rank_run(rank: int, world: int, root: str, model: str, div: int, steps: int, warmup: int) -> dict:
    """One rank: publish `warmup + steps` deltas after an anchor; the timed steps' phases."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from vllm_delta.store import DeltaStore
    from vllm_delta.testing.apply_fixtures import QWEN3, QWEN3_MOE, model_layout
    from vllm_delta.trainer import Publisher

    _, layout = model_layout({**QWEN3, **QWEN3_MOE}[model])
    shapes = {n: tuple(max(2, d // div) for d in s) for n, s in layout.hf_shapes.items()}
    module = build_module(shapes)
    layers = getattr(getattr(module, "model", None), "layers", None)
    for layer in layers.children() if layers is not None else ():
        fully_shard(layer)
    fully_shard(module)
    gen = torch.Generator().manual_seed(1 + rank)
    store = DeltaStore(os.path.join(root, "store"))
    rows = []
    with Publisher(os.path.join(root, "store"), group=dist.group.WORLD, codec="chunked") as pub:
        pub.publish(module, version=0)
        pub.flush()
        for v in range(1, warmup + steps + 1):
            with torch.no_grad():
                for p in module.parameters():
                    local = p.to_local() if hasattr(p, "to_local") else p
                    if local.numel():
                        hit = torch.rand(local.shape, generator=gen) < 0.01
                        local.add_(hit * 0.05 * local.abs().clamp_min(1e-3))
            dist.barrier()
            t0 = time.perf_counter()
            info = pub.publish(module, version=v)
            t1 = time.perf_counter()
            info.uploaded.result()
            t2 = time.perf_counter()
            row = {"publish": (t1 - t0) * 1e3, "upload": (t2 - t1) * 1e3, **info.timings}
            row.update(pub.upload_timings.get(v, {}))
            if rank == 0:
                t3 = time.perf_counter()
                store.open(v).close()
                row["open"] = (time.perf_counter() - t3) * 1e3
            if v > warmup:
                rows.append(row)
            dist.barrier()
    import vllm_delta

    return {"rows": rows, "tensors": len(shapes), "package": os.path.dirname(vllm_delta.__file__)}


def child(args: argparse.Namespace) -> int:
    """One tree's measurement (this process has the tree's package first on its path)."""
    from vllm_delta.testing.sharded import run_ranks

    if args.keep:  # the store stays (benchmarks/open_parts.py reads it)
        shutil.rmtree(args.keep, ignore_errors=True)
        os.makedirs(args.keep)
    with tempfile.TemporaryDirectory(prefix="publish-sharded-") as tmp:
        root = args.keep or tmp
        results = run_ranks(rank_run, args.world, (root, args.model, args.div, args.steps, args.warmup))
    rows = results[0]["rows"]
    keys = sorted({k for r in rows for k in r})
    out = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
    out["tensors"] = results[0]["tensors"]
    out["package"] = results[0]["package"]  # which checkout the ranks imported (checked by the parent)
    with open(args.child, "w") as f:
        json.dump(out, f)
    return 0


def measure(tree: str, args: argparse.Namespace) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--model", args.model, "--div", str(args.div)]
    cmd += ["--world", str(args.world), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.keep:
        cmd += ["--keep", os.path.join(os.path.abspath(args.keep), "this" if tree == ROOT else "other")]
    env = {**os.environ, TREE_ENV: tree, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        # In the tree's folder: the ranks' forkserver imports its preloads with the working folder first
        # on its path (Python 3.11), ahead of PYTHONPATH
        subprocess.run(cmd, env=env, cwd=tree, check=True, timeout=args.timeout)
        with open(path) as f:
            out = json.load(f)
    finally:
        os.unlink(path)
    want = os.path.join(os.path.realpath(tree), "vllm_delta")
    if os.path.realpath(out["package"]) != want:
        raise RuntimeError(f"the ranks imported {out['package']}, not {want}")
    return out


def main() -> int:
    from vllm_delta.testing.apply_fixtures import QWEN3, QWEN3_MOE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted({**QWEN3, **QWEN3_MOE}))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed versions per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--div", type=int, default=32, help="every dimension divided by this (at least 2 remain)")
    ap.add_argument("--tree", default="", help="another checkout, measured beside this one")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tree (alternating)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--out", default="")
    ap.add_argument("--keep", default="", help="keep each tree's store of its last run in DIR/this, DIR/other")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    trees = [("this", ROOT)] + ([("other", os.path.abspath(args.tree))] if args.tree else [])
    runs = []
    for i in range(args.repeat):
        for label, tree in trees if i % 2 == 0 else trees[::-1]:
            runs.append({"tree": label, "path": tree, "run": i + 1, **measure(tree, args)})
    cols = [*TRAINING, *UPLOAD, "open"]
    print(
        f"# {args.model}: {runs[0]['tensors']} tensors, dims / {args.div}, W={args.world} (gloo, FSDP2), "
        f"medians of {args.steps} versions, ms; cpus={os.cpu_count()}"
    )
    for label, tree in trees:
        print(f"# {label}: {tree}")
    print(f"{'tree':>6} {'run':>3} " + " ".join(f"{c:>8}" for c in cols))
    for r in runs:
        print(f"{r['tree']:>6} {r['run']:>3} " + " ".join(f"{r.get(c, float('nan')):>8.1f}" for c in cols))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        doc = {"command": " ".join(sys.argv), "model": args.model, "world": args.world, "div": args.div, "runs": runs}
        with open(os.path.join(args.out, "publish_sharded_cpu.json"), "w") as f:
            json.dump(doc, f, indent=1)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.4))
        width = 0.8 / len(runs)
        for j, r in enumerate(runs):
            xs = [i + (j - (len(runs) - 1) / 2) * width for i in range(len(cols))]
            ax.bar(xs, [r.get(c, 0.0) for c in cols], width=width, label=f"{r['tree']} #{r['run']}")
        ax.set_xticks(range(len(cols)), cols, rotation=45, fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{args.model}, W={args.world}: a sharded publish on CPU, per phase", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "publish_sharded_cpu.png"), dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
