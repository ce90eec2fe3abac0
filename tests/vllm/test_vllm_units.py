"""The plugin's pieces that need no running engine: successor rule, probe arithmetic, request parsing,
loader options, the CPU plain-weight switch and MLA backend choice, plugin registration."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_delta.apply.layout import Segment
from vllm_delta.errors import (
    BadRequestError,
    NotSuccessorError,
    ShapeMismatchError,
    UnsupportedModelError,
    VersionNotFoundError,
)
from vllm_delta.server_api import PrefetchRequest, UpdateRequest, from_wire, to_wire
from vllm_delta.store import DeltaStore
from vllm_delta.vllm.shared.options import LoaderOptions, server_store, split_extra_config
from vllm_delta.vllm.shared.plan import plan_update
from vllm_delta.vllm.worker.probe import CopyRecord, ProbeResult, finalize_layout, record_to_segment

pytestmark = pytest.mark.vllm_objects  # no engine, no server: make check-vllm-next runs them against the newest vLLM


# -- successor rule ------------------------------------------------------------------------------
def test_plan_follows_the_chain(llama_run):
    store = DeltaStore(llama_run.store)
    c = llama_run.checksums
    assert llama_run.kinds == {0: "anchor", 1: "delta", 2: "delta", 3: "delta", 4: "anchor", 5: "delta", 6: "delta"}
    p = plan_update(store, 1, c[1], 3)
    assert (p.versions, p.reanchor) == ([2, 3], False)
    assert p.nnz == llama_run.nnz[2] + llama_run.nnz[3] and p.bytes > 0
    # A newer anchor line of the same run: staged against the live weights, allowed.
    p = plan_update(store, 2, c[2], 5)
    assert (p.versions, p.reanchor) == ([4, 5], True)
    assert plan_update(store, 6, c[6], "latest").versions == []
    assert plan_update(store, 5, c[5], 6).versions == [6]


def test_plan_refuses_what_is_not_a_successor(llama_run):
    store = DeltaStore(llama_run.store)
    c = llama_run.checksums
    with pytest.raises(NotSuccessorError, match="older.*no backward path: version 4 is an anchor"):
        plan_update(store, 5, c[5], 3)  # back through the anchor 4: no backward path
    assert plan_update(store, 5, c[5], 3, allow_reanchor=True).versions == [0, 1, 2, 3]
    back = plan_update(store, 3, c[3], 1)  # back along the chain: the deltas 3 and 2 undone
    assert (back.versions, back.undone, back.target, back.reanchor) == ([3, 2], [3, 2], 1, False)
    with pytest.raises(NotSuccessorError, match="unknown"):
        plan_update(store, None, None, 2)
    assert plan_update(store, None, None, 2, allow_reanchor=True).versions == [0, 1, 2]
    with pytest.raises(NotSuccessorError, match="base checksum"):
        plan_update(store, 1, "0123456789abcdef", 2)
    with pytest.raises(NotSuccessorError, match="rewritten"):
        plan_update(store, 2, "0123456789abcdef", 5)
    with pytest.raises(VersionNotFoundError):
        plan_update(store, 1, c[1], 99)
    assert NotSuccessorError("x").http_status == 409


# -- probe arithmetic ----------------------------------------------------------------------------
def _meta_view(shape, narrow_dim=None, start=0, length=None):
    t = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    return t if narrow_dim is None else t.narrow(narrow_dim, start, length)


def test_record_to_segment_fused_and_sharded():
    qkv = torch.zeros(256, 128, dtype=torch.bfloat16)  # q 128 rows, k 64, v 64
    # v_proj (64, 128) lands at rows 192..255 of qkv_proj.
    dst = qkv.narrow(0, 192, 64)
    seg = record_to_segment((64, 128), CopyRecord(dst, (64, 128), (128, 1), 0), 0, qkv, torch.bfloat16)
    assert seg == Segment(0, 0, 64, 0, 128, 192 * 128, 128, 1)
    # Row-parallel shard: columns 64..127 of an HF (128, 128) weight into a local (128, 64) param.
    local = torch.zeros(128, 64, dtype=torch.bfloat16)
    src = _meta_view((128, 128), 1, 64, 64)
    seg = record_to_segment(
        (128, 128), CopyRecord(local, tuple(src.shape), src.stride(), src.storage_offset()), 3, local, torch.bfloat16
    )
    assert seg == Segment(3, 0, 128, 64, 64, 0, 64, 1)
    # Vocab shard: rows 256..499 of a (500, 128) embedding into the first rows of a padded (256, 128) shard.
    emb = torch.zeros(256, 128, dtype=torch.bfloat16)
    src = _meta_view((500, 128), 0, 256, 244)
    seg = record_to_segment(
        (500, 128), CopyRecord(emb[:244], (244, 128), src.stride(), src.storage_offset()), 1, emb, torch.bfloat16
    )
    assert seg == Segment(1, 256, 244, 0, 128, 0, 128, 1)
    # A 1-D norm weight.
    norm = torch.zeros(128, dtype=torch.bfloat16)
    seg = record_to_segment((128,), CopyRecord(norm, (128,), (1,), 0), 2, norm, torch.bfloat16)
    assert (seg.row0, seg.rows, seg.cols) == (0, 128, 1)


def test_record_to_segment_refuses_what_is_not_a_box_copy():
    p = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert "shapes" in record_to_segment((64, 128), CopyRecord(p, (128, 64), (64, 1), 0), 0, p, torch.bfloat16)
    transposed = _meta_view((128, 64)).t()
    why = record_to_segment((128, 64), CopyRecord(p, (64, 128), transposed.stride(), 0), 0, p, torch.bfloat16)
    assert "strides" in why
    f32 = torch.zeros(64, 128)
    assert "dtype" in record_to_segment((64, 128), CopyRecord(f32, (64, 128), (128, 1), 0), 0, f32, torch.bfloat16)


def _result(segments: dict[str, list[Segment]], shapes, fallback=None) -> ProbeResult:
    from vllm_delta.apply.layout import Layout

    return ProbeResult(Layout(["p0", "p1"], shapes, segments), {}, dict(fallback or {}))


def test_finalize_layout_owners_and_coverage():
    shapes = {"w": (8, 4), "norm": (4,)}
    rank0 = _result({"w": [Segment(0, 0, 4, 0, 4, 0, 4)], "norm": [Segment(1, 0, 4, 0, 1, 0, 1)]}, shapes)
    rank1 = _result({"w": [Segment(0, 4, 4, 0, 4, 0, 4)], "norm": [Segment(1, 0, 4, 0, 1, 0, 1)]}, shapes)
    boxes = [({"w": [(0, 4, 0, 4)], "norm": [(0, 4, 0, 1)]}, []), ({"w": [(4, 4, 0, 4)], "norm": [(0, 4, 0, 1)]}, [])]
    f0, f1 = finalize_layout(rank0, 0, boxes), finalize_layout(rank1, 1, boxes)
    assert [s.owner for s in f0.layout.segments["norm"]] == [True]
    assert [s.owner for s in f1.layout.segments["norm"]] == [False]  # a replica counts once
    assert [s.owner for s in f1.layout.segments["w"]] == [True]  # a shard is its own
    # A tensor that falls back on one rank falls back everywhere.
    boxes_fb = [(boxes[0][0], ["norm"]), (boxes[1][0], [])]
    assert "norm" in finalize_layout(rank1, 1, boxes_fb).fallback
    assert "norm" not in finalize_layout(rank1, 1, boxes_fb).layout.segments
    # Half a tensor held nowhere: refused, naming the tensor.
    with pytest.raises(ShapeMismatchError, match="16 of its 32"):
        finalize_layout(rank0, 0, [boxes[0], ({"norm": [(0, 4, 0, 1)]}, [])])
    # A box partly overlapping a lower rank's: refused.
    with pytest.raises(UnsupportedModelError, match="partly overlaps"):
        finalize_layout(rank1, 1, [boxes[0], ({"w": [(2, 6, 0, 4)], "norm": [(0, 4, 0, 1)]}, [])])


# -- requests and options ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, match",
    [
        ([1], "JSON object"),
        ({}, "required"),
        ({"version": -1}, "non-negative"),
        ({"version": "next"}, "non-negative"),
        ({"version": True}, "non-negative"),
        ({"version": 1, "mode": "pause"}, "mode"),
        ({"version": 1, "path": "/etc"}, "unknown fields"),
        ({"version": 1, "allow_reanchor": "yes"}, "allow_reanchor"),
        ({"version": 1, "method": "nccl"}, "method"),
        ({"version": 1, "fault": "commit@0"}, "test hook"),
    ],
)
def test_bad_requests(body, match, monkeypatch):
    monkeypatch.delenv("VLLM_DELTA_TEST_FAULTS", raising=False)
    with pytest.raises(BadRequestError, match=match):
        from_wire(UpdateRequest, body)
    assert BadRequestError("x").http_status == 400


def test_good_request_defaults():
    assert from_wire(UpdateRequest, {"version": "latest"}) == UpdateRequest("latest", False, "keep", "delta", None)
    r = from_wire(UpdateRequest, {"version": 3, "mode": "abort", "allow_reanchor": True})
    assert (r.version, r.allow_reanchor, r.mode) == (3, True, "abort")
    with pytest.raises(BadRequestError, match="unknown fields"):
        from_wire(PrefetchRequest, {"version": 3, "mode": "abort"})  # staging takes no mode


def test_rpc_messages_cross_vllms_msgpack_boundary():
    """Worker replies are plain values through vLLM's own serializer; sums are exact 64-bit ints."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_delta.checksums import MASK64
    from vllm_delta.errors import WorkerError
    from vllm_delta.vllm.shared.messages import ErrorPayload, Patched, RankSums, StagePoll, StageSummary, WorkerStatus
    from vllm_delta.vllm.shared.rpc import error_reply, reply_error

    def wire(value):
        return MsgpackDecoder().decode(MsgpackEncoder().encode(to_wire(value)))

    summary = StageSummary([3, 4], {"a": MASK64, "b": 0}, nnz=7, bytes=96, stage_ms=1.5, timings={"total": 1.0})
    assert from_wire(StagePoll, wire(StagePoll.of(summary))).summary == summary
    assert from_wire(StagePoll, wire(StagePoll.of(None))) == StagePoll.of(None)
    assert wire(summary)["partials"] == {"a": "ffffffffffffffff", "b": "0000000000000000"}
    assert from_wire(RankSums, wire(RankSums(2, {"a": 1 << 63}))) == RankSums(2, {"a": 1 << 63})
    status = WorkerStatus(1, None, None, False, ["x"], [])
    assert from_wire(WorkerStatus, wire(status)) == status
    assert from_wire(Patched, wire(Patched(0.25))).apply_ms == 0.25
    reply = MsgpackDecoder().decode(MsgpackEncoder().encode(error_reply(NotSuccessorError("no", version=3))))
    err = reply_error(reply)
    assert err == ErrorPayload("NotSuccessorError", 409, "no (version 3)") and reply_error({"apply_ms": 1.0}) is None
    exc = err.to_error(rank=1)
    assert (
        isinstance(exc, WorkerError)
        and exc.http_status == 409
        and str(exc) == "rank 1: NotSuccessorError: no (version 3)"
    )


def test_renamed_server_names_keep_their_wire_names(monkeypatch):
    """Issue 37 renamed the server's commit a patch: what clients match on is unchanged. A failed patch
    answers with `type` "CommitFailedError" over HTTP and across RPC (and is raised again as the same
    class in the API process); the test hook's "commit@<rank>" still names the patch step; the old
    Python names import as aliases."""
    from vllm_delta import errors, server_api
    from vllm_delta.vllm.api_server.endpoints import _error
    from vllm_delta.vllm.shared import rpc
    from vllm_delta.vllm.shared.messages import ErrorPayload

    failed = errors.PatchFailedError("update to version 3 failed and was rolled back", version=3)
    assert errors.error_type(failed) == errors.error_type(errors.PatchFailedError) == "CommitFailedError"
    assert errors.error_type(NotSuccessorError("no")) == "NotSuccessorError"  # not inherited by other errors
    body = _error(failed).body
    assert json.loads(body)["error"]["type"] == "CommitFailedError"
    payload = ErrorPayload.from_exception(failed)
    assert (payload.type, payload.status) == ("CommitFailedError", 500)
    assert rpc._ENGINE_ERRORS["CommitFailedError"] is errors.PatchFailedError
    assert rpc.Replies.decode(ErrorPayload, [rpc.error_reply(failed)]).failed_with(errors.PatchFailedError)
    assert errors.CommitFailedError is errors.PatchFailedError and server_api.CommitSwitch is server_api.PatchSwitch
    assert server_api.StageRequest is PrefetchRequest and server_api.StageResult is server_api.PrefetchResult
    assert server_api.PrefetchRequest is PrefetchRequest and server_api.PrefetchResult is server_api.PrefetchResult

    monkeypatch.setenv(server_api.FAULTS_ENV, "1")
    for fault in ("patch@1", "commit@1", "patch@0:1", "commit@0:1"):
        assert server_api.fault_hits(fault, "patch", 0, 1), fault
        assert not server_api.fault_hits(fault, "stage", 0, 1) and not server_api.fault_hits(fault, "patch", 0, 0)
    assert server_api.fault_hits("stage@1", "stage", 0, 1) and not server_api.fault_hits("stage@1", "patch", 0, 1)
    assert not server_api.fault_hits("write@1", "patch", 0, 1) and not server_api.fault_hits("patch", "patch", 0, 1)
    monkeypatch.delenv(server_api.FAULTS_ENV)
    assert not server_api.fault_hits("patch@1", "patch", 0, 1)  # never without the hook enabled


def test_update_result_answers():
    from vllm_delta.server_api import UpdateResult

    common = dict(apply_ms=0.0, stage_ms=0.0, nnz=0, bytes=0, applied=[], mode="keep", method="delta")
    noop = to_wire(UpdateResult(version=5, previous_version=5, pause_ms=0.0, **common))
    assert list(noop) == [
        "version",
        "previous_version",
        "pause_ms",
        "apply_ms",
        "stage_ms",
        "nnz",
        "bytes",
        "applied",
        "mode",
        "method",
    ]
    full = UpdateResult(
        version=6,
        previous_version=None,
        pause_ms=1.23456,
        apply_ms=0.5,
        stage_ms=2.0,
        nnz=9,
        bytes=99,
        applied=[6],
        mode="wait",
        method="vllm",
        reanchored=False,
        prefetched=True,
        elements_written=9,
        staged_bytes=120,
        timings={"total": 1.0},
        decoded_per_rank=[5, 4],
    )
    out = to_wire(full)
    assert out["pause_ms"] == 1.235 and out["previous_version"] is None and out["prefetched"] is True
    assert out["reanchored"] is False and out["timings"] == {"total": 1.0} and out["staged_bytes"] == 120
    assert out["decoded_per_rank"] == [5, 4] and from_wire(UpdateResult, out).decoded_per_rank == [5, 4]


def test_loader_options(monkeypatch):
    ours, rest = split_extra_config({"delta_store": "/s", "delta_version": 3, "num_threads": 2})
    assert rest == {"num_threads": 2}
    opts = LoaderOptions.from_extra_config(ours)
    assert (opts.store.uri, opts.version, opts.validate) == ("/s", 3, True)
    with pytest.raises(ValueError, match="delta_store"):
        LoaderOptions.from_extra_config({"delta_version": 1})
    with pytest.raises(ValueError, match="delta_version"):
        LoaderOptions.from_extra_config({"delta_store": "/s", "delta_version": "newest"})
    assert server_store("delta", '{"delta_store": "s3://b/run"}').uri == "s3://b/run"
    monkeypatch.delenv("VLLM_DELTA_STORE", raising=False)
    assert server_store("auto", {}) is None
    monkeypatch.setenv("VLLM_DELTA_STORE", "/data/run")
    assert server_store("auto", {}).uri == "/data/run"


# -- vLLM registration ---------------------------------------------------------------------------
def test_plugin_registers_everything_once():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor import model_loader
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_delta.vllm import plugin
    from vllm_delta.vllm.worker.loader import DeltaModelLoader

    plugin.register()
    plugin._done = False  # a second process-level call must be harmless too (vLLM calls it repeatedly)
    plugin.register()
    assert model_loader._LOAD_FORMAT_TO_MODEL_LOADER["delta"] is DeltaModelLoader
    assert WeightTransferEngineFactory._registry["delta"]().__name__ == "DeltaWeightTransferEngine"
    for name in ("delta_status", "delta_stage_start", "delta_patch", "delta_rollback"):
        assert callable(getattr(Worker, name))


def test_cpu_linears_keep_their_weight():
    from vllm.model_executor.layers import utils

    from vllm_delta.vllm.postprocess.cpu_linear import keep_plain_cpu_linears

    keep_plain_cpu_linears()
    layer = torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    before = layer.weight
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.weight is before and layer.weight.shape == (64, 128)
    assert layer.cpu_linear is torch.nn.functional.linear
    # The layer computes with its live weight: an in-place write changes its output.
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y0 = layer.cpu_linear(x, layer.weight, None)
    with torch.no_grad():
        layer.weight[0, 0] += 1.0
    assert not torch.equal(y0, layer.cpu_linear(x, layer.weight, None))


def test_mla_models_take_the_reference_cpu_backend(tmp_path, llama_run):
    """vLLM's AMX_MLA backend (chosen on CPUs with AMX tiles) empties kv_b_proj.weight after packing its
    own copies; the plugin picks the reference CPU_MLA backend unless the user named one (cpu_mla.py)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_delta.testing.models import TinyModelSpec, make_tiny_model
    from vllm_delta.vllm import plugin

    plugin.register()
    mla = str(tmp_path / "dsv2")
    make_tiny_model(mla, TinyModelSpec(arch="deepseek_v2", num_heads=2, num_kv_heads=2, vocab_size=500, num_experts=4))

    def config(model: str, backend: str | None):
        args = EngineArgs(
            model=model, dtype="bfloat16", max_model_len=256, enforce_eager=True, attention_backend=backend
        )
        return args.create_engine_config()

    auto = config(mla, None)
    assert auto.attention_config.backend == AttentionBackendEnum.CPU_MLA
    assert auto.cache_config.block_size == 16  # the platform's rule for the reference backend applied
    assert config(mla, "AMX_MLA").attention_config.backend == AttentionBackendEnum.AMX_MLA  # the user's choice
    assert config(llama_run.model_dir, None).attention_config.backend is None  # not an MLA model


# -- the worker-side replica on a toy model (no engine, real vLLM sparse path) -------------------
class ToyModel(torch.nn.Module):
    """Loaders like vLLM's: q/k/v fused into one parameter, a plain copy, and one transposing loader."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
        self.wt = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, {"q": 0, "k": 4, "v": 8}[name], 4).copy_(w)
                loaded.add("qkv")
            elif name == "norm":
                self.norm.data.copy_(w)
                loaded.add("norm")
            elif name == "wt":
                self.wt.data.copy_(w.t())  # not a box copy: the probe must send it to the fallback
                loaded.add("wt")
        return loaded


def _toy_versions(tmp_path):
    from vllm_delta.checksums import checksum
    from vllm_delta.trainer import Publisher

    gen = torch.Generator().manual_seed(0)
    shapes = {"q": (4, 4), "k": (4, 4), "v": (4, 4), "norm": (4,), "wt": (6, 4)}
    w = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    images, store = [], str(tmp_path / "toy")
    with Publisher(store, anchor_every=100) as pub:
        for version in range(3):
            pub.publish({n: t.to(torch.bfloat16) for n, t in w.items()}, version=version)
            images.append({n: t.to(torch.bfloat16) for n, t in w.items()})
            for t in w.values():
                t += 0.05 * torch.randn(t.shape, generator=gen)
    return DeltaStore(store), images, checksum


def test_replica_on_a_toy_model(tmp_path):
    from vllm_delta.reconstruct import open_chain, replay_tensor
    from vllm_delta.vllm.worker.replica import DeltaReplica, Served

    store, images, checksum = _toy_versions(tmp_path)
    model = ToyModel()
    files = open_chain(store, 0)
    model.load_weights((n, replay_tensor(files, n)) for n in files[-1].header.tensors)
    replica = DeltaReplica(model)
    fallback = replica.probe_layout({n: tuple(e.shape) for n, e in files[-1].header.tensors.items()})
    assert list(fallback) == ["wt"] and "strides" in fallback["wt"]
    segs = replica.probe.layout.segments
    assert [s.dst_offset for n in ("q", "k", "v") for s in segs[n]] == [0, 16, 32]
    replica.fallback.set_shadow("wt", replay_tensor(files, "wt"))
    replica.served = Served.from_header(files[-1].header)
    assert f"{sum_all(replica):016x}" == checksum(images[0])
    # Two versions in one update, staged then committed; the transposed tensor goes through vLLM's path.
    summary = replica.stage("t", [store.open(1), store.open(2)])
    assert summary.nnz > 0 and set(summary.partials) >= {"q", "wt"}
    replica.patch("t")
    assert f"{sum_all(replica):016x}" == checksum(images[2])
    assert torch.equal(model.wt.data, images[2]["wt"].t())
    assert torch.equal(model.qkv.data[4:8], images[2]["k"])
    assert replica.served.version == 2
    replica.rollback("t")
    assert f"{sum_all(replica):016x}" == checksum(images[0]) and replica.served.version == 0
    assert torch.equal(model.wt.data, images[0]["wt"].t())


def sum_all(replica) -> int:
    from vllm_delta.checksums import combine

    return combine(replica.live_sums().items())


def test_quantized_models_are_refused():
    from vllm_delta.vllm.worker.probe import check_supported

    model = ToyModel()
    model.quant_config = object()
    with pytest.raises(UnsupportedModelError, match="quantized"):
        check_supported(model)
    int_model = torch.nn.Module()
    int_model.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)
    with pytest.raises(UnsupportedModelError, match="int8"):
        check_supported(int_model)


# -- the service's deadline and status while busy (a fake engine, a slow store) ---------------------
def test_update_deadline_and_status_while_busy(llama_run, tmp_path):
    import asyncio
    import time

    from vllm_delta.errors import StoreTimeoutError
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.shared.messages import RankSums, WorkerStatus
    from vllm_delta.vllm.shared.options import StoreSpec

    class FakeEngine:
        async def collective_rpc(self, name, timeout=None, kwargs=None):
            if name == "delta_status":
                live = {"w": 7} if kwargs.get("live_sums") else None
                return [to_wire(WorkerStatus(0, 0, llama_run.checksums[0], True, live_sums=live))]
            if name == "delta_live_sums":
                return [to_wire(RankSums(0, {"w": 7}))]
            raise AssertionError(f"unexpected RPC {name}")

    class SlowStore(DeltaStore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            fetch = self.files.local_paths  # where a version's files are fetched (store/files.py)

            def slowly(rec):
                time.sleep(2.0)  # a store that answers, slowly
                return fetch(rec)

            self.files.local_paths = slowly  # type: ignore[method-assign]

    async def scenario():
        svc = DeltaService.of(
            FakeEngine(), StoreSpec(llama_run.store, update_timeout_s=0.5), store=SlowStore(llama_run.store)
        )
        idle = await svc.status()
        assert idle.version == 0 and idle.update_in_progress is None
        task = asyncio.create_task(svc.update(UpdateRequest(1)))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        busy = await svc.status()  # answers at once, from the last state known
        assert time.monotonic() - t0 < 1.0  # not after the 2 s store call
        assert busy.update_in_progress is not None and busy.update_in_progress.version == 1
        assert (busy.version, busy.checksum) == (idle.version, idle.checksum)
        with pytest.raises(StoreTimeoutError, match="did not reach its pause within"):
            await task
        assert svc.operations.in_progress is None and svc.operations.last_failure.status == 504
        assert (await svc.status()).last_failure.type == "StoreTimeoutError"

    asyncio.run(scenario())


# -- the loader's start version --------------------------------------------------------------------
def test_a_server_started_at_latest_loads_no_version_marked_bad(tmp_path):
    """`"delta_version": "latest"` loads the newest version whose chain passes no mark (a server restarted
    after its store's newest version was marked must not serve it); a store with no usable version is a
    clear error at start-up. vLLM's own LoadConfig and the registered loader class, no engine."""
    from vllm.config import LoadConfig

    from vllm_delta import Publisher
    from vllm_delta.vllm.worker.loader import DeltaModelLoader

    uri = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(5)
    w = {"w": torch.randn(32, 16, generator=gen).to(torch.bfloat16)}
    with Publisher(uri, anchor_every=3) as pub:  # anchors 0, 3
        for v in range(5):
            w["w"][v % 32, :4] += 1
            pub.publish(w, version=v)

    def start_version() -> int:
        cfg = LoadConfig(load_format="delta", model_loader_extra_config={"delta_store": uri})
        loader = DeltaModelLoader(cfg)
        return loader._chain()[-1].version

    store = DeltaStore(uri)
    assert start_version() == 4
    store.mark_bad(4, "diverged")
    assert start_version() == 3
    store.mark_bad(3, "diverged")  # the newest anchor: the newest usable version is before it
    assert start_version() == 2
    store.mark_bad(0, "diverged")
    with pytest.raises(VersionNotFoundError, match="no usable version"):
        start_version()


@pytest.mark.parametrize("raw", [b"null", b"[]", b'[{"version": 1}]', b"3", b"-1.5", b'"latest"', b"true"])
def test_a_body_that_is_not_an_object_is_400_on_every_post_route(raw, monkeypatch):
    """null, arrays, numbers, strings and booleans as a whole body: 400 on every /v1/delta/* POST (the
    real endpoint plugin's routes in a FastAPI app; the service is never reached)."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from vllm_delta.vllm.api_server import endpoints

    monkeypatch.setenv("VLLM_DELTA_TEST_FAULTS", "1")  # mounts the test route too

    class NoService:
        def __getattr__(self, name):
            def reached(*args, **kwargs):
                raise AssertionError(f"a malformed body reached the service ({name})")

            return reached

    app = FastAPI()
    endpoints.DeltaEndpointPlugin().attach_router(app)
    setattr(app.state, endpoints.STATE_KEY, NoService())
    posts = sorted(
        r.path for r in app.routes if r.path.startswith(endpoints.PREFIX) and "POST" in getattr(r, "methods", ())
    )
    assert posts == ["/v1/delta/stage", "/v1/delta/test/heap", "/v1/delta/update_weights"]
    with TestClient(app) as client:
        for path in posts:
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert r.json()["error"]["type"] == "BadRequestError"
            assert "must be a JSON object" in r.json()["error"]["message"]
