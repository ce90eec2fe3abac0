"""A follower's poll (`DeltaStore.latest()`) on a store with 10,000 versions: before and after head.json.

Issue 19, item 5: a poll must not list every version. This builds one store of `--versions` versions
(commit records written straight into the folders; the polls never open data files) on each store
kind that runs here: a local directory and S3 (rclone serve s3 on 127.0.0.1, behind the counting
proxy of vllm_delta/testing/proxy.py, which counts the requests and bytes of every poll). Then, in a
fresh process each, a reader makes one first call (a full listing, in both versions of the code) and
`--polls` polls with nothing new, timed one by one:

* **old**: the code of `--old-rev` (default: the commit this work started from), extracted with
  `git archive` and put first on PYTHONPATH: local stores list `versions/` on every poll, S3 lists the
  records after the newest seen (StartAfter) and GETs the newest;
* **new**: this tree: local stores read head.json, the newest record and the next version's record;
  S3 is unchanged (StartAfter needs no head);
* **new, no head**: this tree on a store without head.json (what an older publisher leaves): polled
  as before, listed on every poll locally.

Printed: per row, the first call (the full listing, also what a reader pays at least every 60 s), the
poll's median / p90 / max, and on S3 the requests and response bytes per poll. Saved: JSON and a PNG.
On a shared 2-core machine the times include CPU contention from whatever else runs.

    python benchmarks/poll_latest.py                       # 10,000 versions, 200 polls
    python benchmarks/poll_latest.py --versions 2000 --polls 50 --out /tmp/poll
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ANCHOR_EVERY = 20
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "poll_latest_cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# -- the measuring process (old or new code, whichever is first on sys.path) -------------------------
def measure(uri: str, storage_options: dict, polls: int) -> dict:
    from vllm_delta.store import DeltaStore

    store = DeltaStore(uri, storage_options=storage_options)
    t0 = time.perf_counter()
    first = store.latest()
    first_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(polls):
        t0 = time.perf_counter()
        got = store.latest()
        times.append((time.perf_counter() - t0) * 1e3)
        assert got == first, (got, first)
    return {"latest": first, "first_ms": first_ms, "poll_ms": times}


# -- building the stores ----------------------------------------------------------------------------
def fill(root: str, versions: int, *, head: bool) -> None:
    """`versions` commit records (an anchor every ANCHOR_EVERY, deltas on the version before) and, with
    `head`, the head.json a publisher of this tree leaves. No data files: polls never read them."""
    from vllm_delta.store.records import HEAD_NAME, StoreHead, VersionRecord, data_name, record_name

    os.makedirs(os.path.join(root, "versions"), exist_ok=True)
    checksum = "0" * 16
    for v in range(versions):
        kind = "anchor" if v % ANCHOR_EVERY == 0 else "delta"
        prev, checksum = checksum, secrets.token_hex(8)
        rec = VersionRecord(
            version=v,
            kind=kind,
            base=None if kind == "anchor" else v - 1,
            codec=None if kind == "anchor" else "compact",
            file=f"data/{data_name(v, kind, secrets.token_hex(8))}",
            bytes=1000,
            nnz=10,
            numel=1000,
            checksum=checksum,
            base_checksum=None if kind == "anchor" else prev,
            created=time.time(),
        )
        with open(os.path.join(root, "versions", record_name(v)), "w") as f:
            f.write(rec.to_json())
    if head:
        with open(os.path.join(root, HEAD_NAME), "wb") as f:
            f.write(StoreHead(versions - 1, checksum, time.time()).to_json().encode())


def old_tree(rev: str, dest: str) -> str:
    """The package as of `rev`, extracted into `dest` (a directory to put first on PYTHONPATH)."""
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "vllm_delta"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def run_measure(uri: str, options: dict, polls: int, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", uri, "--storage-options", json.dumps(options)]
    out = subprocess.run([*cmd, "--polls", str(polls)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=10_000)
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--old-rev", default="fce2dab", help="the code before head.json (git revision)")
    ap.add_argument("--out", default=RESULTS, help="output path without extension (.json, .png)")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--storage-options", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, json.loads(args.storage_options), args.polls)))
        return

    from vllm_delta.testing.proxy import S3Proxy
    from vllm_delta.testing.s3 import S3Server

    work = tempfile.mkdtemp(prefix="poll-bench-")
    try:
        old = old_tree(args.old_rev, os.path.join(work, "old"))
        local, local_nohead = os.path.join(work, "local"), os.path.join(work, "local-nohead")
        s3root = os.path.join(work, "s3")
        t0 = time.monotonic()
        fill(local, args.versions, head=True)
        shutil.copytree(local, local_nohead)
        os.remove(os.path.join(local_nohead, "head.json"))
        with S3Server(s3root) as s3:
            fill(os.path.join(s3root, s3.bucket, "poll"), args.versions, head=True)
            fill(os.path.join(s3root, s3.bucket, "poll-nohead"), args.versions, head=False)
            print(f"built 4 stores of {args.versions} versions in {time.monotonic() - t0:.0f} s", flush=True)
            with S3Proxy(s3.endpoint_url) as proxy:
                options = proxy.storage_options(s3.storage_options)
                cases = [
                    ("local", "old", local, {}, old),
                    ("local", "new", local, {}, None),
                    ("local", "new, no head", local_nohead, {}, None),
                    ("s3", "old", s3.uri("poll"), options, old),
                    ("s3", "new", s3.uri("poll"), options, None),
                    ("s3", "new, no head", s3.uri("poll-nohead"), options, None),
                ]
                rows = [measure_case(proxy, case, args.polls, args.versions) for case in cases]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}",
        "versions": args.versions,
        "polls": args.polls,
        "old_rev": args.old_rev,
        "command": " ".join(["python", "benchmarks/poll_latest.py", *sys.argv[1:]]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print_table(rows, meta)
    plot(rows, meta, args.out + ".png")


def measure_case(proxy, case: tuple, polls: int, versions: int) -> dict:
    """One store and code revision: the first call alone (its requests and bytes on the wire), then
    `polls` polls in one process; the row of their latencies."""
    kind, code, uri, opts, path = case
    proxy.counts.reset()
    run_measure(uri, opts, 0, path)  # the first call alone: what it costs on the wire
    first = proxy.counts.snapshot()
    first_requests, first_bytes = proxy.counts.requests(), proxy.counts.bytes_out()
    proxy.counts.reset()
    res = run_measure(uri, opts, polls, path)
    assert res["latest"] == versions - 1, res["latest"]
    times = res["poll_ms"]
    row = {
        "store": kind,
        "code": code,
        "first_ms": res["first_ms"],
        "p50_ms": statistics.median(times),
        "p90_ms": pct(times, 0.9),
        "max_ms": max(times),
        "mean_ms": statistics.fmean(times),
    }
    if kind == "s3":
        row["requests_per_poll"] = (proxy.counts.requests() - first_requests) / polls
        row["bytes_per_poll"] = (proxy.counts.bytes_out() - first_bytes) / polls
        row["first_requests"] = first_requests
        row["first_bytes"] = first_bytes
        row["first_by_kind"] = first["requests"]
    print(json.dumps({k: v for k, v in row.items() if k != "first_by_kind"}), flush=True)
    return row


def print_table(rows: list[dict], meta: dict) -> None:
    print(f"\nDeltaStore.latest() on {meta['versions']} versions, {meta['polls']} polls ({meta['date']})")
    print("| store | code | first call (full listing) ms | poll p50 ms | p90 | max | requests / poll | bytes / poll |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        req = f"{r['requests_per_poll']:.1f}" if "requests_per_poll" in r else "–"
        nbytes = f"{r['bytes_per_poll']:,.0f}" if "bytes_per_poll" in r else "–"
        print(
            f"| {r['store']} | {r['code']} | {r['first_ms']:,.1f} | {r['p50_ms']:.3f} | {r['p90_ms']:.3f} | "
            f"{r['max_ms']:.2f} | {req} | {nbytes} |"
        )


def plot(rows: list[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, store in zip(axes, ("local", "s3")):
        sel = [r for r in rows if r["store"] == store]
        labels = [r["code"] for r in sel]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["p50_ms"] for r in sel], width=0.4, label="poll p50")
        ax.bar([i + 0.2 for i in x], [r["first_ms"] for r in sel], width=0.4, label="first call (full listing)")
        ax.set_yscale("log")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("ms (log)")
        ax.set_title(f"{store}: latest() at {meta['versions']:,} versions")
        for i, r in enumerate(sel):
            ax.annotate(f"{r['p50_ms']:.2f}", (i - 0.2, r["p50_ms"]), ha="center", va="bottom", fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(f"poll cost, old ({meta['old_rev']}) vs new; {meta['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
