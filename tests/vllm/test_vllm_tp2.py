"""Tensor parallelism 2 on a real vLLM server: Qwen3 with tied embeddings and one KV head (replicated
on both ranks), vocab 500 (padded and split across ranks). Checksums are sums over both ranks'
owned elements; an update is verified over both ranks before either writes; a failure on rank 1
after rank 0 committed rolls back both. In-flight updates (mode "inflight") while 4 clients stream:
both ranks commit between the same two steps, nothing is preempted, attribution matches the update
timeline; a failed in-flight commit on rank 1 rolls back both and keeps the prefix cache. Greedy
outputs are compared with a fresh TP=2 server: the module's own server, freshly started at the run's
last version (anchor 3 and two deltas loaded at start-up) and then rolled back to version 0, where the
tests begin (one TP=2 start-up instead of two).
"""

from __future__ import annotations

import pytest
from craft import publish_delta
from inflight_helpers import check_attribution, greedy, updates_under_load
from pooled import pooled_server
from vllm_helpers import FRESH_PROMPTS, LONG_PROMPT, fresh_then_version_0, private_store_of, qwen_run_of

from vllm_delta.testing.pool import ServerSpec

pytestmark = pytest.mark.vllm

outputs: dict[int, list[str]] = {}
fresh: dict[str, object] = {}  # what the server answered when freshly started at version 5


def tp2_server_plan(tmp_path_factory):
    qwen_run = qwen_run_of(tmp_path_factory)
    spec = ServerSpec.of(
        qwen_run.model_dir,
        store=private_store_of("tp2_store", qwen_run, tmp_path_factory),
        version=5,
        tensor_parallel_size=2,
        env={"VLLM_DELTA_TEST_FAULTS": "1"},
        extra_args=["--enable-prompt-tokens-details"],
    )
    return spec, None


tp2_server = pooled_server("tp2_server", tp2_server_plan)  # started ahead, while the module before runs


@pytest.fixture(scope="module")
def store(qwen_run, tmp_path_factory) -> str:
    """The server's store (a copy of qwen_run's): the tests add crafted versions 6 and up."""
    return private_store_of("tp2_store", qwen_run, tmp_path_factory)


@pytest.fixture(scope="module")
def server(tp2_server):
    fresh.update(fresh_then_version_0(tp2_server, FRESH_PROMPTS))
    return tp2_server


def assert_serving(server, run, version: int) -> None:
    st = server.status()
    assert (st["version"], st["checksum"], st["version_checksum"]) == (
        version,
        run.checksums[version],
        run.checksums[version],
    )


def test_tp2_starts_verified(server, qwen_run):
    assert_serving(server, qwen_run, 0)
    outputs[0] = server.completions(FRESH_PROMPTS)


def test_tp2_every_version(server, qwen_run):
    assert qwen_run.kinds == {0: "anchor", 1: "delta", 2: "delta", 3: "anchor", 4: "delta", 5: "delta"}
    for v in qwen_run.versions[1:]:
        res = server.update(v)
        assert res["applied"] == [v] and res["reanchored"] == (v == 3)
        assert_serving(server, qwen_run, v)
        outputs[v] = server.completions(FRESH_PROMPTS)
    assert outputs[5] != outputs[4], "the large last step should change greedy outputs"


def test_tp2_failure_on_one_rank_rolls_back_both(server, qwen_run, store):
    # The embedding is split by vocab rows across ranks: positions on both halves.
    rec = publish_delta(store, 5, 6, tensor="model.embed_tokens.weight", positions=[3, 128 * 300 + 5])
    r = server.post("/v1/delta/update_weights", {"version": 6, "fault": "commit@1"})
    assert r.status_code == 500 and "rolled back" in r.text, r.text
    assert_serving(server, qwen_run, 5)
    assert server.completions(FRESH_PROMPTS) == outputs[5]
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


def test_tp2_inflight_updates_while_clients_stream(server, qwen_run):
    """From the crafted version 8 back into the run and along it twice: 11 in-flight updates. The
    reference at each version is this server's own output after a keep-mode update (prefix cache
    reset, checksums verified); the one at version 5 is also checked against a fresh server below."""
    run = qwen_run.versions[1:]  # 1..5: deltas, the anchor 3, deltas
    plan = [(0, {"allow_reanchor": True}), *[(v, {}) for v in run], (1, {"allow_reanchor": True})]
    plan += [(v, {}) for v in run[1:]]
    assert len(plan) >= 10
    report = updates_under_load(server, plan, qwen_run.checksums, outputs, FRESH_PROMPTS, max_tokens=64)
    assert not report.errors, report.errors
    assert not report.mismatches, report.mismatches
    assert report.preemptions == 0
    assert sum(1 for res in report.updates if res["inflight"]["requests_running"]) >= len(plan) - 2
    assert check_attribution(report) >= len(plan) // 2
    assert_serving(server, qwen_run, 5)


def test_tp2_failed_inflight_commit_rolls_back_both_ranks(server, qwen_run, store):
    assert greedy(server, [LONG_PROMPT, LONG_PROMPT])[1]["cached"] == 128
    rec = publish_delta(store, 5, 9, tensor="model.embed_tokens.weight", positions=[7, 128 * 300 + 9])
    r = server.post("/v1/delta/update_weights", {"version": 9, "mode": "inflight", "fault": "commit@1"})
    assert r.status_code == 500 and "rolled back on every rank" in r.text, r.text
    assert_serving(server, qwen_run, 5)
    after = greedy(server, [LONG_PROMPT])[0]
    assert after["cached"] == 128 and [s[0] for s in after["spans"]] == [5]  # prefix cache and label untouched
    res = server.update(9, mode="inflight")
    assert res["inflight"]["label"] == "9" and server.status()["checksum"] == rec["checksum"]


def test_tp2_outputs_equal_a_fresh_tp2_server(qwen_run):
    # The module's server as it came up at version 5, before any update (the `server` fixture).
    assert fresh["checksum"] == qwen_run.checksums[5]
    assert fresh["outputs"] == outputs[5]
