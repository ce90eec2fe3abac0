"""Tensor parallelism 2 on a real vLLM server: Qwen3 with tied embeddings and one KV head (replicated
on both ranks), vocab 500 (padded and split across ranks). Checksums are sums over both ranks'
owned elements; an update is verified over both ranks before either writes; a failure on rank 1
after rank 0 committed rolls back both. Greedy outputs are compared with a fresh TP=2 server.
"""

from __future__ import annotations

import pytest
from craft import publish_delta
from vllm_helpers import private_store

from vllm_delta.testing.models import PROMPTS
from vllm_delta.testing.server import VllmServer

pytestmark = pytest.mark.vllm

outputs: dict[int, list[str]] = {}


@pytest.fixture(scope="module")
def store(qwen_run, tmp_path_factory) -> str:
    return private_store(qwen_run, str(tmp_path_factory.mktemp("tp2_store")))


@pytest.fixture(scope="module")
def server(qwen_run, store):
    srv = VllmServer(
        qwen_run.model_dir, store=store, version=0, tensor_parallel_size=2, env={"VLLM_DELTA_TEST_FAULTS": "1"}
    )
    with srv:
        yield srv


def assert_serving(server, run, version: int) -> None:
    st = server.status()
    assert (st["version"], st["checksum"], st["version_checksum"]) == (
        version,
        run.checksums[version],
        run.checksums[version],
    )


def test_tp2_starts_verified(server, qwen_run):
    assert_serving(server, qwen_run, 0)


def test_tp2_every_version(server, qwen_run):
    assert qwen_run.kinds == {0: "anchor", 1: "delta", 2: "delta", 3: "anchor", 4: "delta", 5: "delta"}
    for v in qwen_run.versions[1:]:
        res = server.update(v)
        assert res["applied"] == [v] and res["reanchored"] == (v == 3)
        assert_serving(server, qwen_run, v)
        outputs[v] = server.completions(PROMPTS)
    assert outputs[5] != outputs[4], "the large last step should change greedy outputs"


def test_tp2_failure_on_one_rank_rolls_back_both(server, qwen_run, store):
    # The embedding is split by vocab rows across ranks: positions on both halves.
    rec = publish_delta(store, 5, 6, tensor="model.embed_tokens.weight", positions=[3, 128 * 300 + 5])
    r = server.post("/v1/delta/update_weights", {"version": 6, "fault": "commit@1"})
    assert r.status_code == 500 and "rolled back" in r.text, r.text
    assert_serving(server, qwen_run, 5)
    assert server.completions(PROMPTS) == outputs[5]
    server.update(6)
    st = server.status()
    assert st["checksum"] == rec["checksum"] == st["version_checksum"]


def test_tp2_checksum_mismatch_is_caught_before_writing(server, store):
    before = server.status()
    # The replicated KV projection: both ranks hold it, only rank 0 counts it.
    publish_delta(
        store, 6, 7, tensor="model.layers.0.self_attn.k_proj.weight", positions=[1, 4000], wrong_checksum=True
    )
    r = server.post("/v1/delta/update_weights", {"version": 7})
    assert r.status_code == 422 and "ChecksumMismatchError" in r.text, r.text
    assert server.status()["checksum"] == before["checksum"]
    rec = publish_delta(store, 6, 8, tensor="model.layers.0.self_attn.k_proj.weight", positions=[1, 4000])
    server.update(8)
    assert server.status()["checksum"] == rec["checksum"]


def test_tp2_outputs_equal_a_fresh_tp2_server(qwen_run):
    with VllmServer(qwen_run.model_dir, store=qwen_run.store, version=5, tensor_parallel_size=2) as fresh:
        assert fresh.status()["checksum"] == qwen_run.checksums[5]
        assert fresh.completions(PROMPTS) == outputs[5]
