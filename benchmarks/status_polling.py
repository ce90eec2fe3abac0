"""What polling GET /v1/delta/status costs the streams of a vLLM server (issue 19).

N streaming completions run the whole time (ignore_eos, 48 tokens, restarted when they end) while the
benchmark rotates through three phases of equal length, several rounds, side by side on one server:

  none     nobody asks for status
  status   GET /v1/delta/status every `--period` s (0.5): answered by the API process from what it keeps
           current, no call into the workers
  verify   GET /v1/delta/status?verify=true every `--period` s: the live checksum recomputed from every
           rank's parameters (one worker call and a pass over the weights: what every status cost before
           issue 19)

Per phase: the intervals between consecutive streamed chunks of one request (the wait between two
requests of a stream is not counted), their p50 / p90 / p99 / max, the tokens per second all streams
received, and the status calls' own latency. Rounds alternate the phases so that drift (other jobs on
a shared machine) spreads over all three. On a CPU machine every number measures contention too.

    python benchmarks/status_polling.py                     # generate a model, start a server
    python benchmarks/status_polling.py --size tiny --phase-s 5 --rounds 2
    python benchmarks/status_polling.py --url http://127.0.0.1:8000 [--api-key K]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time

import requests

from vllm_delta.testing.client import StreamingClient

PHASES = ("none", "status", "verify")
PATHS = {"status": "/v1/delta/status", "verify": "/v1/delta/status?verify=true"}
PROMPTS = ("once upon a time", "the red cat and the blue dog", "one two three four", "hello my friend")
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=500),
    "small": dict(hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8, num_kv_heads=2, vocab_size=4096),
}


def _pick(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def _poll(base_url: str, path: str, period: float, headers: dict, stop: threading.Event, out: list) -> None:
    """GET `path` every `period` s until `stop`; (start, ms, status code) of each call into `out`."""
    nxt = time.perf_counter()
    while not stop.is_set():
        t0 = time.perf_counter()
        r = requests.get(base_url + path, headers=headers, timeout=120)
        out.append((t0, (time.perf_counter() - t0) * 1e3, r.status_code))
        nxt += period
        stop.wait(max(0.0, nxt - time.perf_counter()))


def measure(
    base_url: str,
    model: str,
    *,
    api_key: str | None = None,
    streams: int = 4,
    phase_s: float = 20.0,
    rounds: int = 3,
    period: float = 0.5,
) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    clients = [
        StreamingClient(base_url, model, headers=headers, prompt=PROMPTS[i % len(PROMPTS)]) for i in range(streams)
    ]
    for c in clients:
        c.start()
    windows: list[tuple[str, float, float]] = []
    calls: dict[str, list] = {p: [] for p in PHASES}
    try:
        for c in clients:
            c.wait_for_chunks(20)
        for r in range(rounds):
            order = PHASES[r % len(PHASES) :] + PHASES[: r % len(PHASES)]  # rotate: no phase always first
            for phase in order:
                stop = threading.Event()
                poller = None
                if phase in PATHS:
                    poller = threading.Thread(
                        target=_poll, args=(base_url, PATHS[phase], period, headers, stop, calls[phase])
                    )
                t0 = time.perf_counter()
                if poller is not None:
                    poller.start()
                time.sleep(phase_s)
                stop.set()
                if poller is not None:
                    poller.join(120)
                windows.append((phase, t0, time.perf_counter()))
                print(f"  round {r + 1}/{rounds} {phase:6s} done", flush=True)
    finally:
        for c in clients:
            c.stop()
    rows = []
    for phase in PHASES:
        spans = [(t0, t1) for p, t0, t1 in windows if p == phase]
        gaps = sorted(
            (b - a) * 1e3
            for c in clients
            for i, (a, b) in enumerate(zip(c.arrivals, c.arrivals[1:]))
            if i + 1 not in c.firsts and any(t0 <= a and b <= t1 for t0, t1 in spans)
        )
        seconds = sum(t1 - t0 for t0, t1 in spans)
        tokens = sum(c.tokens_between(t0, t1) for c in clients for t0, t1 in spans)
        call_ms = sorted(ms for _, ms, _ in calls.get(phase, []))
        bad = sum(1 for *_, code in calls.get(phase, []) if code != 200)
        rows.append(
            {
                "phase": phase,
                "seconds": round(seconds, 1),
                "intervals": len(gaps),
                "p50_ms": _pick(gaps, 0.5),
                "p90_ms": _pick(gaps, 0.9),
                "p99_ms": _pick(gaps, 0.99),
                "max_ms": round(gaps[-1], 2) if gaps else None,
                "tok_s": round(tokens / seconds, 1) if seconds else None,
                "status_calls": len(call_ms),
                "status_p50_ms": _pick(call_ms, 0.5),
                "status_p99_ms": _pick(call_ms, 0.99),
                "status_errors": bad,
                "gaps_ms": gaps,
            }
        )
    return {
        "streams": streams,
        "phase_s": phase_s,
        "rounds": rounds,
        "period_s": period,
        "rows": rows,
        "stream_errors": [e for c in clients for e in c.errors],
    }


def table(result: dict) -> str:
    lines = [
        f"{result['streams']} streams; {result['rounds']} rounds x {result['phase_s']:g} s per phase; "
        f"status every {result['period_s']:g} s",
        "",
        "| phase | chunk intervals | p50 ms | p90 ms | p99 ms | max ms | tok/s | status calls "
        "| status p50 ms | status p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['phase']} | {r['intervals']} | {r['p50_ms']} | {r['p90_ms']} | {r['p99_ms']} | {r['max_ms']} "
            f"| {r['tok_s']} | {r['status_calls']} | {r['status_p50_ms'] or '-'} | {r['status_p99_ms'] or '-'} |"
        )
    return "\n".join(lines)


def save_png(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for r in result["rows"]:
        gaps = r["gaps_ms"]
        if gaps:
            ax.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=r["phase"])
    ax.set_xscale("log")
    ax.set_xlabel("interval between streamed chunks of one request (ms)")
    ax.set_ylabel("fraction of intervals")
    ax.legend(fontsize=8)
    ax.set_title("chunk intervals by phase (CDF)", fontsize=9)
    names = [r["phase"] for r in result["rows"]]
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
        bx.bar(
            [i + (0.2 if key == "p99_ms" else -0.2) for i in range(len(names))],
            [r[key] or 0 for r in result["rows"]],
            width=0.4,
            label=label,
        )
    bx.set_xticks(range(len(names)), names)
    bx.set_ylabel("chunk interval (ms)")
    bx.legend(fontsize=8)
    bx.set_title(f"{result['streams']} streams; status polled every {result['period_s']:g} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def spawn_and_measure(size: str, workdir: str, **kw) -> dict:
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.runs import publish_run
    from vllm_delta.testing.server import VllmServer

    run = publish_run(os.path.join(workdir, "run"), TinyModelSpec(arch="llama", **SIZES[size]), steps=1, seed=3)
    srv = VllmServer(run.model_dir, store=run.store, version=1, max_model_len=512, startup_timeout=900)
    with srv:
        result = measure(srv.base_url, run.model_dir, **kw)
        status = srv.status()
    if status["checksum"] != run.checksums[1]:
        raise AssertionError(f"server checksum {status['checksum']} != trainer's {run.checksums[1]}")
    result["size"] = size
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server with the plugin")
    ap.add_argument("--model", help="the server's model name (default: asked from /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--period", type=float, default=0.5, help="seconds between status calls")
    ap.add_argument("--json", help="write the raw result here")
    ap.add_argument("--png", default="status_polling.png")
    args = ap.parse_args(argv)
    kw = dict(streams=args.streams, phase_s=args.phase_s, rounds=args.rounds, period=args.period)
    t0 = time.time()
    if args.url:
        model = args.model
        if model is None:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = requests.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        result = measure(args.url, model, api_key=args.api_key, **kw)
    else:
        with tempfile.TemporaryDirectory(prefix="status-polling-") as workdir:
            result = spawn_and_measure(args.size, workdir, **kw)
    result["machine"] = f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result["command"] = " ".join([os.path.basename(sys.executable)] + sys.argv)
    result["wall_s"] = round(time.time() - t0, 1)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        save_png(result, args.png)
    return 1 if result["stream_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
