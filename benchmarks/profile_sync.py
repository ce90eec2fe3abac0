#!/usr/bin/env python
"""Where one steady sync's time and device memory go (issue 35): publish_gpu.py's W=1 set-up (Qwen3 shapes,
real SGD steps, rank 0's engine), a few syncs to warm up, then one sync each way:

1. cProfile of the training thread's `publish`, of the upload thread's file write (`VersionEncoder._write_delta`,
   profiled on its own thread) and of `ApplyEngine.stage`: the Python functions by cumulative and own time;
2. torch.profiler over the publish-to-visible span and over the staging: the device's busy share of each span
   and its kernels by device time;
3. torch's memory history over the publish-to-visible span: the allocations alive at torch's peak, grouped by
   the innermost frame of this package that made them, beside the peak in torch's counters (allocated and
   reserved) and device-wide (mem_get_info).

    python benchmarks/profile_sync.py [--model qwen3-8b] [--density 0.01] [--rows 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from profile_stage import device_summary  # noqa: E402
from publish_gpu import Config, build_rank, fill_targets  # noqa: E402
from publish_syncs import DeviceMemory, Live  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from vllm_delta.store import DeltaStore  # noqa: E402
from vllm_delta.trainer import DetectOptions, Publisher, PublisherOptions, UploadOptions  # noqa: E402
from vllm_delta.trainer import encode as encode_mod  # noqa: E402


def stats_text(pr: cProfile.Profile, sort: str, rows: int) -> str:
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats(sort).print_stats(rows)
    return "\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-6000:]


def profile_upload_thread(rows: int) -> tuple[dict[str, str], dict[str, bool]]:
    """Patch `VersionEncoder._write_delta` to run under cProfile on the upload thread for the next write
    once armed (`arm["on"] = True`): (the profile's text once written, the arm)."""
    out: dict[str, str] = {}
    orig = encode_mod.VersionEncoder._write_delta
    armed = {"on": False}

    def wrapped(self, job, path):
        if not armed["on"]:
            return orig(self, job, path)
        pr = cProfile.Profile()
        try:
            return pr.runcall(orig, self, job, path)
        finally:
            out["cum"] = stats_text(pr, "cumulative", rows)
            out["tot"] = stats_text(pr, "tottime", rows)
            armed["on"] = False

    encode_mod.VersionEncoder._write_delta = wrapped
    return out, armed


def peak_groups(snapshot: dict, top: int = 20) -> list[str]:
    """Allocations alive at torch's peak (from the memory history), grouped by innermost vllm_delta frame."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}

    def where(e) -> str:
        frames = e.get("frames") or []
        ours = [f for f in frames if "vllm_delta" in f.get("filename", "") or "benchmarks" in f.get("filename", "")]
        f = ours[0] if ours else (frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
        return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"

    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e))
            cur += e["size"]
            if cur > peak:
                peak, peak_live = cur, dict(live)
        elif e["action"] in ("free_completed",):
            got = live.pop(e["addr"], None)
            if got:
                cur -= got[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, w in peak_live.values():
        groups[w][0] += size
        groups[w][1] += 1
    lines = [f"peak of the history's allocations: {peak / 1e6:.0f} MB in {len(peak_live)} blocks"]
    for w, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / 1e6:9.1f} MB  {n:5d} blocks  {w}")
    return lines


class Session:
    """publish_gpu.py's W=1 rank, its Publisher and store, warmed up: one sync at a time."""

    def __init__(self, args: argparse.Namespace):
        root = tempfile.mkdtemp(prefix="profile-sync-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        tempfile.tempdir = root
        self.cfg = Config(
            model=args.model, layers=args.layers, codecs=["chunked"], density=args.density, steps=0, warmup=0,
            world=1, store=os.path.join(root, "store"), threads=min(16, os.cpu_count() or 1), chunk_elems=1 << 28,
            backend=None, smoke=args.smoke,
        )  # fmt: skip
        self.r = build_rank(0, 1, self.cfg)
        self.dev = self.r.dev
        self.cuda = self.dev.type == "cuda"
        self.pub = Publisher(
            self.cfg.store, anchor_every=10**9, codec="chunked",
            options=PublisherOptions(
                detect=DetectOptions(), upload=UploadOptions(queue_size=2, pack_threads=self.cfg.threads)
            ),
        )  # fmt: skip
        self.store = DeltaStore(self.cfg.store)
        self.pub.publish(self.r.module, version=0)
        self.pub.flush()
        for name, p in self.r.module.named_parameters():
            fill_targets(self.r.layout, self.r.targets, name, p.detach().to(torch.bfloat16))
        self.sync()
        self.live = Live(self.r.engine)
        self.v = 1
        for _ in range(args.warm):
            row = self.live.sync(self.pub, self.store, self.r.module, self.step())
            print(f"warm sync v{self.v - 1}: {row['wall']:.1f} ms, checksum ok {row['checksum_ok']}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def step(self) -> int:
        """An optimizer step; the version its publish gets."""
        self.r.step()
        self.sync()
        self.v += 1
        return self.v - 1

    def stage_and_patch(self, v: int, stage=None):
        with self.store.open(v) as vf:
            staged = (stage or self.r.engine.stage)([vf])
            self.r.engine.patch(staged)
        return staged


def part_cprofile(s: Session, rows: int) -> None:
    """1. cProfile: the training thread's publish, the upload thread's write, the staging."""
    up, arm = profile_upload_thread(rows)
    v = s.step()
    arm["on"] = True
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    info = pr.runcall(s.pub.publish, s.r.module, version=v)
    t1 = time.perf_counter()
    info.uploaded.result()
    t2 = time.perf_counter()
    print(f"\n## cProfile, publish ({(t1 - t0) * 1e3:.1f} ms; visible after {(t2 - t0) * 1e3:.1f} ms)")
    print(stats_text(pr, "cumulative", rows))
    print("\n## cProfile, upload thread's _write_delta, cumulative")
    print(up.get("cum", "(not profiled)"))
    print("\n## cProfile, upload thread's _write_delta, own time")
    print(up.get("tot", "(not profiled)"))
    pr = cProfile.Profile()
    staged = s.stage_and_patch(v, lambda files: pr.runcall(s.r.engine.stage, files))
    print(f"\n## cProfile, stage: { {k: round(x, 1) for k, x in staged.timings.items()} }")
    print(stats_text(pr, "cumulative", rows))
    print("\n## cProfile, stage, own time")
    print(stats_text(pr, "tottime", rows))
    s.live.checksum = info.checksum


def part_profiler(s: Session, rows: int, trace: str) -> None:
    """2. torch.profiler: publish -> visible, then the staging (chrome traces into `trace`)."""
    v = s.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        s.pub.publish(s.r.module, version=v).uploaded.result()
        s.sync()
        wall = (time.perf_counter() - t0) * 1e3
    if trace:
        prof.export_chrome_trace(os.path.join(trace, "trace_publish.json"))
    print(f"\n## torch.profiler, publish -> visible ({wall:.1f} ms)")
    print(device_summary(prof, wall))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))
    holder = {}

    def stage(files):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            staged = s.r.engine.stage(files)
        holder["prof"] = p
        return staged

    staged = s.stage_and_patch(v, stage)
    prof = holder["prof"]
    if trace:
        prof.export_chrome_trace(os.path.join(trace, "trace_stage.json"))
    print(f"\n## torch.profiler, stage ({staged.timings['total']:.1f} ms)")
    print(device_summary(prof, staged.timings["total"]))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))


def part_memory(s: Session) -> None:
    """3. memory: torch's history, counters and the device-wide view of one publish -> visible."""
    v = s.step()
    dev = s.dev
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    alloc0, res0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    with DeviceMemory(dev) as mem:
        s.pub.publish(s.r.module, version=v).uploaded.result()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print("\n## memory, publish -> visible, beyond what was in use before")
    print(
        f"torch allocated peak {(torch.cuda.max_memory_allocated(dev) - alloc0) / 1e6:.0f} MB, "
        f"reserved peak {(torch.cuda.max_memory_reserved(dev) - res0) / 1e6:.0f} MB, device-wide {mem.used_mb:.0f} MB"
    )
    print("\n".join(peak_groups(snap)))
    s.stage_and_patch(v)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--trace", default=os.environ.get("OUT", ""), help="chrome traces of part 2 into this folder")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the script's own checks")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.density = "qwen3-tiny", 0.05
    s = Session(args)
    card = torch.cuda.get_device_name(s.dev) if s.cuda else "cpu"
    print(f"# {card}, {args.model}, {s.r.n_params / 1e9:.2f}B params, {args.density:.0%}")
    part_cprofile(s, args.rows)
    if s.cuda:
        part_profiler(s, args.rows, args.trace)
        part_memory(s)
    s.pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
