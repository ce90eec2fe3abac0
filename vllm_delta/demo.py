"""`make demo`: the trainer side end to end on the embedded default (a local store).

A tiny generated Qwen3-style model (fp32 master weights) is trained a few steps with AdamW at an RL
learning rate; every step is published to a local store; every version is then materialized from
the store and checked bit-exact against the trainer's bf16 weights.

    python -m vllm_delta.demo [--steps 8] [--store DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import vllm_delta
from vllm_delta import DeltaStore, Publisher
from vllm_delta.materialize import replay
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--anchor-every", type=int, default=5)
    ap.add_argument("--store", default=None, help="store directory (default: a fresh temporary one)")
    args = ap.parse_args(argv)

    root = args.store or tempfile.mkdtemp(prefix="vllm-delta-demo-")
    if args.store and os.path.exists(root):
        shutil.rmtree(root)
    spec = TinyModelSpec(arch="qwen3", hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64, vocab_size=2048)
    model = build_master_model(spec, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vllm-delta {vllm_delta.__version__} demo: qwen3-style model, {n_params / 1e6:.1f}M params, fp32 master "
          f"weights, AdamW lr 1e-6, store {root}")

    images = {}
    t0 = time.perf_counter()
    with Publisher(root, anchor_every=args.anchor_every, codec="compact") as pub:
        pub.publish(model, version=0)
        images[0] = bf16_image(model)
        for step in train_steps(model, args.steps, lr=1e-6):
            pub.publish(model, version=step)
            images[step] = bf16_image(model)
    print(f"published {len(images)} versions in {time.perf_counter() - t0:.1f} s (training included)\n")

    store = DeltaStore(root)
    print(f"{'version':>7} {'kind':6} {'base':>4} {'density':>8} {'nnz':>9} {'bytes':>10} {'B/changed':>9} "
          f"{'raw would be':>12}  bit-exact")
    failures = 0
    for rec in store.records():
        _, tensors = replay(store, rec.version)
        want = images[rec.version]
        exact = all(torch.equal(tensors[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
        exact = exact and rec.checksum == vllm_delta.checksum(want)
        failures += not exact
        per = f"{rec.bytes / rec.nnz:.2f}" if rec.kind == "delta" else "-"
        raw = f"{rec.nnz * 6:,}" if rec.kind == "delta" else "-"
        print(f"{rec.version:>7} {rec.kind:6} {rec.base if rec.base is not None else '-':>4} {rec.density:>8.2%} "
              f"{rec.nnz:>9,} {rec.bytes:>10,} {per:>9} {raw:>12}  {'yes' if exact else 'NO'}")
    print(f"\ntry: vllm-delta inspect {root}")
    if failures:
        print(f"FAILED: {failures} version(s) did not replay bit-exact")
        return 1
    print("all versions replay bit-exact from the store")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
