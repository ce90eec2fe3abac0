#!/usr/bin/env python
"""Change detection alone (FlatSnapshot.changes): the bitmask path against the chunked paths.

For each size (fp32 master weights: one tensor of 2^28 or 2^30 elements, or a Qwen3 model's HF shapes
such as `qwen3-8b`) and each density, the snapshot is the bf16 image of the weights with the low bit
of that fraction of the elements flipped (distinct uniform positions, flipped again before every
call, untimed), so every call finds exactly those elements. Timed, one after the other on the same
snapshot (median of `--reps` after `--warmup` calls; CUDA events around the whole call, its host
waits included; the host clock on CPU):

  new     the bitmask path (backend "triton", the default on CUDA): `kernels.bitmask_` over all
          tensors, a cumsum and one host wait, `kernels.compact_` (positions, bits, snapshot update,
          checksum partials)
  old     the chunked int8-mask path (backend "triton-chunked"): per 2^28-element chunk `mask_`,
          `nonzero` (a host wait), `gather_image`, the snapshot's `index_copy_`; then the segment
          search, counts and sums over all changes
  torch   the chunked torch path (backend "torch": the image written, compared, `nonzero`)
  k1      `kernels.bitmask_` alone (CUDA events): reads 6 B/elem, writes 1/8 B/elem
  floor   6 B/elem (read fp32 + read the bf16 snapshot) at the copy bandwidth measured in this run

Every path's outputs (positions, tensor index, new and old bits, per-tensor counts and checksum sums)
are checked equal to the bitmask path's, bit for bit, and the found positions equal to the flipped
ones; any mismatch exits nonzero.

    python benchmarks/detect_gpu.py                       # GPU: 2^28, 2^30 at 0.1%, 1%, 3%
    python benchmarks/detect_gpu.py --sizes 2^28,2^30,qwen3-8b --out benchmarks/results
    python benchmarks/detect_gpu.py --smoke               # CPU, tiny sizes (kernels interpreted)

Prints a table last (card, torch and triton versions); writes OUT/detect_gpu_<card>.{log,json,png}
(OUT: --out, else $OUT, else benchmarks/results; the PNG if matplotlib is there; --smoke writes only
with --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

LOG: list[str] = []
PATHS = {"new": "triton", "old": "triton-chunked", "torch": "torch"}  # column -> detection backend


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2^28,2^30", help="comma-separated: 2^k, an integer, or a Qwen3 model name")
    ap.add_argument("--densities", default="0.001,0.01,0.03")
    ap.add_argument("--paths", default="new,old,torch", help="comma-separated, of: new, old, torch")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per path (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else benchmarks/results)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (TRITON_INTERPRET=1); checks only")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
        args.sizes, args.reps, args.warmup = "2^13,9001", 1, 0
        if args.out is None:
            args.out = ""
    elif args.out is None:
        args.out = os.environ.get("OUT") or os.path.join(HERE, "results")
    return args


ARGS = parse_args() if __name__ == "__main__" else None

import torch  # noqa: E402

from vllm_delta.trainer import kernels  # noqa: E402
from vllm_delta.trainer.detect import Detected, FlatSnapshot  # noqa: E402
from vllm_delta.trainer.shard import Owned  # noqa: E402


def shapes_of(size: str) -> dict[str, tuple[int, ...]]:
    if re.fullmatch(r"2\^\d+", size):
        return {"w": (1 << int(size[2:]),)}
    if size.isdigit():
        return {"w": (int(size),)}
    from vllm_delta.testing.apply_fixtures import QWEN3, qwen3_layout

    _, layout = qwen3_layout(QWEN3[size])
    return dict(layout.hf_shapes)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev: torch.device, reps: int, warmup: int, before=None) -> float:
    """Median ms of `fn()` (`before()` untimed ahead of each call): CUDA events on the current
    stream (fn's host waits included), else the host clock."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        sync(dev)
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(dev: torch.device) -> float:
    """GB/s (read + write) of an fp32 clone: 1 GiB on CUDA, 256 KiB on CPU."""
    a = torch.empty((1 << 28) if dev.type == "cuda" else (1 << 16), device=dev).normal_()
    t = time_ms(lambda: a.clone(), dev, 10, 3)
    bw = 2 * a.numel() * 4 / t / 1e6
    log(f"# copy bandwidth: clone of {a.numel() * 4 / 2**10:.0f} KiB fp32 in {t:.3f} ms = {bw:.0f} GB/s (read + write)")
    return bw


class Case:
    """fp32 master weights and a snapshot of their bf16 image (set directly: no anchor, which would
    also copy the image to the host)."""

    def __init__(self, size: str, dev: torch.device):
        self.dev = dev
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self.master = {
            n: torch.empty(s, device=dev).normal_(0, 0.02, generator=self.gen) for n, s in shapes_of(size).items()
        }
        self.owned = [
            Owned(n, m.view(-1), tuple(m.shape), 0, m.shape[0] if m.dim() else 1) for n, m in self.master.items()
        ]
        self.numel = sum(o.count for o in self.owned)
        self.snap = FlatSnapshot(backend="triton")
        self.snap._plan(self.owned)
        self.snap.bits = torch.empty(self.numel, dtype=torch.int16, device=dev)
        for o, off in zip(self.owned, self.snap._offsets):
            self.snap.bits[off : off + o.count].copy_(o.source.to(torch.bfloat16).view(torch.int16))
        self.offsets = torch.tensor(self.snap._offsets, dtype=torch.int64, device=dev)
        self.idx = torch.zeros(0, dtype=torch.int64, device=dev)

    def choose(self, density: float) -> None:
        """Distinct uniform positions (sorted) of about `density` of the elements."""
        k = max(1, round(self.numel * density))
        self.idx = torch.randint(0, self.numel, (k,), generator=self.gen, device=self.dev).unique()

    def perturb(self) -> None:
        """Flip the low bit of the chosen elements' snapshot bits (the snapshot holds the image)."""
        bits = self.snap.bits
        assert bits is not None
        bits.index_put_((self.idx,), bits[self.idx].bitwise_xor(1))

    def use(self, path: str) -> None:
        """Switch the snapshot to a path (its buffers stay)."""
        fresh = FlatSnapshot(backend=PATHS[path])
        self.snap.backend, self.snap.bitmask = fresh.backend, fresh.bitmask

    def run(self) -> Detected:
        return self.snap.changes(self.owned)

    def check(self, got: Detected, ref: Detected | None, path: str) -> None:
        """`got` finds exactly the flipped elements, and equals `ref` bit for bit."""
        flat = self.offsets[got.seg] + got.positions  # every tensor is owned from row 0
        ok = (
            torch.equal(flat, self.idx)
            and torch.equal(got.old, got.new ^ 1)
            and sum(got.counts) == self.idx.numel()
            and got.positions.dtype == torch.int64
            and got.new.dtype == torch.int16
        )
        if ok and ref is not None:
            ok = got.counts == ref.counts and got.sums == ref.sums
            ok = ok and all(torch.equal(getattr(got, f), getattr(ref, f)) for f in ("positions", "seg", "new", "old"))
        if not ok:
            raise SystemExit(f"MISMATCH: the {path} path's outputs differ")


def run_size(size: str, args, dev: torch.device, bw: float) -> list[dict]:
    c = Case(size, dev)
    table = c.snap._detect_table(c.owned, dev)
    log(
        f"\n## {size}: {c.numel} elements in {len(c.owned)} tensors, {table.n_blocks} blocks of "
        f"{table.block}, aligned={table.aligned}"
    )
    paths = args.paths.split(",")
    words = torch.empty(table.n_blocks * table.words_per_block, dtype=torch.int32, device=dev)
    counts = torch.empty(table.n_blocks, dtype=torch.int32, device=dev)
    assert c.snap.bits is not None
    bits = c.snap.bits
    t_k1 = time_ms(lambda: kernels.bitmask_(table, 0, table.n_blocks, bits, words, counts), dev, args.reps, 2)
    rows = []
    for density in map(float, args.densities.split(",")):
        c.choose(density)
        row = {"size": size, "elems": c.numel, "density": density, "changes": c.idx.numel(), "k1": t_k1}
        ref = None
        for path in paths:
            c.use(path)
            c.perturb()
            got = c.run()  # the check (and the first warm-up)
            c.check(got, ref, path)
            if path == "new" and "words" not in c.snap._scratch:
                raise SystemExit("the bitmask path did not run")
            ref = ref or got
            del got
            row[path] = time_ms(c.run, dev, args.reps, args.warmup, before=c.perturb)
        row["floor"] = c.numel * 6 / bw / 1e6
        rows.append(row)
        times = ", ".join(f"{p} {row[p]:.2f} ms" for p in paths)
        log(f"{density:.1%}: {row['changes']} changes; {times}; k1 {t_k1:.2f} ms; floor {row['floor']:.2f} ms")
    return rows


def human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def slug(card: str) -> str:
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", card)
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "_", card)).lower()


def plot(rows: list[dict], paths: list[str], title: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("# matplotlib missing: no PNG")
        return
    series = [*paths, "k1", "floor"]
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(rows)), 4.5))
    width = 0.8 / len(series)
    for i, key in enumerate(series):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label={"k1": "k1 (bitmask_ alone)"}.get(key, key))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['size']}\n{r['density']:.1%}" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms per changes() (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"# wrote {path}")


def main(args: argparse.Namespace) -> int:
    import triton

    if args.smoke:
        dev, card = torch.device("cpu"), "cpu"
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        card = torch.cuda.get_device_name(dev)
    head = (
        f"detect_gpu {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} card={card} "
        f"torch={torch.__version__} triton={triton.__version__} block={kernels.DETECT_BLOCK}"
    )
    log(f"# {head}")
    log(f"# command: python {' '.join(sys.argv)}")
    bw = copy_bandwidth(dev)
    paths = args.paths.split(",")
    if "new" not in paths or any(p not in PATHS for p in paths):
        raise SystemExit(f"--paths: 'new' and any of {', '.join(PATHS)}")
    rows = []
    for size in args.sizes.split(","):
        rows += run_size(size, args, dev, bw)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    log(f"\n# {card}, torch {torch.__version__}, triton {triton.__version__}: ms per changes() (median of {args.reps})")
    log(f"# outputs of every path equal to the bitmask path's, bit for bit; floor: 6 B/elem at {bw:.0f} GB/s")
    cols = [*paths, "k1", "floor"]
    log(
        f"{'size':>9} {'elems':>8} {'density':>7} "
        + " ".join(f"{k:>8}" for k in cols)
        + f" {'old/new':>7} {'new/floor':>9}"
    )
    for r in rows:
        ratio = r["old"] / r["new"] if "old" in r else float("nan")
        log(
            f"{r['size']:>9} {human(r['elems']):>8} {r['density']:>7.1%} "
            + " ".join(f"{r[k]:>8.2f}" for k in cols)
            + f" {ratio:>6.1f}x {r['new'] / r['floor']:>8.1f}x"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"detect_gpu_{slug(card)}")
        with open(base + ".log", "w") as f:
            f.write("\n".join(LOG) + "\n")
        with open(base + ".json", "w") as f:
            json.dump({"head": head, "bandwidth_gbs": bw, "rows": rows}, f, indent=1)
        plot(rows, paths, f"FlatSnapshot.changes, fp32 -> bf16: {head}", base + ".png")
    return 0


if __name__ == "__main__":
    assert ARGS is not None
    sys.exit(main(ARGS))
