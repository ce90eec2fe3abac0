#!/usr/bin/env python
"""The codecs on one GPU, old path beside new in one run (issue 17): encode and staging decode of a
whole version, and bytes per changed element.

For each model shape (HF tensors of the exact Qwen3 shapes; positions uniform at `--density`,
~89% of differences one ULP, `realistic_diffs`), all tensors' changes on the GPU as the trainer's
detection gives them (one Batch):

  encode   compact: `prepare_batch` (device) + zstd packing per tensor on 16 threads (the old path);
           chunked: `encode_planes` (device) then nvCOMP on the GPU (only compressed bytes cross to
           the host) or zstandard on 16 threads after a device-to-host copy of the planes (CPU path)
  decode   `staging.Decoder` over the whole file (page cache warm): compact (per-frame zstd on 16
           threads), chunked CPU path (zstandard on 16 threads into pinned memory), chunked GPU
           path (pinned read, one copy, hash check and nvCOMP on the device); phases per path
  B/elem   the payload's bytes per changed element

`--payload FILE` (written by `benchmarks/payload.py --dump FILE`) adds the realistic AdamW deltas of
payload.py: bytes per changed element written by each path. Prints a table last; --out DIR gets
codec_gpu.{log,json}.

    python benchmarks/codec_gpu.py --models qwen3-8b,qwen3-30b-a3b --payload payload_steps.pt --out DIR
    python benchmarks/codec_gpu.py --smoke         # tiny shapes on the CPU: the paths run, bit-exact
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

from vllm_delta import codec as codecs  # noqa: E402
from vllm_delta.apply.layout import DeviceLayout, Layout  # noqa: E402
from vllm_delta.apply.staging import Decoder, changed_items  # noqa: E402
from vllm_delta.codec import chunked  # noqa: E402
from vllm_delta.codec.chunked import gpu  # noqa: E402
from vllm_delta.format import VersionFile  # noqa: E402
from vllm_delta.testing.apply_fixtures import (  # noqa: E402
    QWEN3,
    QWEN3_MOE,
    apply_diffs,
    model_layout,
    random_positions,
    realistic_diffs,
)
from vllm_delta.writer import PreparedTensor, assemble_delta  # noqa: E402

LOG: list[str] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_batch(shapes: dict[str, tuple[int, ...]], density: float, dev: torch.device, seed: int = 0) -> codecs.Batch:
    pos_l, new_l, old_l, counts, numels = [], [], [], [], []
    for i, shape in enumerate(shapes.values()):
        numel = 1
        for d in shape:
            numel *= d
        gen = torch.Generator(device=dev).manual_seed(seed * 7919 + i)
        pos = random_positions(numel, density, gen, dev)
        old = torch.randint(-16000, 16000, (pos.numel(),), generator=gen, device=dev).to(torch.int16)
        new = apply_diffs(old, realistic_diffs(pos.numel(), gen, dev, 2))
        pos_l.append(pos)
        new_l.append(new)
        old_l.append(old)
        counts.append(int(pos.numel()))
        numels.append(numel)
    n = sum(counts)
    return codecs.Batch(
        positions=torch.cat(pos_l),
        new=torch.cat(new_l),
        old=torch.cat(old_l),
        seg=codecs.segment_ids(torch.tensor(counts, device=dev), n),
        counts=counts,
        starts=[0] * len(counts),
        numels=numels,
    )


def timed(fn, dev, reps=3):
    """(median ms of `reps` runs after one warm-up, last result)."""
    out = fn()
    sync(dev)
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        ms.append((time.perf_counter() - t0) * 1e3)
    return (statistics.median(ms) if ms else float("nan")), out


def encode(codec_name: str, batch, shapes, pool, path: str, dev, reps: int):
    """(ms of the device part, ms of the packing, header, payload) for one codec and path."""
    saved = os.environ.get(gpu.PATH_ENV)
    os.environ[gpu.PATH_ENV] = "cpu" if path == "cpu" else "auto"
    try:
        c = codecs.get_codec(codec_name)
        prep_ms, prepared = timed(lambda: c.prepare_batch(batch), dev, reps)
        names = list(shapes)

        def pack():
            sections = prepared.split()
            tensors = {
                n: PreparedTensor(tuple(shapes[n]), torch.bfloat16, 0, cnt, s)
                for n, cnt, s in zip(names, batch.counts, sections)
            }
            return assemble_delta(
                version=1, base=0, base_checksum="0" * 16, codec=c, tensors=tensors, pool=pool, checksum="0" * 16
            )

        pack_ms, (header, payload) = timed(pack, dev, reps)
        return prep_ms, pack_ms, header, payload
    finally:
        if saved is None:
            os.environ.pop(gpu.PATH_ENV, None)
        else:
            os.environ[gpu.PATH_ENV] = saved


def decode(path: str, file: str, shapes, dev, reps: int, check=None):
    """(median total ms, median phases, decoded elements) of staging.Decoder over the whole file."""
    saved = os.environ.get(gpu.PATH_ENV)
    os.environ[gpu.PATH_ENV] = "cpu" if path == "cpu" else "auto"
    try:
        vf = VersionFile(file)
        dl = DeviceLayout(Layout.identity(shapes), dev)
        dec = Decoder(dev, threads=min(16, os.cpu_count() or 1))
        runs = []
        n = 0
        for r in range(reps + 1):
            timings: dict[str, float] = {}
            n = 0
            t0 = time.perf_counter()
            for width, items in changed_items(vf, dl).items():
                for chunk in dec.decode(1, vf.header.codec or "", items, width, timings):
                    n += chunk.n
                    if check is not None and r == 0:
                        check(chunk)
            sync(dev)
            timings["total"] = (time.perf_counter() - t0) * 1e3
            if r:
                runs.append(timings)
        dec.close()
        vf.close()
        phases = {k: statistics.median(t.get(k, 0.0) for t in runs) for k in runs[0]}
        return phases["total"], phases, n
    finally:
        if saved is None:
            os.environ.pop(gpu.PATH_ENV, None)
        else:
            os.environ[gpu.PATH_ENV] = saved


def payload_sizes(path: str, dev, pool) -> dict[str, float]:
    """Bytes per changed element of payload.py's AdamW steps (`--dump` file), per codec and path."""
    sys.path.insert(0, HERE)
    from payload import load_steps

    steps = load_steps(path)
    total: dict[str, float] = {"nnz": 0}
    for step in steps:
        batch = codecs.Batch(
            positions=step["positions"].to(dev, torch.int64),
            new=step["new"].to(dev),
            old=step["old"].to(dev),
            seg=step["seg"].to(dev, torch.int64),
            counts=step["counts"],
            starts=[0] * len(step["counts"]),
            numels=step["numels"],
        )
        shapes = {f"t{i}": (n,) for i, n in enumerate(step["numels"])}
        total["nnz"] += int(batch.positions.numel())
        for name, codec_name, p in (
            ("compact", "compact", "cpu"),
            ("chunked/cpu", "chunked", "cpu"),
            ("chunked/gpu", "chunked", "gpu"),
        ):
            if p == "gpu" and dev.type != "cuda":
                continue
            _, _, _, payload = encode(codec_name, batch, shapes, pool, p, dev, 0)
            total[name] = total.get(name, 0) + sum(t.numel() * t.element_size() for t in payload.values())
    return {k: v / total["nnz"] for k, v in total.items() if k != "nnz"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--payload", default=None, help="payload.py --dump file (realistic AdamW deltas)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    if args.smoke:
        dev = torch.device("cpu")
        models, args.reps = ["qwen3-tiny", "qwen3-moe-tiny"], 1
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        dev = torch.device("cuda", torch.cuda.current_device())
        models = args.models.split(",")
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    be, why = gpu.backend(dev) if dev.type == "cuda" else (None, "cpu")
    log(
        f"# codec_gpu {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} card={card} "
        f"torch={torch.__version__} cpus={os.cpu_count()} nvCOMP={be.version if be else 'no (' + why + ')'}"
    )
    log(f"# command: python {' '.join(sys.argv)}")
    pool = ThreadPoolExecutor(min(16, os.cpu_count() or 1))
    rows: list[dict] = []
    for name in models:
        rows += run_model(name, args, dev, be is not None, pool)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    sizes = payload_sizes(args.payload, dev, pool) if args.payload else {}
    if sizes:
        log(
            "## payload.py deltas (AdamW, 6 steps): "
            + "  ".join(f"{k} {v:.3f}" for k, v in sizes.items())
            + " B/changed elem"
        )
    table(rows, card, args)
    pool.shutdown()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "codec_gpu.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")
        with open(os.path.join(args.out, "codec_gpu.json"), "w") as f:
            json.dump({"rows": rows, "payload": sizes}, f, indent=1, default=str)
    _ = chunked
    return 0


def run_model(name: str, args, dev, nvcomp: bool, pool) -> list[dict]:
    """One model's version encoded by each codec and path, each file decoded by each reader: the rows."""
    from vllm_delta.format import write

    spec = {**QWEN3, **QWEN3_MOE}[name]
    _, layout = model_layout(spec)
    shapes = dict(layout.hf_shapes)
    t0 = time.perf_counter()
    batch = make_batch(shapes, args.density if not args.smoke else 0.05, dev)
    sync(dev)
    nnz = int(batch.positions.numel())
    log(f"## {name}: {len(shapes)} tensors, {nnz / 1e6:.1f}M changes (made in {time.perf_counter() - t0:.1f}s)")
    paths = [("compact", "compact", "cpu"), ("chunked", "chunked", "cpu")]
    if nvcomp:
        paths.append(("chunked", "chunked", "gpu"))
    rows = []
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        files = {}
        for codec_name, _, p in paths:
            prep_ms, pack_ms, header, payload = encode(codec_name, batch, shapes, pool, p, dev, args.reps)
            f = os.path.join(tmp, f"{codec_name}-{p}.safetensors")
            write(f, header, payload)
            files[(codec_name, p)] = f
            nbytes = sum(t.numel() * t.element_size() for t in payload.values())
            row = {"model": name, "codec": codec_name, "path": p, "nnz": nnz, "prepare_ms": prep_ms, "pack_ms": pack_ms}
            row["bytes"] = nbytes
            row["b_per_elem"] = nbytes / nnz
            rows.append(row)
            log(
                f"  encode {codec_name:8s} {p}: device {prep_ms:.1f} ms, pack {pack_ms:.1f} ms, "
                f"{nbytes / nnz:.3f} B/elem"
            )
        want = sum(batch.counts)
        for (codec_name, wpath), f in files.items():
            readers = ["cpu"] if codec_name == "compact" else (["cpu", "gpu"] if nvcomp else ["cpu"])
            for rp in readers:
                total, phases, n = decode(rp, f, shapes, dev, args.reps)
                assert n == want, (codec_name, rp, n)
                row = {"model": name, "codec": codec_name, "writer": wpath, "reader": rp, "decode_ms": total}
                rows.append({**row, "phases": phases})
                log(
                    f"  decode {codec_name:8s} written {wpath} read {rp}: {total:.1f} ms ("
                    + " ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "total")
                    + ")"
                )
    del batch
    return rows


def table(rows: list[dict], card: str, args) -> None:
    log("")
    log(f"# {card}: ms (median of {args.reps}), density {args.density:.1%}")
    log(f"{'model':>14} {'codec':>8} {'path':>5} {'device':>8} {'pack':>8} {'B/elem':>7} | decode cpu / gpu")
    for r in rows:
        if "prepare_ms" not in r:
            continue
        dec = {
            x["reader"]: x["decode_ms"]
            for x in rows
            if x.get("writer") == r["path"] and x["codec"] == r["codec"] and x["model"] == r["model"]
        }
        log(
            f"{r['model']:>14} {r['codec']:>8} {r['path']:>5} {r['prepare_ms']:>8.1f} {r['pack_ms']:>8.1f} "
            f"{r['b_per_elem']:>7.3f} | " + " / ".join(f"{dec[k]:.1f}" for k in ("cpu", "gpu") if k in dec)
        )


if __name__ == "__main__":
    sys.exit(main())
