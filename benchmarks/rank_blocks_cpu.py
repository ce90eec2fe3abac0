#!/usr/bin/env python
"""Rank blocks (issue 35 item 3) on the CPU: what the layout costs in bytes and what it saves each
tensor-parallel rank in decoding, the same changes written with rank blocks and without.

A model's HF shapes (every dimension divided by --div, at least 2 kept), --density of each tensor's
elements changed (apply_fixtures.random_changes: uniform positions, realistic differences), one chunked
file each way (chunks of --chunk elements). Per TP (1, 2, 4, 8 where the model's heads allow): each
rank's changed elements decoded (`StagedUpdate.decoded`, the largest share of the version over the ranks)
and its staging time on this CPU (least of --repeat), every rank's writes checked against the reference.

    python benchmarks/rank_blocks_cpu.py [--models qwen3-0.6b,qwen3-30b-a3b] [--div 4] [--density 0.01]

A 2-core machine measures contention as much as code: the bytes and decoded shares are exact, the times
are not. Prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from vllm_delta import format as fmt  # noqa: E402
from vllm_delta.apply.engine import ApplyEngine  # noqa: E402
from vllm_delta.bits import bit_view  # noqa: E402
from vllm_delta.testing.apply_fixtures import (  # noqa: E402
    QWEN3,
    QWEN3_MOE,
    hf_sums,
    model_layout,
    random_changes,
    targets_of,
    write_delta,
    write_delta_blocks,
)


def shrunk(model: str, div: int):
    spec = {**QWEN3, **QWEN3_MOE}[model]
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    for k in ("hidden", "intermediate", "vocab", "head_dim", "moe_intermediate"):
        if k in fields:
            fields[k] = max(64 if k == "head_dim" else 16, fields[k] // div)
    return dataclasses.replace(spec, **{k: v for k, v in fields.items() if k != "name"})


def files(spec, density: float, chunk: int, folder: str) -> tuple[dict, dict, dict[str, str], int]:
    """(old, new, {"blocks": path, "plain": path}, nnz)."""
    _, layout = model_layout(spec)
    gen = torch.Generator().manual_seed(0)
    old = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in layout.hf_shapes.items()}
    changes = random_changes(old, density, seed=1)
    new = {}
    for name, t in old.items():
        flat = bit_view(t).reshape(-1).clone()
        pos, nb, _ = changes[name]
        flat[pos] = nb
        new[name] = flat.view(t.dtype).reshape(t.shape)
    paths = {"blocks": os.path.join(folder, "blocks.safetensors"), "plain": os.path.join(folder, "plain.safetensors")}
    write_delta_blocks([paths["blocks"]], version=1, base=0, new=new, changes=changes, chunk_elems=chunk)
    shapes = dict(layout.hf_shapes)
    write_delta(
        paths["plain"],
        version=1,
        base=0,
        codec="chunked",
        shapes=shapes,
        changes=changes,
        sums=hf_sums(new),
        chunk_elems=chunk,
    )
    nnz = sum(int(c[0].numel()) for c in changes.values())
    return old, new, paths, nnz


def stage_rank(spec, tp: int, rank: int, old: dict, new: dict, path: str, repeat: int) -> tuple[int, float]:
    """(changed elements decoded, least staging ms) of one rank; its writes checked."""
    shapes, layout = model_layout(spec, tp, rank)
    targets = targets_of(layout, shapes, old)
    engine = ApplyEngine(targets, layout, "cpu")
    best, decoded = float("inf"), 0
    with fmt.VersionFile(path) as vf:
        for _ in range(repeat):
            t0 = time.perf_counter()
            staged = engine.stage([vf])
            best = min(best, (time.perf_counter() - t0) * 1e3)
            decoded = staged.decoded
        engine.patch(staged)
    want = targets_of(layout, shapes, new)
    assert all(torch.equal(bit_view(targets[n]), bit_view(want[n])) for n in want), (tp, rank)
    engine.close()
    return decoded, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-30b-a3b")
    ap.add_argument("--div", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tps", default="1,2,4,8", help="tensor-parallel sizes (those the model's heads allow)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    head = f"# rank blocks on this CPU: dims / {args.div}, density {args.density}, chunks of {args.chunk}"
    lines = [f"{head}; cpus={os.cpu_count()}"]
    cols = ("model", "layout", "tensors", "nnz", "bytes", "B/elem", "TP", "max share", "stage ms")
    widths = (14, 7, 7, 9, 10, 6, 3, 9, 9)
    lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for model in args.models.split(","):
        spec = shrunk(model, args.div)
        with tempfile.TemporaryDirectory(prefix="rank-blocks-") as folder:
            old, new, paths, nnz = files(spec, args.density, args.chunk, folder)
            tps = [t for t in map(int, args.tps.split(",")) if spec.heads % t == 0]
            for kind, path in paths.items():
                size = os.path.getsize(path)
                for tp in tps:
                    runs = [stage_rank(spec, tp, r, old, new, path, args.repeat) for r in range(tp)]
                    share = max(d for d, _ in runs) / nnz
                    ms = max(t for _, t in runs)
                    n_t = len(model_layout(spec)[1].hf_shapes)
                    lines.append(
                        f"{model:>14} {kind:>7} {n_t:>7} {nnz:>9} {size:>10} {size / nnz:>6.3f} {tp:>3} "
                        f"{share:>9.3f} {ms:>9.1f}"
                    )
                    print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
