"""What streaming clients see while a vLLM server takes a weight update.

N streaming completions run the whole time (ignore_eos, 48 tokens, restarted when they end). Updates
are applied one after another, cycling through five kinds, side by side on one server in one run:

  delta     POST /v1/delta/update_weights {"version": N, "mode": "keep"}    (pause, our in-place
            scatter, prefix-cache reset: the frozen requests are preempted and recompute their KV)
  inflight  POST /v1/delta/update_weights {"version": N, "mode": "inflight"} (no pause: one engine-core
            call between two steps; running requests keep their KV, nothing is preempted)
  vllm      POST /v1/delta/update_weights {"version": N, "method": "vllm"}  (the same staged update
            written through vLLM's own load_checkpoint_weight_patches inside the pause)
  reset     POST /pause?mode=keep&clear_cache=true, POST /resume              (vLLM's dev routes: no
            update, but the same prefix-cache reset a keep-mode update does)
  pause     POST /pause?mode=keep&clear_cache=false, POST /resume             (the scheduling floor)

Every update is staged first (POST /v1/delta/stage, then a pause of `settle` seconds): on this 2-core
CPU machine staging competes with the forward passes for the cores (on a GPU it runs on a side
stream), so the window measured is the update call itself, which reuses the staged update.

For each update: the largest gap between two streamed chunks of one request, over all streams, that
overlaps the update request (next to the chunk intervals outside updates; the wait between two
requests of a stream is not counted), the tokens per second all streams received from the
request's start to 0.5 s after its end, the requests preempted (vLLM's /metrics), and the server's own
pause_ms / apply_ms / stage_ms. Per kind: the median / p99 / max of those gaps.

    python benchmarks/pause_latency.py                    # generate a model + run, start a server
    python benchmarks/pause_latency.py --size tiny --repeats 3
    python benchmarks/pause_latency.py --url http://127.0.0.1:8000 --versions 7,8,9,10 [--api-key K]
      (a running server started with VLLM_SERVER_DEV_MODE=1; versions must follow the served one)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import requests

from vllm_delta.testing.client import StreamingClient, metric_total

KINDS = ("delta", "inflight", "vllm", "reset", "pause")
UPDATES = {"delta": {"mode": "keep"}, "inflight": {"mode": "inflight"}, "vllm": {"mode": "keep", "method": "vllm"}}
SIZES = {
    # ~0.4 M parameters: CI-sized.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=500),
    # ~30 M parameters: a forward pass long enough on CPU for the apply to be small next to it.
    "small": dict(hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8, num_kv_heads=2, vocab_size=4096),
}
PROMPTS = ("once upon a time", "the red cat and the blue dog", "one two three four", "hello my friend")
AFTER_S = 0.5  # tokens per second are counted until this long after the update returns
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass
class Sample:
    kind: str
    version: int | None
    t0: float
    t1: float
    server: dict
    preempted: float
    stage_ms: float | None = None


def _pick(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile."""
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def measure(
    base_url: str,
    model: str,
    versions: list[int],
    *,
    api_key: str | None = None,
    settle: float = 1.0,
    streams: int = 4,
    kinds: tuple[str, ...] = KINDS,
):
    """Cycle through `kinds` over `versions` (delta, inflight and vllm each consume one version)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def post(path: str, body: dict | None = None, timeout: float = 300) -> dict:
        r = requests.post(base_url + path, json=body, headers=headers, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{path} {body} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def preemptions() -> float:
        return metric_total(requests.get(base_url + "/metrics", headers=headers, timeout=30).text, PREEMPTIONS)

    clients = [
        StreamingClient(base_url, model, headers=headers, prompt=PROMPTS[i % len(PROMPTS)]) for i in range(streams)
    ]
    for c in clients:
        c.start()
    samples: list[Sample] = []
    try:
        for c in clients:
            c.wait_for_chunks(20)
        todo = list(versions)
        while todo:
            for kind in kinds:
                if kind in UPDATES and not todo:
                    break
                time.sleep(settle)
                samples.append(_sample(kind, todo, post, preemptions, settle))
        time.sleep(settle)
    finally:
        for c in clients:
            c.stop()
    return _result(samples, clients, streams)


def _sample(kind: str, todo: list[int], post, preemptions, settle: float) -> Sample:
    """One update of `kind` (staged first, then applied: the update must reuse what was staged; the next
    version taken from `todo`) or one pause and resume of vLLM's own, timed, and the preemptions it caused."""
    stage_ms = None
    if kind in UPDATES:
        v = todo.pop(0)
        staged = post("/v1/delta/stage", {"version": v, "method": UPDATES[kind].get("method", "delta")})
        stage_ms = staged.get("stage_ms")
        time.sleep(settle)
    before = preemptions()
    t0 = time.perf_counter()
    if kind in UPDATES:
        server = post("/v1/delta/update_weights", {"version": v, **UPDATES[kind]})
        t1 = time.perf_counter()
        if not server.get("prefetched"):
            raise RuntimeError(f"update to {v} did not reuse its staged update: {server}")
    else:
        clear = "true" if kind == "reset" else "false"
        try:
            post(f"/pause?mode=keep&clear_cache={clear}", timeout=60)
            post("/resume", timeout=60)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: start the server with VLLM_SERVER_DEV_MODE=1") from None
        t1 = time.perf_counter()
        v, server = None, {}
    time.sleep(AFTER_S)
    return Sample(kind, v, t0, t1, server, preemptions() - before, stage_ms)


def _result(samples: list[Sample], clients: list[StreamingClient], streams: int) -> dict:
    """What the streams saw: each sample's gap, token rate and server timings, and the steady gaps outside
    the samples' windows."""
    windows = [(s.t0, s.t1 + AFTER_S) for s in samples]
    steady = sorted(g for c in clients for g in c.steady_gaps_ms(windows))
    start = min(c.arrivals[0] for c in clients)
    end = max(c.arrivals[-1] for c in clients)
    outside = (end - start) - sum(t1 - t0 for t0, t1 in windows)
    tokens_outside = sum(c.tokens_between(start, end) for c in clients) - sum(
        c.tokens_between(t0, t1) for c in clients for t0, t1 in windows
    )
    rows = []
    for s in samples:
        w0, w1 = s.t0, s.t1 + AFTER_S
        rows.append(
            {
                "kind": s.kind,
                "version": s.version,
                "client_gap_ms": round(max(c.max_gap_ms(s.t0, s.t1) for c in clients), 2),
                "tok_s": round(sum(c.tokens_between(w0, w1) for c in clients) / (w1 - w0), 1),
                "preempted": s.preempted,
                "request_ms": round((s.t1 - s.t0) * 1e3, 2),
                "pause_ms": s.server.get("pause_ms"),
                "apply_ms": s.server.get("apply_ms"),
                "stage_ms": s.stage_ms,
                "nnz": s.server.get("nnz"),
            }
        )
    return {
        "streams": streams,
        "steady_gaps_ms": {
            "n": len(steady),
            **{k: _pick(steady, q) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "max": round(steady[-1], 2) if steady else None,
        },
        "steady_tok_s": round(tokens_outside / outside, 1) if outside > 0 else None,
        "rows": rows,
        "stream_errors": [e for c in clients for e in c.errors],
    }


def summarize(result: dict) -> list[dict]:
    out = []
    for kind in KINDS:
        rows = [r for r in result["rows"] if r["kind"] == kind]
        if not rows:
            continue

        def med(key, rows=rows):
            vals = [r[key] for r in rows if r[key] is not None]
            return round(statistics.median(vals), 2) if vals else None

        gaps = [r["client_gap_ms"] for r in rows]
        out.append(
            {
                "kind": kind,
                "n": len(rows),
                "client_gap_ms": med("client_gap_ms"),
                "p99_client_gap_ms": _pick(gaps, 0.99),
                "max_client_gap_ms": max(gaps),
                "tok_s": med("tok_s"),
                "preempted": sum(r["preempted"] for r in rows),
                "request_ms": med("request_ms"),
                "pause_ms": med("pause_ms"),
                "apply_ms": med("apply_ms"),
                "stage_ms": med("stage_ms"),
                "nnz": med("nnz"),
            }
        )
    return out


def verdict(result: dict, summary: list[dict]) -> dict:
    """Issue 12's target: in-flight client gap (median) within 1.5x the p99 chunk interval outside
    updates, and no request preempted."""
    row = next((r for r in summary if r["kind"] == "inflight"), None)
    p99 = result["steady_gaps_ms"].get("p99")
    if row is None or not p99:
        return {}
    ratio = round(row["client_gap_ms"] / p99, 2)
    return {"inflight_gap_over_p99": ratio, "met": ratio <= 1.5 and row["preempted"] == 0}


def print_table(result: dict, summary: list[dict]) -> None:
    print(f"streams: {result['streams']}; chunk intervals outside updates (ms): {result['steady_gaps_ms']}")
    print(f"tokens per second outside updates: {result['steady_tok_s']}")
    cols = list(summary[0]) if summary else []
    print(" | ".join(f"{c:>17}" for c in cols))
    for row in summary:
        print(" | ".join(f"{str(row[c]):>17}" for c in cols))
    if result.get("verdict"):
        print(f"target (in-flight gap <= 1.5x p99, no preemption): {result['verdict']}")


def save_png(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    kinds = [k for k in KINDS if any(r["kind"] == k for r in result["rows"])]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax.boxplot([[r["client_gap_ms"] for r in result["rows"] if r["kind"] == k] for k in kinds], tick_labels=kinds)
    p99 = result["steady_gaps_ms"].get("p99")
    if p99:
        ax.axhline(p99, ls="--", c="gray", label="p99 chunk interval outside updates")
        ax.axhline(1.5 * p99, ls=":", c="red", label="1.5 x p99 (in-flight target)")
    ax.set_ylabel("largest client gap during the update (ms)")
    ax.legend(fontsize=8)
    bx.boxplot([[r["tok_s"] for r in result["rows"] if r["kind"] == k] for k in kinds], tick_labels=kinds)
    if result.get("steady_tok_s"):
        bx.axhline(result["steady_tok_s"], ls="--", c="gray", label="outside updates")
        bx.legend(fontsize=8)
    bx.set_ylabel(f"tokens/s, {result['streams']} streams, update + {AFTER_S} s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def published(size: str, steps: int, workdir: str):
    """The benchmark's run: published into `workdir`, or reused from there (run.json)."""
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.runs import PublishedRun, publish_run

    spec = TinyModelSpec(arch="llama", **SIZES[size])
    root, meta = os.path.join(workdir, "run"), os.path.join(workdir, "run.json")
    if os.path.exists(meta):
        with open(meta) as f:
            saved = json.load(f)
        if saved["size"] == size and len(saved["checksums"]) > steps:
            run = PublishedRun(root, os.path.join(root, "model"), os.path.join(root, "store"), spec)
            run.checksums = {int(k): v for k, v in saved["checksums"].items()}
            run.nnz = {int(k): v for k, v in saved["nnz"].items()}
            print(f"reusing {len(run.versions)} versions of a {size} model from {workdir}")
            return run
    t0 = time.time()
    run = publish_run(root, spec, steps=steps, anchor_every=10**6, lr=1e-6, seed=3)
    print(f"published {len(run.versions)} versions of a {size} model in {time.time() - t0:.0f} s")
    with open(meta, "w") as f:
        json.dump({"size": size, "checksums": run.checksums, "nnz": run.nnz}, f)
    return run


def spawn_and_measure(size: str, repeats: int, workdir: str, streams: int) -> dict:
    from vllm_delta.testing.server import VllmServer

    updates = sum(1 for k in KINDS if k in UPDATES)
    run = published(size, updates * repeats, workdir)
    versions = run.versions[1 : 1 + updates * repeats]
    print(f"density {statistics.median(run.nnz[v] for v in versions) / run.nnz[0]:.2%}")
    srv = VllmServer(run.model_dir, store=run.store, version=0, dev_mode=True, max_model_len=512, startup_timeout=900)
    with srv:
        result = measure(srv.base_url, run.model_dir, versions, streams=streams)
        status = srv.status()
    if status["checksum"] != run.checksums[versions[-1]]:
        raise AssertionError(f"server checksum {status['checksum']} != trainer's {run.checksums[versions[-1]]}")
    result["size"] = size
    result["params"] = run.nnz[0]
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (started with VLLM_SERVER_DEV_MODE=1)")
    ap.add_argument("--model", help="the server's model name (default: asked from /v1/models)")
    ap.add_argument("--api-key")
    ap.add_argument("--versions", help="comma-separated versions to apply, in order (with --url)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--repeats", type=int, default=5, help="updates of each kind (without --url)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streaming clients")
    ap.add_argument("--workdir", help="keep the published run here and reuse it on the next run")
    ap.add_argument("--json", help="write the raw result here")
    ap.add_argument("--png", default="pause_latency.png")
    args = ap.parse_args(argv)
    if args.url:
        if not args.versions:
            ap.error("--url needs --versions")
        model = args.model
        if model is None:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = requests.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        versions = [int(v) for v in args.versions.split(",")]
        result = measure(args.url, model, versions, api_key=args.api_key, streams=args.streams)
    else:
        if args.workdir:
            os.makedirs(args.workdir, exist_ok=True)
            result = spawn_and_measure(args.size, args.repeats, args.workdir, args.streams)
        else:
            with tempfile.TemporaryDirectory(prefix="pause-latency-") as workdir:
                result = spawn_and_measure(args.size, args.repeats, workdir, args.streams)
    summary = summarize(result)
    result["summary"] = summary
    result["verdict"] = verdict(result, summary)
    print_table(result, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        save_png(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
