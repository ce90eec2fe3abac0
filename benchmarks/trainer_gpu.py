#!/usr/bin/env python
"""Trainer side on the GPU (issue 4, item 5; issue 9): exact change detection + compact encoding of
one optimizer step of a Qwen3-8B-shaped model, next to the floor of reading the master weights once.

The step is simulated: fp32 master weights sit within a quarter ULP of their bf16 image, and one
step moves ~1% of them (uniform positions) by realistic bf16 amounts (~89% one ULP). Timed, as
`Publisher.publish` does it on the training thread (same calls, same order): flat-buffer detection
of all tensors (`FlatSnapshot.changes`: comparison, compaction, checksum terms), the codec's batched
device part (`prepare_batch`) and its copies to the host (waited for here); then the host side `pack`
(zstd), which the Publisher runs on its upload thread: one thread, and a pool for comparison.
benchmarks/publish_gpu.py measures the whole publish inside a real training loop.

    python benchmarks/trainer_gpu.py [--model qwen3-8b] [--density 0.01] [--backend triton|torch] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from vllm_delta import codec as codecs  # noqa: E402
from vllm_delta.bits import bit_view  # noqa: E402
from vllm_delta.testing.apply_fixtures import QWEN3, apply_diffs, qwen3_layout, random_positions, realistic_diffs  # noqa: E402
from vllm_delta.trainer.detect import FlatSnapshot  # noqa: E402
from vllm_delta.trainer.shard import Owned  # noqa: E402

LOG: list[str] = []


def log(msg=""):
    print(msg, flush=True)
    LOG.append(msg)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--backend", choices=["triton", "torch"], default=None, help="detection backend")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--cpu-check", action="store_true", help="tiny model on CPU: checks the script runs")
    args = ap.parse_args()
    if args.cpu_check:
        dev, card, args.model = torch.device("cpu"), "cpu", "qwen3-tiny"
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --cpu-check)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        card = torch.cuda.get_device_name(dev)
    log(
        f"# trainer_gpu {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} card={card} "
        f"torch={torch.__version__}"
    )
    log(f"# command: python {' '.join(sys.argv)}")
    master, owned, snap = make_master(args, dev)
    params = sum(t.numel() for t in master.values())
    read_floor = floors(args, dev, params)
    codec = codecs.get_codec("compact")
    pool = ThreadPoolExecutor(args.threads)
    rows = []
    for step in range(args.steps):
        nnz_true = optimizer_step(master, step, args.density, dev)
        t = time_step(snap, owned, codec, pool, args, dev, nnz_true)
        if t is None:
            return 1
        rows.append(t)
        nnz, nbytes = t["nnz"], t["bytes"]
        log(
            f"  step {step}: nnz {nnz / 1e6:.1f}M, {nbytes / 1e6:.1f} MB ({nbytes / nnz:.2f} B/elem), "
            + " ".join(f"{k}={v:.1f}ms" for k, v in t.items() if k.endswith(("publish", "thread", "threads")))
        )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    log("")
    log(f"# {card}: {args.model} step at {args.density:.1%} (median of {len(rows)} steps), ms")
    log(
        f"{'publish(train thread)':>22} {'pack 1 thread':>14} {'pack ' + str(args.threads) + ' threads':>16} "
        f"{'read-master floor':>18} {'x floor':>8} {'B/elem':>7}"
    )
    log(
        f"{med['publish']:>22.1f} {med['pack_1thread']:>14.1f} {med[f'pack_{args.threads}threads']:>16.1f} "
        f"{read_floor:>18.2f} {med['publish'] / read_floor:>7.1f}x {med['bytes'] / med['nnz']:>7.2f}"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "trainer_gpu.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")
    return 0


def make_master(args, dev: torch.device) -> tuple[dict[str, torch.Tensor], list[Owned], FlatSnapshot]:
    """The fp32 master weights, each within a quarter ULP of its bf16 image, and the detection's snapshot
    of them."""
    _, layout = qwen3_layout(QWEN3[args.model])
    gen = torch.Generator(device=dev).manual_seed(0)
    master, snap = {}, FlatSnapshot(backend=args.backend)
    for name, shape in layout.hf_shapes.items():
        image = torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16).mul_(0.02)
        # fp32 master within a quarter ULP of its bf16 image (bf16 keeps 8 significant bits)
        m = image.float()
        m.mul_(1 + (torch.rand(shape, generator=gen, device=dev) - 0.5) * 2**-10)
        master[name] = m
        del image
    owned = [Owned(n, m.view(-1), tuple(m.shape), 0, m.shape[0] if m.dim() else 1) for n, m in master.items()]
    snap.anchor(owned)
    return master, owned, snap


def floors(args, dev: torch.device, params: int) -> float:
    """The floor: read the fp32 master weights once (and, for detection, the bf16 snapshot too), ms."""
    a = torch.empty(1 << (30 if dev.type == "cuda" else 22), dtype=torch.int32, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(dev)
    bw = 2 * a.numel() * 4 * 10 / (time.perf_counter() - t0)
    del a, b
    read_floor = params * 4 / bw * 1e3
    detect_floor = params * 6 / bw * 1e3
    log(
        f"# {args.model}: {params / 1e9:.2f}B params, fp32 master {params * 4 / 1e9:.1f} GB; copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; floor: read master once {read_floor:.2f} ms, + snapshot {detect_floor:.2f} ms"
    )
    return read_floor


def optimizer_step(master: dict[str, torch.Tensor], step: int, density: float, dev: torch.device) -> int:
    """One optimizer step (not timed): move ~density of the elements by realistic bf16 amounts; the count."""
    nnz_true = 0
    for i, m in enumerate(master.values()):
        g = torch.Generator(device=dev).manual_seed(1000 * step + i)
        flat = m.view(-1)
        pos = random_positions(flat.numel(), density, g, dev)
        old = bit_view(flat[pos].to(torch.bfloat16))
        new = apply_diffs(old, realistic_diffs(pos.numel(), g, dev))
        flat[pos] = new.view(torch.bfloat16).float()
        nnz_true += pos.numel()
    sync(dev)
    return nnz_true


def time_step(snap, owned, codec, pool, args, dev, nnz_true: int) -> dict[str, float] | None:
    """Detection and the codec's device part as the training thread runs them, then pack on one thread
    and on the pool: the times (ms), nnz and bytes; None on a mismatch (logged)."""
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    found = snap.changes(owned)
    batch = codecs.Batch(
        found.positions,
        found.new,
        found.old,
        found.seg,
        found.counts,
        [0] * len(owned),
        [o.numel for o in owned],
    )
    with snap.side_stream(dev):
        split = codec.prepare_batch(batch)
    t["publish"] = (time.perf_counter() - t0) * 1e3  # what the training thread waits for
    sections = {o.name: s for o, s in zip(owned, split.split()) if s is not None}
    t["publish+d2h"] = (time.perf_counter() - t0) * 1e3
    nnz = sum(found.counts)
    del found, batch
    if nnz != nnz_true:
        log(f"MISMATCH: detected {nnz} changes, the step made {nnz_true}")
        return None
    t0 = time.perf_counter()
    packed_1 = [codec.pack(s, torch.bfloat16) for s in sections.values()]
    t["pack_1thread"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    packed_n = list(pool.map(lambda s: codec.pack(s, torch.bfloat16), sections.values()))
    t[f"pack_{args.threads}threads"] = (time.perf_counter() - t0) * 1e3
    nbytes = sum(p[0]["blob"].numel() for p in packed_n)
    same = all(torch.equal(x[0]["blob"], y[0]["blob"]) for x, y in zip(packed_1, packed_n))
    if not same:
        log("MISMATCH: threaded pack differs")
        return None
    t["nnz"], t["bytes"] = nnz, nbytes
    return t


if __name__ == "__main__":
    sys.exit(main())
