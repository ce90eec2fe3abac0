"""The engine-core side of in-flight updates (engine_core/calls.py) on real vLLM scheduler objects, in this
process: no engine runs. A real `Scheduler` (KVCacheManager, BlockPool, Requests with block hashes)
is built from the tiny Llama's config; the workers are a fake executor that scripts each rank's reply.

* preflight: a real scheduler with a KV connector (vLLM's ExampleConnector) is refused with 409
  and the reason, before any worker is called;
* a successful commit drops every cached prefix hash while the blocks of a running request stay
  allocated, taints that request (it never inserts hashes again), sets the label, records the switch;
* a failed rank: every rank rolled back in the same call, nothing dropped, no label change;
* a failed rollback: scheduling stops (PAUSED_ALL), every later commit answers 500;
* under a batch queue, the batches already in flight keep the old label.
"""

from __future__ import annotations

import json
from collections import deque
from types import SimpleNamespace

import pytest

from vllm_delta.server_api import UpdateRequest, from_wire
from vllm_delta.vllm.engine_core import calls as enginecore
from vllm_delta.vllm.engine_core import provenance
from vllm_delta.vllm.shared import rpc
from vllm_delta.vllm.shared.rpc import error_reply

pytestmark = pytest.mark.vllm_objects  # no engine, no server: make check-vllm-next runs them against the newest vLLM

BLOCK = 16


class FakeExecutor:
    """Two ranks; `script[method]` gives each rank's reply (an Exception is raised by the executor)."""

    def __init__(self, **script):
        self.script = script
        self.calls: list[str] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        reply = self.script.get(method, [{"apply_ms": 0.5}, {"apply_ms": 0.7}])
        if isinstance(reply, Exception):
            raise reply
        return reply


OK = [{"apply_ms": 0.5}, {"apply_ms": 0.7}]
ROLLED = [{"rolled_back": True}, {"rolled_back": False}]


@pytest.fixture(scope="module")
def vllm_objects(llama_run, tmp_path_factory):
    """What building a Scheduler needs: configs with and without a KV connector, and a block hasher."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    enginecore.install()  # the BlockPool taint check (what the plugin does in the engine core)

    def config(**extra):
        cfg = EngineArgs(
            model=llama_run.model_dir,
            dtype="bfloat16",
            max_model_len=256,
            enforce_eager=True,
            block_size=BLOCK,
            enable_prefix_caching=True,
            **extra,
        ).create_engine_config()
        cfg.cache_config.num_gpu_blocks = 64
        return cfg

    plain = config()
    chunked = config(max_num_batched_tokens=16)  # a 40-token prompt takes three steps
    kv_dir = tmp_path_factory.mktemp("kv")
    connector = config(
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(kv_dir)},
        )
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)]
    )
    hash_fn = get_hash_fn_by_name(plain.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return SimpleNamespace(
        plain=plain,
        chunked=chunked,
        connector=connector,
        kv_config=kv_config,
        hasher=get_request_block_hasher(BLOCK, hash_fn),
    )


def make_core(objs, *, connector=False, executor=None, batch_queue=None, chunked=False):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = objs.connector if connector else objs.chunked if chunked else objs.plain
    scheduler = Scheduler(cfg, objs.kv_config, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=True)
    core = SimpleNamespace(
        vllm_config=cfg,
        scheduler=scheduler,
        model_executor=executor or FakeExecutor(),
        batch_queue=batch_queue,
        _weight_version="3",
    )
    provenance.attach(core)  # what the patched EngineCore methods do on their first call
    return core


def request(objs, rid: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(f"{rid}-abcd1234", tokens, SamplingParams(max_tokens=8), None, block_hasher=objs.hasher)


def cached_tokens(core, objs, tokens) -> int:
    """How many prompt tokens a new request with these tokens would read from the prefix cache."""
    return core.scheduler.kv_cache_manager.get_computed_blocks(request(objs, "probe", tokens))[1]


def running(core, objs, rid: str, tokens: list[int]):
    """A request scheduled once: its prompt's KV is computed, its full blocks are cached."""
    req = request(objs, rid, tokens)
    core.scheduler.add_request(req)
    core.scheduler.schedule()
    assert req.num_computed_tokens == len(tokens)
    return req


PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks of 16


def commit(core, fault=None) -> dict:
    return enginecore.write_between_steps(core, ticket="t", version=4, fault=fault)


def test_preflight_refuses_a_kv_connector(vllm_objects):
    core = make_core(vllm_objects, connector=True)
    assert core.scheduler.connector is not None  # vLLM built its ExampleConnector
    reasons = enginecore.preflight(core)
    assert len(reasons) == 1 and "KV connector" in reasons[0]
    reply = commit(core)
    assert reply["error"]["status"] == 409 and reply["error"]["type"] == "InflightRefusedError"
    assert "KV connector" in reply["error"]["message"]
    assert core.model_executor.calls == []  # refused before any rank wrote anything
    assert enginecore.preflight(make_core(vllm_objects)) == []


def test_a_refusal_reaches_the_client_as_409(vllm_objects, llama_run):
    """The engine core's refusal, through the reserved name, the service and the route wrapper."""
    import asyncio

    from starlette.requests import Request as HttpRequest

    from vllm_delta.errors import InflightRefusedError
    from vllm_delta.vllm.api_server.endpoints import route
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.api_server.worker_update import patch_through_engine_core
    from vllm_delta.vllm.shared.options import StoreSpec
    from vllm_delta.vllm.shared.two_phase import PatchOptions, Staged, Update

    class Core:  # the engine core as vLLM's utility dispatch sees it
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            raise AssertionError("a reserved name must not reach the workers")

        def _attach_weight_version(self, outputs):
            pass

    enginecore.patch_engine_core(Core)
    core = Core()
    core.__dict__.update(make_core(vllm_objects, connector=True).__dict__)

    class Client:  # EngineClient.collective_rpc -> EngineCore.collective_rpc
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return core.collective_rpc(method, timeout, args, kwargs)

    service = DeltaService.of(Client(), StoreSpec(llama_run.store))
    staged = Staged(Update("t", [1], 1), [], 0.0)

    @route
    async def handler(request):
        return await patch_through_engine_core(service.api, staged, PatchOptions("inflight"))

    answer = asyncio.run(handler(HttpRequest({"type": "http", "method": "POST", "path": "/", "headers": []})))
    body = json.loads(answer.body)
    assert answer.status_code == 409 and body["error"]["type"] == InflightRefusedError.__name__
    assert "in-flight update refused" in body["error"]["message"] and "KV connector" in body["error"]["message"]
    assert core.model_executor.calls == [] and core._weight_version == "3"


def test_commit_drops_hashes_keeps_running_blocks_and_taints(vllm_objects):
    core = make_core(vllm_objects)
    a = running(core, vllm_objects, "cmpl-a-0", PROMPT)
    assert cached_tokens(core, vllm_objects, PROMPT) == 32  # two full blocks
    blocks = core.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[a.request_id]
    reply = commit(core)
    assert "error" not in reply, reply
    assert core.model_executor.calls == ["delta_patch"]
    assert (reply["label"], reply["previous_label"], core._weight_version) == ("4", "3", "4")
    assert reply["dropped_blocks"] == 2 and reply["dropped_blocks_in_use"] == 2 and reply["tainted"] == 1
    assert reply["switch"] == {"cmpl-a-0": 0} and reply["apply_ms"] == 0.7
    assert getattr(a, enginecore.TAINT_ATTR) is True
    # No new request reads the old blocks; the running request keeps them.
    assert cached_tokens(core, vllm_objects, PROMPT) == 0
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
    assert enginecore.prefix_state(core)["hashed_blocks"] == 0
    # The tainted request never inserts hashes again (its blocks mix both versions) ...
    pool = core.scheduler.kv_cache_manager.block_pool
    pool.cache_full_blocks(a, blocks, 0, 2, BLOCK, 0)
    assert cached_tokens(core, vllm_objects, PROMPT) == 0
    # ... while a request that starts after the commit caches what it computes.
    running(core, vllm_objects, "cmpl-b-0", PROMPT)
    assert cached_tokens(core, vllm_objects, PROMPT) == 32
    history = enginecore.engine_timeline(core)["history"]
    assert [(h["mode"], h["label"], h["switch"]) for h in history] == [("inflight", "4", {"cmpl-a-0": 0})]


def test_a_failed_rank_rolls_back_every_rank_and_drops_nothing(vllm_objects):
    err = error_reply(RuntimeError("disk on fire"))
    core = make_core(vllm_objects, executor=FakeExecutor(delta_patch=[OK[0], err], delta_rollback=ROLLED))
    a = running(core, vllm_objects, "cmpl-a-0", PROMPT)
    reply = commit(core)
    assert reply["error"]["status"] == 500
    assert "rolled back on every rank before the next forward step" in reply["error"]["message"]
    assert "rank 1: RuntimeError: disk on fire" in reply["error"]["message"]
    assert core.model_executor.calls == ["delta_patch", "delta_rollback"]
    assert core._weight_version == "3" and enginecore.engine_timeline(core)["history"] == []
    assert cached_tokens(core, vllm_objects, PROMPT) == 32  # the prefix cache is still valid
    assert not getattr(a, enginecore.TAINT_ATTR, False)
    # An executor that raises (a dead worker) is a failed commit too.
    core = make_core(vllm_objects, executor=FakeExecutor(delta_patch=RuntimeError("gone"), delta_rollback=ROLLED))
    reply = commit(core)
    assert "rolled back on every rank" in reply["error"]["message"] and "gone" in reply["error"]["message"]


def test_a_failed_rollback_stops_scheduling(vllm_objects):
    from vllm.v1.core.sched.interface import PauseState

    err = error_reply(RuntimeError("boom"))
    core = make_core(vllm_objects, executor=FakeExecutor(delta_patch=[OK[0], err], delta_rollback=[err, ROLLED[1]]))
    running(core, vllm_objects, "cmpl-a-0", PROMPT)
    reply = commit(core)
    assert reply["error"]["status"] == 500 and "could not be rolled back" in reply["error"]["message"]
    assert core.scheduler.pause_state == PauseState.PAUSED_ALL
    again = commit(core)
    assert "a rollback failed earlier" in again["error"]["message"]
    assert core.model_executor.calls == ["delta_patch", "delta_rollback"]  # nothing more was written
    assert enginecore.engine_timeline(core)["inconsistent"]


def test_reserved_names_and_labels_held_for_batches_in_flight(vllm_objects):
    class Core:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return ["forwarded", method]

        def _attach_weight_version(self, outputs):
            for eco in outputs.values():
                eco.weight_version = self._weight_version

    enginecore.patch_engine_core(Core)
    enginecore.patch_engine_core(Core)  # idempotent
    core = Core()
    inner = make_core(vllm_objects, batch_queue=deque(["batch N", "batch N+1"]))
    core.__dict__.update(inner.__dict__)
    assert core.collective_rpc("delta_status") == ["forwarded", "delta_status"]
    [reply] = core.collective_rpc(rpc.PATCH_ALL.name, kwargs={"ticket": "t", "version": 4})
    assert reply["batches_in_flight"] == 2 and core._weight_version == "4"

    def labels(n):
        out = []
        for _ in range(n):
            eco = SimpleNamespace(weight_version=None)
            core._attach_weight_version({0: eco})
            out.append(eco.weight_version)
        return out

    assert labels(1) == ["3"]  # batch N ran on the old weights
    core.batch_queue = deque(["batch N+1", "batch N+2"])  # N+1 ran on 3, N+2 on 4
    [reply] = core.collective_rpc(rpc.PATCH_ALL.name, kwargs={"ticket": "t", "version": 5})
    assert labels(4) == ["3", "4", "5", "5"]
    [label] = core.collective_rpc(rpc.SET_LABEL.name, kwargs={"version": 6, "mode": "keep"})
    assert label["label"] == "6" and labels(1) == ["6"]
    [err] = core.collective_rpc(rpc.SET_LABEL.name, kwargs={"bogus": 1})
    assert "error" in err  # a bad call answers an error, never raises across the utility


def test_update_request_accepts_inflight():
    assert from_wire(UpdateRequest, {"version": 3, "mode": "inflight"}).mode == "inflight"
    from vllm_delta.errors import BadRequestError

    with pytest.raises(BadRequestError, match="inflight"):
        from_wire(UpdateRequest, {"version": 3, "mode": "sometime"})


# -- prompt provenance (engine_core/provenance.py): which label computed each prompt position's KV ----
def prompt_spans(core, rid: str):
    """The reserved call PROMPT_VERSIONS for one request, as (label, start, end) tuples."""
    reply = enginecore.prompt_versions(core, ids=[rid, "never-seen"])
    assert "error" not in reply and set(reply["spans"]) <= {rid}, reply
    return [(s["version"], s["start"], s["end"]) for s in reply["spans"].get(rid, [])]


def test_prompt_provenance_keeps_the_version_of_prefix_cache_hits(vllm_objects):
    """A prefix computed at 3 and reused after the label became 4 without a cache reset (vLLM's own RL
    routes: /update_weights then /finish_weight_update): those positions report 3, the rest 4."""
    core = make_core(vllm_objects)
    running(core, vllm_objects, "cmpl-a-0", PROMPT)
    assert prompt_spans(core, "cmpl-a-0") == [("3", 0, 40)]
    core._weight_version = "4"  # what vLLM's set_weight_version does (the prefix cache stays)
    longer = PROMPT[:32] + list(range(100, 110))
    assert cached_tokens(core, vllm_objects, longer) == 32
    running(core, vllm_objects, "cmpl-b-0", longer)
    assert prompt_spans(core, "cmpl-b-0") == [("3", 0, 32), ("4", 32, 42)]
    # The same prompt again: every full block hits (3); vLLM recomputes the tail at 4.
    running(core, vllm_objects, "chatcmpl-c", PROMPT)
    assert prompt_spans(core, "chatcmpl-c") == [("3", 0, 32), ("4", 32, 40)]


def test_prompt_provenance_after_an_inflight_commit_is_recomputed(vllm_objects):
    """After an in-flight commit the taint rules drop every cached hash: a request reusing the prompt
    recomputes it and reports the new version only."""
    core = make_core(vllm_objects)
    running(core, vllm_objects, "cmpl-a-0", PROMPT)
    assert "error" not in commit(core)  # in flight, to 4
    running(core, vllm_objects, "cmpl-b-0", PROMPT)
    assert prompt_spans(core, "cmpl-b-0") == [("4", 0, 40)]
    assert prompt_spans(core, "cmpl-a-0") == [("3", 0, 40)]  # what a's KV was computed with stays known


def test_prompt_provenance_across_an_inflight_commit_in_the_middle_of_a_prefill(vllm_objects):
    """Chunked prefill (16 tokens a step): two chunks at 3, an in-flight commit, the last chunk at 4."""
    core = make_core(vllm_objects, chunked=True)
    req = request(vllm_objects, "cmpl-a-0", PROMPT)
    core.scheduler.add_request(req)
    core.scheduler.schedule()
    core.scheduler.schedule()
    # Not complete yet: what is known so far (the rest on the label now current).
    assert req.num_computed_tokens == 32 and prompt_spans(core, "cmpl-a-0") == [("3", 0, 40)]
    assert "error" not in commit(core)
    core.scheduler.schedule()
    assert req.num_computed_tokens == 40
    assert prompt_spans(core, "cmpl-a-0") == [("3", 0, 32), ("4", 32, 40)]


def test_prompt_provenance_of_a_recomputed_prompt(vllm_objects):
    """Keep mode: the commit in a pause, then vLLM's reset preempts the running request (and drops the
    prefix cache); its prompt is recomputed on the new weights and reports only them."""
    core = make_core(vllm_objects)
    req = running(core, vllm_objects, "cmpl-a-0", PROMPT)
    assert prompt_spans(core, "cmpl-a-0") == [("3", 0, 40)]
    assert "error" not in enginecore.write_between_steps(core, ticket="t", version=4, mode="keep")
    assert core.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert req.num_computed_tokens == 0
    core.scheduler.schedule()
    assert req.num_computed_tokens == 40 and prompt_spans(core, "cmpl-a-0") == [("4", 0, 40)]


def test_segments_stamps_and_label_changes():
    """The arithmetic alone: a lookup's hit segments from block stamps, label changes at the computed
    position, stamps of inserted blocks, prompt spans."""
    from types import SimpleNamespace as B

    t = provenance.Tracker(scheduler=B(requests={}), group_id=0, block_size=4)
    a = B(request_id="cmpl-a-0-abcd1234", num_prompt_tokens=10, num_computed_tokens=0)
    t.looked_up(a, (), 0)  # no hit: everything on the current label ("default": no core yet)
    assert getattr(a, provenance.SEGMENTS_ATTR) == [(0, "default")]
    a.num_computed_tokens = 6
    t.scheduler.requests = {"a": a}
    provenance.label_changed(t.scheduler, "2")
    a.num_computed_tokens = 10
    assert a._vllm_delta_segments == [(0, "default"), (6, "2")]
    blocks = [B(block_id=7), B(block_id=8), B(block_id=9)]
    t.cached(a, blocks, 0, 2)
    assert t.stamps == {7: [(0, "default")], 8: [(0, "default"), (2, "2")]}
    spans = provenance.prompt_spans(t.kept["cmpl-a-0"])
    assert [(s.version, s.start, s.end) for s in spans] == [("default", 0, 6), ("2", 6, 10)]
    # A later request hitting both blocks: their stamps, then the current label.
    t.scheduler._vllm_delta_core = B(_weight_version="3")
    b = B(request_id="chatcmpl-b-abcd1234", num_prompt_tokens=12, num_computed_tokens=0)
    t.looked_up(b, blocks[:2], 8)
    assert b._vllm_delta_segments == [(0, "default"), (6, "2"), (8, "3")]
    # A change at a position already counted for a label that never computed anything replaces it.
    c = B(
        request_id="c-abcd1234", num_prompt_tokens=4, num_computed_tokens=0, _vllm_delta_segments=[(0, "3"), (4, "4")]
    )
    c.num_computed_tokens = 4
    t.scheduler.requests = {"c": c}
    provenance.label_changed(t.scheduler, "5")
    assert c._vllm_delta_segments == [(0, "3"), (4, "5")]
    # A block of a request whose segments are unknown, and a hit on an unstamped block, say so.
    t.cached(B(request_id="x"), [B(block_id=1)], 0, 1)
    assert t.stamps[1] == [(0, "unknown")]
    d = B(request_id="d-abcd1234", num_prompt_tokens=6, num_computed_tokens=0)
    t.looked_up(d, [B(block_id=99)], 4)
    assert d._vllm_delta_segments == [(0, "unknown"), (4, "3")]
