"""Bytes per changed element and codec throughput on realistic RL deltas.

A Qwen3-style model with fp32 master weights is trained with AdamW (lr 1e-6) on random tokens; each
step's bf16 change set is encoded with `raw` (int32 positions + bf16 values, TRL v1), TRL's default
`gap_delta` (uint16/uint32 gaps + raw bf16 values, reimplemented here) and our `compact`.

    .venv/bin/python benchmarks/payload.py [--steps 6] [--hidden 512] [--layers 4] [--png out.png]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from vllm_delta import codec
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps


def trl_gap_delta_bytes(positions: torch.Tensor) -> int:
    """TRL's `gap_delta`: per tensor, gaps as uint16 if they all fit, else uint32; plus 2 B bf16 values."""
    if positions.numel() == 0:
        return 0
    prev = torch.cat([torch.tensor([-1]), positions[:-1]])
    gaps = positions - prev - 1
    width = 2 if int(gaps.max()) <= 0xFFFF else 4
    return positions.numel() * (width + 2)


def measure_step(prev: dict, cur: dict, levels: list[int]) -> dict:
    row = {"nnz": 0, "numel": 0, "raw": 0, "trl": 0}
    row.update({f"compact{lv}": 0 for lv in levels})
    row.update({f"enc{lv}_s": 0.0 for lv in levels}, dec_s=0.0)
    for name, t in cur.items():
        old = prev[name].view(torch.int16).reshape(-1)
        new = t.view(torch.int16).reshape(-1)
        pos = (old != new).nonzero().reshape(-1)
        row["numel"] += new.numel()
        if not pos.numel():
            continue
        row["nnz"] += pos.numel()
        raw, _ = codec.encode("raw", pos, new[pos], old[pos], new.numel(), torch.bfloat16)
        row["raw"] += sum(v.numel() * v.element_size() for v in raw.values())
        row["trl"] += trl_gap_delta_bytes(pos)
        for lv in levels:
            c = codec.CompactCodec(level=lv)
            t0 = time.perf_counter()
            tensors, meta = c.pack(c.prepare(pos, new[pos], old[pos], new.numel()), torch.bfloat16)
            row[f"enc{lv}_s"] += time.perf_counter() - t0
            row[f"compact{lv}"] += tensors["blob"].numel()
            if lv == codec.ZSTD_LEVEL:
                t0 = time.perf_counter()
                changes = codec.decode(
                    "compact", tensors, meta, numel=new.numel(), nnz=pos.numel(), dtype=torch.bfloat16
                )
                got = changes.new_bits(old[pos])
                row["dec_s"] += time.perf_counter() - t0
                assert torch.equal(changes.positions, pos) and torch.equal(got, new[pos]), name
        # one-ULP share, as in notes/gpu_probe.md
        d = new[pos].to(torch.int64) - old[pos].to(torch.int64)
        row["ulp1"] = row.get("ulp1", 0) + int((d.abs() == 1).sum())
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--png", default="benchmarks/results/payload.png")
    args = ap.parse_args()

    spec = TinyModelSpec(
        arch="qwen3",
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=args.vocab,
    )
    model = build_master_model(spec, seed=0)
    params = sum(p.numel() for p in model.parameters())
    levels = [1, 3, 9]
    print(
        f"# payload benchmark: {platform.node()} ({platform.processor() or platform.machine()}), torch "
        f"{torch.__version__}, model qwen3 hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
        f"params={params / 1e6:.1f}M, AdamW lr={args.lr}, fp32 master weights"
    )
    prev = bf16_image(model)
    rows = []
    for step in train_steps(model, args.steps, lr=args.lr):
        cur = bf16_image(model)
        row = measure_step(prev, cur, levels)
        row["step"] = step
        rows.append(row)
        prev = cur

    hdr = (
        f"{'step':>4} {'density':>8} {'1-ULP':>6} {'raw':>6} {'trl':>6} "
        + " ".join(f"{'zstd' + str(lv):>7}" for lv in levels)
        + f" {'enc MB/s':>9} {'dec MB/s':>9}   (bytes per changed element; throughput in changed elems x2B/s)"
    )
    print(hdr)
    for r in rows:
        n = r["nnz"]
        enc = 2 * n / r[f"enc{codec.ZSTD_LEVEL}_s"] / 1e6
        dec = 2 * n / r["dec_s"] / 1e6
        print(
            f"{r['step']:>4} {n / r['numel']:>8.2%} {r['ulp1'] / n:>6.1%} {r['raw'] / n:>6.2f} {r['trl'] / n:>6.2f} "
            + " ".join(f"{r[f'compact{lv}'] / n:>7.3f}" for lv in levels)
            + f" {enc:>9.0f} {dec:>9.0f}"
        )
    n = sum(r["nnz"] for r in rows)
    worst = max(r[f"compact{codec.ZSTD_LEVEL}"] / r["nnz"] for r in rows)
    print(
        f"all  raw {sum(r['raw'] for r in rows) / n:.2f}  trl {sum(r['trl'] for r in rows) / n:.2f}  "
        f"compact(level {codec.ZSTD_LEVEL}) {sum(r[f'compact{codec.ZSTD_LEVEL}'] for r in rows) / n:.3f} "
        f"B/changed elem (worst step {worst:.3f}; target <= 1.5)"
    )

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in rows]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in [
            ("raw", "raw (int32 + bf16)"),
            ("trl", "TRL gap_delta"),
            (f"compact{codec.ZSTD_LEVEL}", "compact (ours)"),
        ]:
            ax.plot(steps, [r[key] / r["nnz"] for r in rows], marker="o", label=label)
        ax.axhline(1.5, ls="--", c="gray", lw=1, label="target 1.5 B")
        ax.set_xlabel("RL step")
        ax.set_ylabel("bytes per changed element")
        ax.set_ylim(0, 6.5)
        ax.legend()
        ax.set_title(f"payload, AdamW lr {args.lr}, {params / 1e6:.0f}M params")
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"saved {args.png}")
    except ImportError:
        print("matplotlib missing: no PNG")
    if worst > 1.5:
        raise SystemExit(f"compact exceeds 1.5 B per changed element ({worst:.3f})")
    np.seterr(all="ignore")


if __name__ == "__main__":
    main()
