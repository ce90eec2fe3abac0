#!/usr/bin/env python
"""Staging per tensor-parallel rank (issue 26 item 1): what each rank decodes of a version, and how long
its staging takes, beside one rank holding the whole model.

One version file (or `--parts W` part files, what W sharded publishers write) of a Qwen3-shaped model
at `--density`, written with the chunked codec (each chunk's first position recorded). Then, for each
TP size: one process per rank, each on its own GPU (`cuda:<rank>`; `--smoke`: the CPU), each with an
ApplyEngine over its rank's layout (`apply_fixtures.tp_layout`: vLLM's split of Qwen3 and Qwen3-MoE),
all staging the version at the same moment (the ranks of a server stage side by side). Per rank:
changed elements decoded (`StagedUpdate.decoded`: the chunks holding its rows; a chunk straddling two
ranks' rows is decoded by both), staging time and its phases. The parameters start at zero (staging
does not depend on their values). Checked: every rank stages exactly the changes its layout holds,
and the ranks' checksum partials add up to the TP=1 engine's.

    python benchmarks/stage_tp.py --out DIR                              # 8B at 1%: TP=1, then TP=2
    python benchmarks/stage_tp.py --models qwen3-30b-a3b --tp 1,2 --out DIR
    python benchmarks/stage_tp.py --parts 2 --out DIR                    # a version of two parts
    TRITON_INTERPRET=1 python benchmarks/stage_tp.py --smoke             # tiny shapes on CPU, checks only
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from vllm_delta.apply.engine import ApplyEngine  # noqa: E402
from vllm_delta.apply.layout import hf_2d  # noqa: E402
from vllm_delta.checksums import MASK64, add_sums  # noqa: E402
from vllm_delta.format import Version, VersionFile  # noqa: E402
from vllm_delta.testing.apply_fixtures import (  # noqa: E402
    QWEN3,
    QWEN3_MOE,
    Qwen3Spec,
    apply_diffs,
    model_layout,
    random_positions,
    realistic_diffs,
    write_delta,
    write_delta_blocks,
    write_delta_parts,
)

PHASES = ("read", "h2d", "inflate", "decode", "translate", "gather", "partials", "plan")


def changes_of(spec, density: float, device, seed: int = 1) -> dict:
    """{HF name: (positions, new bits, old bits)} over zero parameters: uniform positions, realistic diffs."""
    _, layout = model_layout(spec)
    out = {}
    for i, (name, shape) in enumerate(layout.hf_shapes.items()):
        gen = torch.Generator(device=device).manual_seed(seed * 7919 + i)
        numel = hf_2d(shape)[0] * hf_2d(shape)[1]
        pos = random_positions(numel, density, gen, device)
        old = torch.zeros(pos.numel(), dtype=torch.int16, device=device)
        new = apply_diffs(old, realistic_diffs(pos.numel(), gen, device))
        finite = torch.isfinite(new.view(torch.bfloat16))
        out[name] = (pos[finite], new[finite], old[finite])
    return out


def write_version(
    spec, changes: dict, parts: int, tmp: str, chunk_elems: int | None, blocks: bool = False
) -> list[str]:
    """The version's file (or `parts` part files): by rank blocks (what a Publisher writes since issue 35)
    or one stream, every tensor whole (`blocks` False: what it wrote before)."""
    _, layout = model_layout(spec)
    if parts == 1 and not blocks:
        path = os.path.join(tmp, "v1.safetensors")
        write_delta(
            path,
            version=1,
            base=0,
            codec="chunked",
            shapes=layout.hf_shapes,
            changes=changes,
            chunk_elems=chunk_elems,
        )
        return [path]
    new = {}
    for name, shape in layout.hf_shapes.items():
        pos, nb, _ = changes[name]
        flat = torch.zeros(hf_2d(shape)[0] * hf_2d(shape)[1], dtype=torch.int16, device=pos.device)
        flat[pos] = nb
        new[name] = flat.view(torch.bfloat16).reshape(shape)
    paths = [os.path.join(tmp, f"v1-part{k}.safetensors") for k in range(parts)]
    if blocks:
        write_delta_blocks(
            paths, version=1, base=0, new=new, changes=changes, chunk_elems=chunk_elems or 65536, passes=1
        )
    else:
        write_delta_parts(paths, version=1, base=0, new=new, changes=changes, chunk_elems=chunk_elems)
    return paths


def open_version(paths: list[str]):
    files = [VersionFile(p) for p in paths]
    return files[0] if len(files) == 1 else Version(files)


def held_changes(layout, changes: dict) -> int:
    """Changed elements the layout's segments hold (a replicated tensor's on every rank holding it)."""
    total = 0
    for name, segs in layout.segments.items():
        pos = changes[name][0]
        _, cols = hf_2d(layout.hf_shapes[name])
        r, c = pos // cols, pos % cols
        for s in segs:
            total += int(((r >= s.row0) & (r < s.row0 + s.rows) & (c >= s.col0) & (c < s.col0 + s.cols)).sum())
    return total


def stage_rank(job: dict) -> dict:
    """One rank: its layout, zero parameters, `reps` stagings of the version (after `barrier`)."""
    spec, tp, rank, reps = job["spec"], job["tp"], job["rank"], job["reps"]
    torch.set_num_threads(job["torch_threads"])
    dev = torch.device("cuda", rank) if job["cuda"] else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shapes, layout = model_layout(spec, tp, rank)
    targets = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in shapes.items()}
    engine = ApplyEngine(targets, layout, dev)
    vf = open_version(job["paths"])
    staged = engine.stage([vf])  # first: kernels, pinned buffers, nvCOMP
    first_ms = staged.timings["total"]
    del staged
    if job["barrier"] is not None:
        job["barrier"].wait()
    runs = []
    for _ in range(reps):
        staged = engine.stage([vf])
        runs.append(dict(staged.timings))
    out = {
        "tp": tp,
        "rank": rank,
        "decoded": staged.decoded,
        "staged_nnz": staged.nnz,
        "partials": {n: int(v) for n, v in staged.partials.items()},
        "first_ms": first_ms,
        "ms": statistics.median(r["total"] for r in runs),
        "phases": {k: statistics.median(r.get(k, 0.0) for r in runs) for k in PHASES},
        "device_peak_mb": staged.memory["device_peak_bytes"] / 1e6,
        "held": held_changes(layout, job["changes"]) if job["changes"] is not None else None,
    }
    engine.close()
    vf.close()
    return out


class Ranks:
    """One process per rank (spawned once per TP size, reused by every model), and a barrier so that the
    ranks of one TP size stage side by side."""

    def __init__(self, args) -> None:
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.ctx = mp.get_context("spawn")
        self.manager = self.ctx.Manager()
        self.pools: dict[int, ProcessPoolExecutor] = {}

    def run(self, spec, tp: int, paths: list[str], changes: dict | None) -> list[dict]:
        if tp == 1:  # in this process, on GPU 0; its memory goes back before the ranks' processes start
            out = [stage_rank(_job(spec, 1, 0, paths, self.args, self.cuda, None, changes))]
            if self.cuda:
                torch.cuda.empty_cache()
            return out
        if tp not in self.pools:
            self.pools[tp] = ProcessPoolExecutor(tp, mp_context=self.ctx)
        barrier = self.manager.Barrier(tp)
        jobs = [_job(spec, tp, r, paths, self.args, self.cuda, barrier, changes) for r in range(tp)]
        return [f.result() for f in [self.pools[tp].submit(stage_rank, job) for job in jobs]]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()
        self.manager.shutdown()


def _job(spec, tp, rank, paths, args, cuda, barrier, changes) -> dict:
    threads = 1 if args.smoke else max(1, (os.cpu_count() or 2) // tp)
    return {
        "spec": spec,
        "tp": tp,
        "rank": rank,
        "paths": paths,
        "reps": args.reps,
        "cuda": cuda,
        "barrier": barrier,
        "torch_threads": threads,
        "changes": changes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-8b")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes (one GPU per rank)")
    ap.add_argument("--parts", type=int, default=1, help="part files of the version (sharded publishers)")
    ap.add_argument("--chunk-elems", type=int, default=None, help="elements per chunk (default: the writer's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--layout", choices=("blocks", "plain"), default="blocks", help="rank blocks (issue 35) or one stream (before)"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, checks only")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    tps = [int(x) for x in args.tp.split(",")]
    if args.smoke:
        QWEN3["qwen3-smoke"] = Qwen3Spec("qwen3-smoke", 128, 2, 4, 2, 32, 256, 1000, False)
        models, args.density, args.reps, args.chunk_elems = ["qwen3-smoke", "qwen3-moe-tiny"], 0.05, 1, 128
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        if torch.cuda.device_count() < max(tps):
            print(f"TP={max(tps)} needs {max(tps)} GPUs, {torch.cuda.device_count()} here", file=sys.stderr)
            return 2
        models = args.models.split(",")
    card = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    log: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        log.append(line)

    say(
        f"# stage_tp {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} card={card} "
        f"torch={torch.__version__} cpus={os.cpu_count()}"
    )
    say(f"# command: python {' '.join(sys.argv)}")
    results, failures = [], []
    gen_dev = torch.device("cuda", 0) if not args.smoke else torch.device("cpu")
    ranks = Ranks(args)
    for name in models:
        results.append(run_model(name, args, tps, ranks, gen_dev, say, failures))
    ranks.close()
    for f in failures:
        say(f"MISMATCH: {f}")
    say("all checks passed" if not failures else f"FAILED: {len(failures)} checks")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = ("_smoke" if args.smoke else "") + ("" if args.layout == "blocks" else f"_{args.layout}")
        with open(os.path.join(args.out, f"stage_tp{tag}.json"), "w") as f:
            json.dump({"command": " ".join(sys.argv), "log": log, "results": results}, f, indent=1, default=str)
        with open(os.path.join(args.out, f"stage_tp{tag}.log"), "w") as f:
            f.write("\n".join(log) + "\n")
    return 1 if failures else 0


def run_model(name: str, args, tps: list[int], ranks: Ranks, gen_dev: torch.device, say, failures: list[str]) -> dict:
    """One model's version written, then staged at each TP size; the checks' failures into `failures`,
    the table said; the model's result."""
    spec = {**QWEN3, **QWEN3_MOE}[name]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="stage-tp-", dir=shm) as tmp:
        t0 = time.perf_counter()
        changes = changes_of(spec, args.density, gen_dev)
        nnz = sum(int(c[0].numel()) for c in changes.values())
        paths = write_version(spec, changes, args.parts, tmp, args.chunk_elems, args.layout == "blocks")
        size = sum(os.path.getsize(p) for p in paths)
        say(
            f"## {name} at {args.density:.2%}, {args.layout} layout: {nnz / 1e6:.2f}M changed elements, "
            f"{args.parts} file(s) of {size / 1e6:.1f} MB, written in {time.perf_counter() - t0:.1f} s"
        )
        # each rank's held count is checked where the changes are small enough to hand every rank
        check = {n: tuple(t.cpu() for t in c) for n, c in changes.items()} if nnz < 20_000_000 else None
        del changes
        if gen_dev.type == "cuda":
            torch.cuda.empty_cache()
        by_tp = {tp: ranks.run(spec, tp, paths, check) for tp in tps}
    failures += check_ranks(name, by_tp, nnz)
    table(by_tp, nnz, say)
    return {"model": name, "nnz": nnz, "bytes": size, "parts": args.parts, "tp": by_tp}


def check_ranks(name: str, by_tp: dict[int, list[dict]], nnz: int) -> list[str]:
    """Each rank staged what its layout holds; the ranks' checksum partials add up to TP=1's; TP=1
    decoded every changed element."""
    failures = []
    whole = by_tp.get(1)
    ref = whole[0]["partials"] if whole else None
    for tp, group in by_tp.items():
        for r in group:
            if r["held"] is not None and r["staged_nnz"] != r["held"]:
                failures.append(f"{name} TP={tp} rank {r['rank']}: staged {r['staged_nnz']}, holds {r['held']}")
        if ref is not None:
            summed = {n: v & MASK64 for n, v in add_sums([r["partials"] for r in group]).items()}
            if summed != {n: v & MASK64 for n, v in ref.items()}:
                failures.append(f"{name} TP={tp}: the ranks' checksum partials do not add up to TP=1's")
        if tp == 1 and group[0]["decoded"] != nnz:
            failures.append(f"{name} TP=1 decoded {group[0]['decoded']} of {nnz}")
    return failures


def table(by_tp: dict[int, list[dict]], nnz: int, say) -> None:
    say(
        f"{'TP':>3} {'rank':>4} {'decoded':>10} {'share':>6} {'stage':>8} {'first':>8} "
        + " ".join(f"{p:>9}" for p in PHASES)
        + f" {'peak MB':>8}"
    )
    whole = by_tp.get(1)
    base = whole[0]["ms"] if whole else None
    for tp, group in by_tp.items():
        for r in group:
            say(
                f"{tp:>3} {r['rank']:>4} {r['decoded']:>10} {r['decoded'] / max(nnz, 1):>6.3f} {r['ms']:>8.1f} "
                f"{r['first_ms']:>8.1f} "
                + " ".join(f"{r['phases'][p]:>9.1f}" for p in PHASES)
                + f" {r['device_peak_mb']:>8.0f}"
            )
        if tp > 1 and base:
            slowest = max(r["ms"] for r in group)
            share = max(r["decoded"] for r in group) / max(nnz, 1)
            say(
                f"    TP={tp}: largest share {share:.3f} of the changed elements, slowest rank's staging "
                f"{slowest:.1f} ms = {slowest / base:.2f}x TP=1 (issue 26: per rank <= 0.6x)"
            )


if __name__ == "__main__":
    sys.exit(main())
