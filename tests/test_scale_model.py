"""benchmarks/scale_model.py (issue 26 item 3): its arithmetic on small cases computed by hand, and every
measured input traceable to a file in benchmarks/results/. Fast, no GPU, no torch."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _load():
    spec = importlib.util.spec_from_file_location("scale_model", ROOT / "benchmarks" / "scale_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_model"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


sm = _load()

# hidden 4, one layer, vocab 10, untied; GQA with 2 heads of 2, 1 KV head; a dense MLP of 8
TINY = sm.ModelShape(
    "tiny", "by hand", hidden=4, layers=1, vocab=10, tied=False, attention="gqa", heads=2, kv_heads=1, head_dim=2,
    intermediate=8,
)  # fmt: skip


def test_parameters_and_tensors_counted_by_hand():
    # embed 40 + final norm 4 + lm_head 40; q 16, k 8, v 8, o 16, q_norm 2, k_norm 2; two norms 8; MLP 3*4*8
    assert TINY.params == 84 + 52 + 8 + 96 == 240
    assert TINY.tensors == 3 + 6 + 2 + 3 == 14
    assert TINY.expert_params == TINY.expert_tensors == 0

    moe = dataclasses.replace(TINY, experts=2, moe_intermediate=3)  # experts 2*3*4*3, router 2*4
    assert (moe.params, moe.expert_params, moe.tensors, moe.expert_tensors) == (224, 72, 18, 6)
    moe2 = dataclasses.replace(moe, router_bias=True, shared_experts=1)  # + bias 2, shared MLP 3*4*3
    assert (moe2.params, moe2.tensors) == (224 + 2 + 36, 18 + 1 + 3)
    first_dense = dataclasses.replace(moe, layers=2, dense_layers=1)  # layer 0 dense, layer 1 MoE
    assert first_dense.params == 84 + 2 * (52 + 8) + 96 + 72 + 8

    # MLA: q_a 4*2, q_a_norm 2, q_b 2*2*(1+1), kv_a 4*(2+1), kv_a_norm 2, kv_b 2*2*(1+1), o 2*1*4
    mla = dataclasses.replace(
        TINY, attention="mla", q_lora_rank=2, kv_lora_rank=2, qk_nope_head_dim=1, qk_rope_head_dim=1, v_head_dim=1
    )
    assert mla.params == 84 + (8 + 2 + 8 + 12 + 2 + 8 + 8) + 8 + 96
    assert mla.tensors == 3 + 7 + 2 + 3


def test_model_shapes_match_what_the_benchmarks_ran():
    rows = json.loads((RESULTS / "apply_gpu_codec2_h200.json").read_text())["rows"]
    params = {r["model"]: r["params"] for r in rows}
    assert sm.QWEN3_8B.params == params["qwen3-8b"]
    assert sm.QWEN3_30B_A3B.params == params["qwen3-30b-a3b"]
    log = (RESULTS / "apply_gpu_codec2_h200.log").read_text()
    tensors = dict(re.findall(r"## (qwen3-[\w-]+): .*?(\d+) HF tensors", log))
    assert sm.QWEN3_8B.tensors == int(tensors["qwen3-8b"])
    assert sm.QWEN3_30B_A3B.tensors == int(tensors["qwen3-30b-a3b"])
    # the published totals: "235B" and "1T" (Kimi-K2's model card)
    assert 234e9 < sm.QWEN3_235B_A22B.params < 236e9
    assert 1.0e12 < sm.KIMI_K2.params < 1.05e12
    assert sm.KIMI_K2.experts == 384 and sm.KIMI_K2.layers == 61


def _costs(**values):
    """MeasuredCosts with every input 0 unless given (name -> value; stage phases as stage_<phase>)."""
    zero = {}
    for f in dataclasses.fields(sm.MeasuredCosts):
        if f.name in ("stage_fixed_ms", "stage_ns_per_elem"):
            zero[f.name] = {ph: sm.Input(ph, 0.0, "", "derived", "test") for ph in sm.STAGE_PHASES}
        else:
            zero[f.name] = sm.Input(f.name, float(values.pop(f.name, 0.0)), "", "derived", "test")
    for key, v in list(values.items()):
        kind, ph = key.split(":")
        zero[kind][ph] = sm.Input(ph, float(v), "", "derived", "test")
        del values[key]
    assert not values
    return sm.MeasuredCosts(**zero)


FLEET = sm.Fleet(
    "test", replicas=10, tp=2, step_s=10, trainer_gpus=2, gpus_per_host=4, poll_s=2, report_s=10, full_listing_s=60,
    anchor_every=20, get_latency_ms=10, stream_gbps=1.0, host_nic_gbps=100, store_egress_gbps=100,
)  # fmt: skip
COSTS = _costs(
    bytes_a=2.0,
    agree_ms=1.0,
    gets_per_poll=3,
    peak_fixed_gb=1.0,
    peak_bytes_per_kept=1e6,
    held_bytes_per_kept=8,
    pinned_per_file_byte=1.0,
    pause_ns_per_elem_1pct=1e6,
    pause_ns_per_elem_3pct=1e6,
    card_memory_gib=100,
    sha256_gb_per_s=1.0,
    sha256_passes=2,
    mirror_reads_per_version=1.0,
    **{"stage_ns_per_elem:decode": 1e6, "stage_ns_per_elem:plan": 1e6},
)


def test_plan_arithmetic_by_hand():
    whole = sm.plan(sm.Scenario(TINY, FLEET, 0.5, "whole"), COSTS)
    share = sm.plan(sm.Scenario(TINY, FLEET, 0.5, "share"), COSTS)
    # 240 parameters at 50%: 120 changed, 2 B each; tp=2: a rank keeps 60; two replicas (2 GPUs) per 4-GPU host
    assert whole.changed == 120 and whole.version_bytes == 240 and whole.hosts == 5 and whole.files == 2
    assert whole.kept_per_rank == share.kept_per_rank == 60
    assert (whole.decoded_per_rank, share.decoded_per_rank) == (120, 60)
    # decode: 1 ms per decoded element; plan: 1 ms per kept element; the pause: 1 ms per kept element
    assert whole.phases_ms["decode"] == pytest.approx(120) and share.phases_ms["decode"] == pytest.approx(60)
    assert whole.phases_ms["stage, rest"] == pytest.approx(60) == share.phases_ms["stage, rest"]
    assert whole.phases_ms["pause"] == pytest.approx(60)
    assert whole.phases_ms["publish"] == pytest.approx(1.0)
    # download: half a poll (1 s) + 4 GETs (2 records, 2 files) of 10 ms + 240 B at 1 Gbit/s; two hashes of 240 B
    assert whole.phases_ms["download"] == pytest.approx(1000 + 40 + 240 * 8 / 1e9 * 1e3)
    assert whole.phases_ms["verify"] == pytest.approx(2 * 240 / 1e9 * 1e3)
    assert whole.phases_ms["mirror"] == 0
    # one store, read by everyone: 10 replicas polling 3 GETs every 2 s, 2 listing requests a minute,
    # 2 records per version, 5 hosts x 2 files per 10 s step, the trainer's ledger read (10 reports a step)
    origin = whole.requests["origin"]
    assert sm._total(origin, "GET") == pytest.approx(15 + 20 / 60 + 2 + 1 + 1)
    # 10 reports per heartbeat (10 s) and per version; the trainer: 2 parts, a record and the head per
    # step, and an anchor's 2 parts every 20 steps
    assert sm._total(origin, "PUT") == pytest.approx(2 + 0.4 + 2 / 200)
    assert origin["egress Gbit/s"] == pytest.approx(5 * 240 * 8 / 10 / 1e9)
    assert list(whole.requests) == ["origin"]
    # memory: 1 GB + 1 MB per kept element at the peak, 8 B held; pinned: 4 ranks of a host each read the
    # whole file (whole) or their half of it (share)
    assert whole.staging_peak_gb == pytest.approx(1.06) and whole.staging_held_gb == pytest.approx(480 / 1e9)
    assert (whole.pinned_per_host_gb, share.pinned_per_host_gb) == (pytest.approx(960 / 1e9), pytest.approx(480 / 1e9))
    assert whole.weights_per_gpu_gb == pytest.approx(2 * 120 / 1e9)
    # the pause (60 ms) is the only limit past its capacity (50 ms)
    assert whole.first_limit.name == "pause budget" and whole.first_limit.ratio == pytest.approx(1.2)
    assert whole.live_s == pytest.approx(sum(whole.phases_ms.values()) / 1e3)


def test_mirrors_move_the_hosts_reads_to_regional_stores():
    fleet = dataclasses.replace(FLEET, regions=2, mirrors_per_region=1, mirror_poll_s=2)
    p = sm.plan(sm.Scenario(TINY, fleet, 0.5, "share"), COSTS)
    origin, regional = p.requests["origin"], p.requests["regional"]
    # each regional store: 5 replicas, 2.5 hosts, and its mirror reading the 5 reports every pass
    assert sm._total(regional, "GET") == pytest.approx(5 * 3 / 2 + 10 / 60 + 1 + 2.5 * 2 / 10 + 5 / 2)
    # the origin: 2 mirrors (polls, listings, records, the parts and an anchor's parts), the trainer's ledger read
    assert sm._total(origin, "GET") == pytest.approx(2 * 3 / 2 + 4 / 60 + 0.4 + 0.4 + 2 * 2 / 200 + 1)
    # the origin serves each mirror the version once plus an anchor (2 B x 240) every 20 versions
    assert origin["egress Gbit/s"] == pytest.approx(2 * (240 + 480 / 20) * 8 / 10 / 1e9)
    assert p.phases_ms["mirror"] > 0


def test_pause_and_bytes_interpolation():
    c = _costs(pause_ns_per_elem_1pct=4.0, pause_ns_per_elem_3pct=2.0, bytes_a=1.0, bytes_b=0.5)
    assert c.pause_ns_per_elem(0.01) == 4.0 and c.pause_ns_per_elem(0.03) == pytest.approx(2.0)
    assert c.pause_ns_per_elem(0.01 * math.sqrt(3)) == pytest.approx(3.0)  # linear in ln(density)
    assert c.pause_ns_per_elem(0.001) == 4.0 and c.pause_ns_per_elem(0.5) == 2.0  # held flat outside
    assert c.bytes_per_changed(0.01) == pytest.approx(1.0 + 0.5 * math.log(100))


def test_every_measured_input_resolves_to_a_results_file():
    costs = sm.MeasuredCosts.load()
    inputs = costs.inputs()
    assert {i.kind for i in inputs} <= {"measured", "derived"}
    measured = [i for i in inputs if i.kind == "measured"]
    assert len(measured) >= 10
    for i in inputs:
        assert math.isfinite(i.value), i
        if i.kind == "measured":
            assert i.files, f"{i.name}: measured, but names no results file"
            assert i.source.startswith(i.files[0] + ":"), i
        for name in i.files:
            path = RESULTS / name
            assert path.is_file(), f"{i.name}: {path} does not exist"
            json.loads(path.read_text())  # a results file, not a stub
    # every file named in a derived formula's text is one of its files
    for i in inputs:
        for name in re.findall(r"[\w.-]+\.json", i.source):
            assert name in i.files, (i.name, name)
    # the results files say how they were made
    for name in {n for i in measured for n in i.files}:
        doc = json.loads((RESULTS / name).read_text())
        assert isinstance(doc, dict)
        assert any(k in doc for k in ("command", "meta", "rows", "cards")), name


def test_code_defaults_are_read_from_source(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text(
        "LIMIT = 60.0\n"
        "class Opts:\n    poll_s: float = 2.0\n    other = 3\n"
        "class Pub:\n    def __init__(self, uri, anchor_every: int = 20, *, codec='x', depth: int = 7):\n        pass\n"
    )
    assert sm.code_default(str(src), "", "LIMIT") == 60.0
    assert sm.code_default(str(src), "Opts", "poll_s") == 2.0 and sm.code_default(str(src), "Opts", "other") == 3
    assert sm.code_default(str(src), "Pub.__init__", "anchor_every") == 20
    assert sm.code_default(str(src), "Pub.__init__", "depth") == 7
    with pytest.raises(KeyError):
        sm.code_default(str(src), "Opts", "missing")
    # the package's own defaults, as the fleet reads them
    assert sm.Fleet.poll_s > 0 and sm.Fleet.anchor_every >= 1 and sm.Fleet.full_listing_s > 0


def test_the_script_writes_its_json(tmp_path):
    out = tmp_path / "scale"
    assert sm.main(["--no-png", "--out", os.fspath(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert len(doc["plans"]) == len(sm.scenarios()) and doc["what_ifs"]
    for p in doc["plans"]:
        names = [lim["name"] for lim in p["limits"]]
        assert p["first_limit"] in names and p["live_s"] > 0
