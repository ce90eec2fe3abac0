#!/usr/bin/env python
"""Going back one version against going forward one (issue 36): staging and the in-place write, side by side.

On model-shaped parameters (Qwen3-8B by default, vLLM's fused layouts) at one density, two delta files
are written: v1 (on the random base v0) and v2 (on v1). The engine then alternates, on the same file v2:

  back     stage([v2], back_to=v1's header): v2's differences subtracted (old = new - d), then write
  forward  stage([v2]) from v1: the differences added, then write

Each rep times staging (`ApplyEngine.stage` wall, decode to plan) and the write (`ApplyEngine.write`
wall: the fused scatter and the stream sync, what runs inside a server's pause), verifies the staged
partials against the target's header (the per-tensor checksums, as a server does before it writes) and,
on the first and last reps, the whole model bit for bit (torch.equal of every parameter against the
image of the version). The table: p50 and p95 of each, and back / forward. The issue's bar: going back
at 8B 1% costs at most 1.1x a forward update (staging + write).

    python benchmarks/undo_gpu.py --out DIR            # GPU: table, DIR/undo_gpu.{log,json}
    TRITON_INTERPRET=1 python benchmarks/undo_gpu.py --smoke   # CPU, tiny shapes, seconds; nonzero on a mismatch
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from vllm_delta.apply import scatter as S  # noqa: E402
from vllm_delta.apply.engine import ApplyEngine  # noqa: E402
from vllm_delta.bits import bit_view  # noqa: E402
from vllm_delta.checksums import verify_partials  # noqa: E402
from vllm_delta.format import VersionFile  # noqa: E402
from vllm_delta.testing.apply_fixtures import (  # noqa: E402
    QWEN3,
    Qwen3Spec,
    hf_sums,
    model_layout,
    random_changes,
    reference_apply,
    write_delta,
)

LOG: list[str] = []
FAILURES: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def check(ok: bool, what: str) -> None:
    if not ok:
        FAILURES.append(what)
        log(f"  MISMATCH: {what}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(spec: Qwen3Spec, device: torch.device, seed: int = 0):
    """(layout, targets, HF views of the targets): v0, random finite bf16 weights."""
    shapes, layout = model_layout(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    targets = []
    for shape in shapes.values():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)
        targets.append(torch.nan_to_num_(t, nan=0.0, posinf=1.0, neginf=-1.0))
    hf = {}
    for name, segs in layout.segments.items():  # every Qwen3 segment is a contiguous row box
        seg = segs[0]
        n = seg.rows * seg.cols
        hf[name] = targets[seg.target].view(-1)[seg.dst_offset : seg.dst_offset + n].view(layout.hf_shapes[name])
    return layout, targets, hf


def publish_two(layout, targets, hf, density: float, tmpdir: str, pool) -> tuple[list, list]:
    """Write v1 and v2 (each a delta on the one before, chunked codec) by changing the targets in place:
    ([v1 file, v2 file], [bits at v1, bits at v2])."""
    files, images = [], []
    for version in (1, 2):
        changes = random_changes(hf, density, seed=version * 1000 + int(density * 1e6))
        reference_apply(targets, layout, changes)
        path = os.path.join(tmpdir, f"v{version}.safetensors")
        write_delta(
            path,
            version=version,
            base=version - 1,
            codec="chunked",
            shapes=layout.hf_shapes,
            changes=changes,
            sums=hf_sums(hf),
            pool=pool,
        )
        del changes
        files.append(VersionFile(path))
        images.append([bit_view(t).clone() for t in targets])
    return files, images


def timed(fn, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - t0) * 1e3


def one_update(engine: ApplyEngine, stage, current: dict[str, int], header, device: torch.device):
    """Stage, verify the partials against `header` (as a server does; raises on a mismatch), write:
    (staging ms, write ms)."""
    staged, ms_stage = timed(stage, device)
    verify_partials(current, [staged.partials], header)
    _, ms_write = timed(lambda: engine.patch(staged), device)
    return ms_stage, ms_write


def run(spec: Qwen3Spec, density: float, backend: str | None, args, device: torch.device, pool) -> dict:
    layout, targets, hf = build(spec, device)
    with tempfile.TemporaryDirectory(dir=args.tmp or None) as tmpdir:
        (v1, v2), (at1, at2) = publish_two(layout, targets, hf, density, tmpdir, pool)
        sums = {1: _sums(v1.header), 2: _sums(v2.header)}
        engine = ApplyEngine(dict(zip(layout.targets, targets)), layout, device, backend=backend)
        times: dict[str, list[float]] = {k: [] for k in ("back_stage", "back_write", "fwd_stage", "fwd_write")}
        nnz = v2.header.nnz
        steps = {  # (stage, the sums it starts from, the header it leads to, the image it leads to)
            "back": (lambda: engine.stage([v2], back_to=v1.header), sums[2], v1.header, at1),
            "fwd": (lambda: engine.stage([v2]), sums[1], v2.header, at2),
        }
        for rep in range(args.reps + 1):  # rep 0 warms up (kernels, pinned buffers): not counted
            for side, (stage, current, header, image) in steps.items():
                ms_stage, ms_write = one_update(engine, stage, current, header, device)
                if rep in (1, args.reps):
                    exact = all(torch.equal(bit_view(t), b) for t, b in zip(targets, image))
                    check(exact, f"{spec.name} {side}: the weights are not version {header.version}'s")
                if rep:
                    times[f"{side}_stage"].append(ms_stage)
                    times[f"{side}_write"].append(ms_write)
        v1.close()
        v2.close()
    del targets, hf, at1, at2
    if device.type == "cuda":
        torch.cuda.empty_cache()
    row = {"model": spec.name, "density": density, "nnz": nnz, "reps": args.reps, "backend": engine.backend}
    for key, values in times.items():
        row[key] = {"p50": _pct(values, 50), "p95": _pct(values, 95)}
    for side in ("back", "fwd"):
        totals = [s + w for s, w in zip(times[f"{side}_stage"], times[f"{side}_write"])]
        row[f"{side}_total"] = {"p50": _pct(totals, 50), "p95": _pct(totals, 95)}
    row["ratio_p50"] = row["back_total"]["p50"] / row["fwd_total"]["p50"]
    row["ratio_write_p50"] = row["back_write"]["p50"] / row["fwd_write"]["p50"]
    return row


def _sums(header) -> dict[str, int]:
    return {n: int(e.checksum, 16) for n, e in header.tensors.items()}


def _pct(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def report(rows: list[dict]) -> None:
    log("| model | density | changed | backend | what | back p50 | back p95 | fwd p50 | fwd p95 | back / fwd p50 |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for what in ("stage", "write", "total"):
            b, f = r[f"back_{what}"], r[f"fwd_{what}"]
            log(
                f"| {r['model']} | {r['density']:.1%} | {r['nnz']:,} | {r['backend']} | {what} "
                f"| {b['p50']:.2f} ms | {b['p95']:.2f} ms | {f['p50']:.2f} ms | {f['p95']:.2f} ms "
                f"| {b['p50'] / f['p50']:.3f} |"
            )
    log("bit-exact (whole model, first and last rep, both directions): " + ("yes" if not FAILURES else "NO"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1), seconds")
    ap.add_argument("--models", default="qwen3-8b")
    ap.add_argument("--densities", default="0.01")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backends", default="", help="comma list of scatter backends (default: the engine's)")
    ap.add_argument("--tmp", default="", help="where the two version files go (default: the system's temp dir)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        models, densities, args.reps = ["qwen3-tiny"], [0.05], 3
        args.backends = args.backends or ",".join(S.available_backends(device))  # triton under TRITON_INTERPRET=1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        models, densities = args.models.split(","), [float(d) for d in args.densities.split(",")]
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    now = datetime.datetime.now(datetime.timezone.utc)
    log(f"# undo_gpu {now:%Y-%m-%d %H:%M UTC} card={card} torch={torch.__version__}")
    rows = []
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        for name in models:
            for density in densities:
                for backend in args.backends.split(",") if args.backends else [None]:
                    rows.append(run(QWEN3[name], density, backend, args, device, pool))
                    log(json.dumps(rows[-1]))
    report(rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "undo_gpu.json"), "w") as f:
            json.dump({"card": card, "rows": rows, "failures": FAILURES}, f, indent=1)
        with open(os.path.join(args.out, "undo_gpu.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
