"""What a streaming client sees while a vLLM server takes a weight update.

One streaming completion runs the whole time (ignore_eos, long max_tokens; restarted when it ends).
Updates are sent one after another, cycling through three kinds, side by side in one run:

  delta   POST /v1/delta/update_weights {"version": N}                    (our in-place scatter)
  vllm    POST /v1/delta/update_weights {"version": N, "method": "vllm"}  (the same staged update
          written through vLLM's own load_checkpoint_weight_patches inside the pause)
  reset   POST /pause?mode=keep&clear_cache=true, POST /resume              (vLLM's dev routes: no
          update, but the same prefix-cache reset an update does: in-flight requests are preempted
          and recompute their KV, which an update needs too, since that KV came from the old weights)
  pause   POST /pause?mode=keep&clear_cache=false, POST /resume             (the scheduling floor)

The stream's requests are short (48 tokens), so the recompute after a reset stays small and similar.

For each update: the largest gap between two streamed chunks that overlaps the request, next to
the median chunk interval outside updates, plus the server's own pause_ms / apply_ms / stage_ms.

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

from vllm_delta.testing.client import StreamingClient, steady_gaps_ms

KINDS = ("delta", "vllm", "reset", "pause")
SIZES = {
    # ~0.4 M parameters: CI-sized.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=500),
    # ~30 M parameters: a forward pass long enough on CPU for the apply to be small next to it.
    "small": dict(hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8, num_kv_heads=2, vocab_size=4096),
}


@dataclass
class Sample:
    kind: str
    version: int | None
    t0: float
    t1: float
    server: dict


def measure(base_url: str, model: str, versions: list[int], *, api_key: str | None = None, settle: float = 1.0):
    """Cycle delta / vllm / pause over `versions` (delta and vllm each consume one version)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stream = StreamingClient(base_url, model, headers=headers, prompt="once upon a time").start()
    samples: list[Sample] = []
    try:
        stream.wait_for_chunks(20)
        todo = list(versions)
        while todo:
            for kind in KINDS:
                if kind in ("delta", "vllm") and not todo:
                    break
                time.sleep(settle)
                t0 = time.perf_counter()
                if kind in ("reset", "pause"):
                    clear = "true" if kind == "reset" else "false"
                    r1 = requests.post(base_url + f"/pause?mode=keep&clear_cache={clear}", headers=headers, timeout=60)
                    r2 = requests.post(base_url + "/resume", headers=headers, timeout=60)
                    t1 = time.perf_counter()
                    if r1.status_code != 200 or r2.status_code != 200:
                        raise RuntimeError(
                            f"/pause or /resume failed ({r1.status_code}, {r2.status_code}): "
                            "start the server with VLLM_SERVER_DEV_MODE=1"
                        )
                    samples.append(Sample(kind, None, t0, t1, {}))
                    continue
                v = todo.pop(0)
                body = {"version": v, "mode": "keep", "method": kind}
                r = requests.post(base_url + "/v1/delta/update_weights", json=body, headers=headers, timeout=300)
                t1 = time.perf_counter()
                if r.status_code != 200:
                    raise RuntimeError(f"update to {v} answered {r.status_code}: {r.text}")
                samples.append(Sample(kind, v, t0, t1, r.json()))
        time.sleep(settle)
    finally:
        stream.stop()
    windows = [(s.t0, s.t1) for s in samples]
    steady = steady_gaps_ms(stream.arrivals, windows)
    rows = [
        {
            "kind": s.kind,
            "version": s.version,
            "client_gap_ms": round(stream.max_gap_ms(s.t0, s.t1), 2),
            "request_ms": round((s.t1 - s.t0) * 1e3, 2),
            "pause_ms": s.server.get("pause_ms"),
            "apply_ms": s.server.get("apply_ms"),
            "stage_ms": s.server.get("stage_ms"),
            "nnz": s.server.get("nnz"),
        }
        for s in samples
    ]
    return {"steady_gaps_ms": steady, "rows": rows, "stream_errors": stream.errors}


def summarize(result: dict) -> list[dict]:
    out = []
    for kind in KINDS:
        rows = [r for r in result["rows"] if r["kind"] == kind]
        if not rows:
            continue

        def med(key, rows=rows):
            vals = [r[key] for r in rows if r[key] is not None]
            return round(statistics.median(vals), 2) if vals else None

        out.append(
            {
                "kind": kind,
                "n": len(rows),
                "client_gap_ms": med("client_gap_ms"),
                "max_client_gap_ms": max(r["client_gap_ms"] for r in rows),
                "request_ms": med("request_ms"),
                "pause_ms": med("pause_ms"),
                "apply_ms": med("apply_ms"),
                "stage_ms": med("stage_ms"),
                "nnz": med("nnz"),
            }
        )
    return out


def print_table(result: dict, summary: list[dict]) -> None:
    print(f"chunk intervals outside updates (ms): {result['steady_gaps_ms']}")
    cols = ["kind", "n", "client_gap_ms", "max_client_gap_ms", "request_ms", "pause_ms", "apply_ms", "stage_ms", "nnz"]
    print(" | ".join(f"{c:>17}" for c in cols))
    for row in summary:
        print(" | ".join(f"{str(row[c]):>17}" for c in cols))


def save_png(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    kinds = list(KINDS)
    data = [[r["client_gap_ms"] for r in result["rows"] if r["kind"] == k] for k in kinds]
    ax.boxplot(data, tick_labels=kinds)
    if "p99" in result["steady_gaps_ms"]:
        ax.axhline(result["steady_gaps_ms"]["p99"], ls="--", c="gray", label="p99 chunk interval outside updates")
    ax.set_ylabel("largest client gap during the request (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def spawn_and_measure(size: str, repeats: int, workdir: str) -> dict:
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.runs import publish_run
    from vllm_delta.testing.server import VllmServer

    spec = TinyModelSpec(arch="llama", **SIZES[size])
    t0 = time.time()
    run = publish_run(os.path.join(workdir, "run"), spec, steps=2 * repeats, anchor_every=10**6, lr=1e-6, seed=3)
    print(
        f"published {len(run.versions)} versions of a {size} model in {time.time() - t0:.0f} s; "
        f"density {statistics.median(run.nnz[v] for v in run.versions[1:]) / run.nnz[0]:.2%}"
    )
    with VllmServer(run.model_dir, store=run.store, version=0, dev_mode=True, max_model_len=512) as srv:
        result = measure(srv.base_url, run.model_dir, run.versions[1:])
        status = srv.status()
    if status["checksum"] != run.checksums[run.versions[-1]]:
        raise AssertionError(f"server checksum {status['checksum']} != trainer's {run.checksums[run.versions[-1]]}")
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
        result = measure(args.url, model, versions, api_key=args.api_key)
    else:
        with tempfile.TemporaryDirectory(prefix="pause-latency-") as workdir:
            result = spawn_and_measure(args.size, args.repeats, workdir)
    summary = summarize(result)
    result["summary"] = summary
    print_table(result, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        save_png(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
