#!/usr/bin/env python
"""The 1T plan, computed (issue 26 item 3): what a fleet of vLLM servers following one trainer through a
store costs per version, and the first limit it hits, from the per-element costs measured in
benchmarks/results/ and a model's shape and fleet.

Every number the model uses is an `Input` with a kind and a source:

  measured  read from a file in benchmarks/results/ (the file and the field are named)
  derived   a formula over measured numbers (least-squares lines through named runs, a code default)
  assumed   a deployment choice (yours to set: replicas, NICs, step time) or a published limit, with its source

It prints, per scenario (model x fleet x density x how ranks decode): bytes per version, store requests
per second (GETs and PUTs of the busiest store: polls, records, data files, the ledger), store egress,
staging memory per GPU and pinned host memory per host, time per phase from the end of a training step
to the version being live, and every limit as demand / capacity, the largest first. It writes a PNG
and a JSON (benchmarks/results/scale_model.{png,json}).

    .venv/bin/python benchmarks/scale_model.py                  # table, PNG, JSON
    .venv/bin/python benchmarks/scale_model.py --inputs         # every input: value, kind, source (markdown)
    .venv/bin/python benchmarks/scale_model.py --markdown       # the tables of docs/SCALE.md

No torch, no GPU: the package's defaults (poll intervals, anchor cadence) are read from its source with
`ast`, not imported. docs/SCALE.md explains the model and its caveats.

The model lives in four files: scale_inputs.py (inputs, shapes, the fleet), scale_costs.py (the measured
costs), scale_plan.py (one scenario computed, the scenarios) and this one (tables, plot, JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the model's other files, beside this one
from scale_costs import KEPT_PHASES, STAGE_PHASES, MeasuredCosts  # noqa: E402
from scale_inputs import (  # noqa: E402
    FLEET_SOURCES,
    GB,
    KIMI_K2,
    MODELS,
    QWEN3_8B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    RESULTS,
    Fleet,
    Input,
    ModelShape,
    code_default,
)
from scale_plan import FLEETS, Plan, Scenario, _total, max_replicas, plan, scenarios, what_ifs, with_replicas  # noqa: E402

# tests/test_scale_model.py reads the model through this module: the names it reads, re-exported
__all__ = ["QWEN3_8B", "QWEN3_30B_A3B", "Input", "MeasuredCosts", "Scenario", "_total", "code_default", "plan"]


def fmt(v: float, digits: int = 3) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def headline(plans: Iterable[Plan], c: MeasuredCosts) -> list[list[str]]:
    rows = [
        [
            "model", "density", "fleet", "decode", "hosts", "version GB", "GET/s (busiest store)",
            "egress Gbit/s (busiest)", "staging peak GB/GPU", "inflate+decode s/rank", "pause ms", "step end -> live s",
            "steps behind", "first limit (demand / capacity)", "max replicas",
        ]
    ]  # fmt: skip
    for p in plans:
        s = p.scenario
        get = max(_total(v, "GET") for v in p.requests.values())
        egress = max(v["egress Gbit/s"] for v in p.requests.values())
        lim = p.first_limit
        rows.append(
            [
                s.model.name,
                f"{s.density:.0%}",
                s.fleet.name,
                s.decode,
                fmt(p.hosts),
                fmt(p.version_bytes / GB),
                fmt(get),
                fmt(egress),
                fmt(p.staging_peak_gb),
                fmt((p.phases_ms["inflate"] + p.phases_ms["decode"]) / 1e3),
                fmt(p.phases_ms["pause"]),
                fmt(p.live_s),
                fmt(p.behind, 2),
                f"{lim.name}: {fmt(lim.demand)} / {fmt(lim.capacity)} {lim.unit} ({lim.ratio:.0%})",
                _max_replicas_text(max_replicas(s, c)),
            ]
        )
    return rows


def _max_replicas_text(n: int) -> str:
    return "none: a per-version limit" if n == 0 else fmt(n)


def phase_rows(plans: Sequence[Plan]) -> list[list[str]]:
    names = list(plans[0].phases_ms)
    rows = [["model", "density", "decode", "fleet", *[f"{n} s" for n in names], "total s"]]
    for p in plans:
        s = p.scenario
        rows.append(
            [s.model.name, f"{s.density:.0%}", s.decode, s.fleet.name]
            + [fmt(p.phases_ms[n] / 1e3) for n in names]
            + [fmt(p.live_s)]
        )
    return rows


def limit_rows(p: Plan) -> list[list[str]]:
    rows = [["limit", "demand", "capacity", "unit", "demand / capacity"]]
    for lim in sorted(p.limits, key=lambda x: -x.ratio):
        rows.append([lim.name, fmt(lim.demand), fmt(lim.capacity), lim.unit, f"{lim.ratio:.1%}"])
    return rows


def request_rows(p: Plan) -> list[list[str]]:
    rows = [["store", "what", "per second"]]
    for store, d in p.requests.items():
        for k, v in d.items():
            rows.append([store, k, fmt(v)])
    return rows


def shape_rows(models: Sequence[ModelShape]) -> list[list[str]]:
    rows = [["model", "parameters", "routed-expert parameters", "checkpoint tensors", "shape from"]]
    for m in models:
        rows.append([m.name, f"{m.params / GB:.2f}B", f"{m.expert_params / GB:.2f}B", f"{m.tensors:,}", m.source])
    return rows


def input_rows(c: MeasuredCosts, fleets: dict[str, Fleet]) -> list[list[str]]:
    """Every input but the staging phases' lines (stage_rows), then the fleet's fields."""
    rows = [["input", "value", "unit", "kind", "source"]]
    for i in c.inputs():
        if not i.name.startswith("stage_"):
            rows.append([i.name, fmt(i.value, 4), i.unit, i.kind, i.source])
    for name, src in FLEET_SOURCES.items():
        values = {key: str(getattr(fl, name)) for key, fl in fleets.items()}
        shown = (
            next(iter(values.values()))
            if len(set(values.values())) == 1
            else ", ".join(f"{k}: {v}" for k, v in values.items())
        )
        kind = "derived" if src.startswith(("package default", "the package")) else "assumed"
        rows.append([f"fleet.{name}", shown, "", kind, src])
    return rows


def stage_rows(c: MeasuredCosts) -> list[list[str]]:
    rows = [["staging phase", "fixed ms", "ns per element", "over the elements", "kind, source"]]
    for ph in STAGE_PHASES:
        over = "kept" if ph in KEPT_PHASES else "decoded"
        rows.append([ph, fmt(c.stage_fixed_ms[ph].value, 3), fmt(c.stage_ns_per_elem[ph].value, 3), over, ""])
    rows.append(
        [
            "rest (per tensor: " + fmt(c.stage_rest_ms_per_tensor.value * 1e3, 3) + " us)",
            fmt(c.stage_rest_ms.value, 3),
            fmt(c.stage_rest_ns_per_elem.value, 3),
            "decoded",
            "",
        ]
    )
    rows[1][4] = f"derived: {c.stage_fixed_ms[STAGE_PHASES[0]].source}"
    rows[-1][4] = f"derived: {c.stage_rest_ms.source}"
    return rows


def markdown(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows)


# the peers' published numbers (shared/notes/peers_2026-11*.md), beside ours for the same model and density
PEERS: list[dict[str, Any]] = [
    {
        "system": "NeMo-RL sparse refit (S3)",
        "published": "247.2 GB model (bf16), 3% changed: 20.2 s end to end; generation paused until the global flush",
        "model": QWEN3_235B_A22B, "density": 0.03, "key": "235B",
        "source": "NVIDIA-NeMo/RL docs/design-docs/sparse-delta-refit.md (peers_2026-11.md §3)",
    },
    {
        "system": "verl delta_sharded (NCCL)",
        "published": "Qwen3-235B: 11.4-14.9 s per sync (full: 246-266 s); 30B-A3B: 7.1 s (full 32.2 s)",
        "model": QWEN3_235B_A22B, "density": 0.01, "key": "235B",
        "source": "verl-project/verl docs/advance/delta_weight_sync.md (peers_2026-11.md §3)",
    },
    {
        "system": "vLLM P2P (sharded_rdt, NIXL)",
        "published": "Qwen3-235B, 8xH100 -> 8xH100, dense: 3.2-3.3 s per sync",
        "model": QWEN3_235B_A22B, "density": 0.01, "key": "235B",
        "source": "vllm-project/vllm #43375 (peers_2026-11c.md §0, §1)",
    },
    {
        "system": "Fireworks (S3/GCS, arc_v2 XOR deltas)",
        "published": "1T FP8: 20.3 GiB average delta (1.98% of 1,024 GiB); 3-4 clusters; swap < 60 s (secondary)",
        "model": KIMI_K2, "density": 0.02, "key": "1T",
        "source": "fireworks.ai blog; docs.fireworks.ai rl-rollout-delta-checkpoints (peers_2026-11.md §3)",
    },
    {
        "system": "AReaL (AReaL-DTE deltas; Awex transfer)",
        "published": "DTE: no sync time published, 6 B per changed element before zstd; Awex 1T FP8: NCCL 20 s, "
        "RDMA 6 s (dense)",
        "model": KIMI_K2, "density": 0.02, "key": "1T",
        "source": "areal-project/AReaL-DTE README; inclusionAI/Awex README (peers_2026-11c.md §3a; 11b §1)",
    },
    {
        "system": "ModelExpress (S3 XOR delta)",
        "published": "none published",
        "model": KIMI_K2, "density": 0.02, "key": "1T",
        "source": "ai-dynamo/modelexpress docs/S3_DELTA_WEIGHT_REFIT.md (peers_2026-11.md §3)",
    },
]  # fmt: skip


def one_replica(fleet: Fleet) -> Fleet:
    """The same replica alone on its store (what most peers' numbers describe: one trainer, one engine group)."""
    return dataclasses.replace(fleet, name="1 replica", replicas=1, regions=1, mirrors_per_region=0)


def peer_rows(c: MeasuredCosts) -> list[list[str]]:
    rows = [["peer", "published", "ours, same model and density (computed here)", "source"]]
    for peer in PEERS:
        fleet, model, d = FLEETS[peer["key"]], peer["model"], peer["density"]
        alone = plan(Scenario(model, one_replica(fleet), d, "share"), c)
        fast = dataclasses.replace(one_replica(fleet), download_streams=16, hash_threads=16)
        alone_fast = plan(Scenario(model, fast, d, "share"), c)
        fleet_share = plan(Scenario(model, fleet, d, "share"), c)
        fleet_whole = plan(Scenario(model, fleet, d, "whole"), c)
        net = (alone.phases_ms["download"] + alone.phases_ms["verify"]) / 1e3
        head = f"{model.name} at {d:.0%}: {fmt(alone.version_bytes / GB)} GB a version"
        pause = f"pause {fmt(alone.phases_ms['pause'])} ms"
        one = f"One replica: live {fmt(alone.live_s)} s after the step ({fmt(net)} s of it download + verify"
        one += f" on one stream), {fmt(alone_fast.live_s)} s with 16 streams and hash threads"
        many = f"{fleet.replicas} replicas: {fmt(fleet_share.live_s)} s"
        many += f" ({fmt(fleet_whole.live_s)} s as ranks decode today)"
        ours = f"{head}, {pause}. {one}. {many}"
        rows.append([peer["system"], peer["published"], ours, peer["source"]])
    return rows


def kimi_2pct_share(plans: Sequence[Plan]) -> Plan:
    return next(
        p for p in plans if p.scenario.model is KIMI_K2 and p.scenario.decode == "share" and p.scenario.density == 0.02
    )


def plot(plans: Sequence[Plan], c: MeasuredCosts, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 7))
    names = list(plans[0].phases_ms)
    colors = plt.get_cmap("tab20")
    labels = [f"{p.scenario.model.name} {p.scenario.density:.0%}, {p.scenario.decode}" for p in plans]
    left = np.zeros(len(plans))
    for k, name in enumerate(names):
        share = np.array([p.phases_ms[name] / 1e3 / p.live_s for p in plans])
        ax1.barh(labels, share, left=left, color=colors(k), label=name)
        left += share
    for i, p in enumerate(plans):
        ax1.text(1.01, i, f"{fmt(p.live_s)} s", va="center", fontsize=8)
    ax1.set_xlim(0, 1.12)
    ax1.set_xlabel("share of the time from the end of a training step to live on every server (total at the right)")
    ax1.invert_yaxis()
    ax1.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.09))
    ax1.set_title("time per phase, 1,000 replicas (GPU costs measured on one H200; fleet assumed)", fontsize=10)

    base = kimi_2pct_share(plans).scenario
    counts = [int(x) for x in np.unique(np.logspace(0, 4, 41).astype(int))]
    series: dict[str, list[float]] = {}
    for n in counts:
        pl = plan(with_replicas(base, n), c)
        for lim in pl.limits:
            series.setdefault(lim.name.split(" (")[0], []).append(lim.ratio)
    for k, (name, ys) in enumerate(series.items()):
        if max(ys) >= 0.01:
            ax2.plot(counts, ys, label=name, color=plt.get_cmap("tab20")(k))
    ax2.axhline(1.0, color="black", lw=1, ls="--")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("replicas (32 H200 each)")
    ax2.set_ylabel("demand / capacity")
    ax2.set_title(f"{KIMI_K2.name} at 2%, each rank its share, {base.fleet.name}: limits by fleet size", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS, help="where the measured inputs are read")
    ap.add_argument("--out", default=os.path.join(RESULTS, "scale_model"), help="PNG and JSON path, without suffix")
    ap.add_argument("--inputs", action="store_true", help="print every input as a markdown table and exit")
    ap.add_argument("--markdown", action="store_true", help="print the tables of docs/SCALE.md")
    ap.add_argument("--no-png", action="store_true")
    args = ap.parse_args(argv)
    c = MeasuredCosts.load(args.results)
    if args.inputs:
        print(markdown(input_rows(c, FLEETS)))
        print()
        print(markdown(stage_rows(c)))
        return 0
    plans = [plan(s, c) for s in scenarios()]
    extra = [plan(s, c) for s in what_ifs()]
    show: Callable[[list[list[str]]], str] = markdown if args.markdown else text_table
    kimi = kimi_2pct_share(plans)
    sections = [
        ("Model shapes", shape_rows(MODELS)),
        ("Headline", headline(plans, c)),
        ("Time per phase", phase_rows(plans)),
        (f"Limits: {kimi.scenario.label}", limit_rows(kimi)),
        (f"Store requests: {kimi.scenario.label}", request_rows(kimi)),
        ("What it takes: the 1T at 2%", headline(extra, c)),
        ("Peers", peer_rows(c)),
    ]
    for title, rows in sections:
        print(f"\n## {title}\n")
        print(show(rows))
    if not args.no_png:
        plot(plans, c, args.out + ".png")
        print(f"\nsaved {args.out}.png")
    with open(args.out + ".json", "w") as f:
        json.dump(
            {
                "command": "benchmarks/scale_model.py",
                "inputs": [dataclasses.asdict(i) for i in c.inputs()],
                "fleet_sources": FLEET_SOURCES,
                "models": {m.name: {"params": m.params, "expert_params": m.expert_params, "tensors": m.tensors,
                                    "source": m.source} for m in MODELS},
                "plans": [p.to_json() for p in plans],
                "what_ifs": [p.to_json() for p in extra],
            },
            f,
            indent=1,
        )  # fmt: skip
    print(f"saved {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
