"""Data parallelism (`--data-parallel-size N`: one API process, N engine cores) without engines running.

What real servers can't show on demand is tested here, with vLLM's own client classes and the plugin's
real code on both sides of the process boundary; only the engines' processes are stand-ins:

* the transport: vLLM's `DPLBAsyncMPClient` (its real methods; its zmq send replaced by a dispatch to
  stand-in engine cores) sends `collective_rpc` to every engine but returns engine 0's replies only;
  the plugin's transport gets every engine's (`call_utility_all_async`);
* writing across engines x ranks: the API process's `patch_through_engine_core` over vLLM's client and
  the real engine-core calls (PATCH_ALL / ROLLBACK_ALL on real vLLM `Scheduler`s), worker ranks that
  hold a version and fail on command: every engine paused during the writes; a rank failing on one
  engine rolls back every rank of every engine (labels back, "rollback" in the timelines); a failed
  rollback stops every engine; a refusal on one engine is a 409 with the others' writes undone;
* staging and verification per world: each engine's copy verified against the same target (a
  mismatch on one engine names it, nothing is written anywhere); the experts of a MoE model split
  across engines verified as one copy;
* the service over two engines of toy replicas (the real worker methods): an update reaches both,
  status and verification answer per engine, a staging or write fault on engine 1 leaves both
  engines on the version before, a weight changed on one engine is named, engines that disagree
  are loud (status, readiness, metric) and refused.

The same behaviour on a real data-parallel server: test_vllm_data_parallel.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from test_vllm_inflight_units import PROMPT, cached_tokens, make_core, running
from test_vllm_inflight_units import vllm_objects as _scheduler_objects  # noqa: F401 - its module fixture
from test_vllm_round_trips import _publish, toy_replica

from vllm_delta.checksums import to_hex
from vllm_delta.errors import (
    ChecksumMismatchError,
    DeltaError,
    EnginesDisagreeError,
    InflightRefusedError,
    PatchFailedError,
    RollbackFailedError,
    WorkerError,
)
from vllm_delta.server_api import FAULTS_ENV, UpdateRequest, to_wire
from vllm_delta.vllm.engine_core import calls as enginecore
from vllm_delta.vllm.shared import rpc
from vllm_delta.vllm.shared.messages import Patched, StageSummary
from vllm_delta.vllm.shared.rpc import error_reply
from vllm_delta.vllm.shared.two_phase import PatchOptions, Staged, TwoPhaseUpdate, Update, worlds


@pytest.fixture
def objs(request):
    """Real vLLM Scheduler objects (test_vllm_inflight_units' module fixture `vllm_objects`)."""
    return request.getfixturevalue("_scheduler_objects")


# -- vLLM's client, engines as stand-ins -----------------------------------------------------------
class EngineCoreStandIn:
    """vLLM's EngineCore as its utility dispatch sees it: collective_rpc through its executor, the pause on
    its scheduler. The plugin's reserved names are patched in (enginecore.patch_engine_core)."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return self.model_executor.collective_rpc(method, timeout, args, kwargs)

    def _attach_weight_version(self, outputs):
        pass

    def pause_scheduler(self, mode="abort", clear_cache=True):
        self.events.append(f"pause:{mode}")
        if self.scheduler is not None:
            from vllm.v1.core.sched.interface import PauseState

            self.scheduler.set_pause_state(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)

    def resume_scheduler(self):
        self.events.append("resume")
        if self.scheduler is not None:
            from vllm.v1.core.sched.interface import PauseState

            self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.events.append("reset_prefix_cache")
        return True


enginecore.patch_engine_core(EngineCoreStandIn)


def vllm_client(cores: list[EngineCoreStandIn]):
    """vLLM's own engine-core client over these engines: DPLBAsyncMPClient (several) or AsyncMPClient (one),
    built without its processes; only `_call_utility_async` (a zmq round trip to one engine) is replaced."""
    from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient

    client = object.__new__(DPLBAsyncMPClient if len(cores) > 1 else AsyncMPClient)
    client.core_engines = [e.to_bytes(2, "little") for e in range(len(cores))]
    client.core_engine = client.core_engines[0]

    async def call_one(method, *args, engine):
        await asyncio.sleep(0)  # a round trip
        return getattr(cores[client.core_engines.index(engine)], method)(*args)

    client._call_utility_async = call_one
    return client


class AsyncLLMStandIn:
    """The API process's EngineClient: vLLM's AsyncLLM methods over its engine-core client."""

    from vllm.v1.engine.async_llm import AsyncLLM as _AsyncLLM

    collective_rpc = _AsyncLLM.collective_rpc
    pause_generation = _AsyncLLM.pause_generation
    resume_generation = _AsyncLLM.resume_generation
    reset_prefix_cache = _AsyncLLM.reset_prefix_cache

    def __init__(self, cores):
        self.engine_core = vllm_client(cores)


def test_vllms_data_parallel_client_answers_engine_0_only_and_the_transport_every_engine():
    class Answers:
        def __init__(self, engine):
            self.engine = engine

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [f"engine {self.engine} rank {r}: {method}" for r in range(2)]

    client = AsyncLLMStandIn([Answers(0), Answers(1), Answers(2)])

    async def scenario():
        own = await client.collective_rpc("delta_status")  # what EngineClient.collective_rpc gives
        ours = await rpc.engine_client_transport(client, 5.0)("delta_status", {})
        return own, ours

    own, ours = asyncio.run(scenario())
    assert own == ["engine 0 rank 0: delta_status", "engine 0 rank 1: delta_status"]  # engines 1, 2 unseen
    assert ours == [[f"engine {e} rank {r}: delta_status" for r in range(2)] for e in range(3)]
    # One engine (vLLM's AsyncMPClient) and an engine client without vLLM's client: one engine's replies.
    assert asyncio.run(rpc.engine_client_transport(AsyncLLMStandIn([Answers(0)]), 5.0)("x", {})) == [
        ["engine 0 rank 0: x", "engine 0 rank 1: x"]
    ]

    class Plain:
        async def collective_rpc(self, name, timeout=None, kwargs=None):
            return ["only"]

    assert asyncio.run(rpc.engine_client_transport(Plain(), 5.0)("x", {})) == [["only"]]


def test_replies_say_who_answered():
    ok, bad = {"apply_ms": 1.0}, error_reply(RuntimeError("disk on fire"))
    replies = rpc.Replies.of_engines(StageSummary, [[], []])
    assert replies.all() == [] and replies.engines == 1  # nobody answered: no engine known
    replies = rpc.Replies.of_engines(Patched, [[ok, ok], [ok, bad]])
    assert replies.engines == 2 and replies.failure() == "engine 1 rank 1: RuntimeError: disk on fire"
    with pytest.raises(WorkerError, match="engine 1 rank 1: RuntimeError: disk on fire"):
        replies.per_engine()
    one = rpc.Replies.decode(Patched, [ok, bad])
    assert one.failure() == "rank 1: RuntimeError: disk on fire"  # one engine: as before
    cores = rpc.Replies.of_engines(Patched, [[ok], [bad]], engine_calls=True)
    assert cores.failure() == "engine 1: RuntimeError: disk on fire"


# -- writing every rank of every engine ------------------------------------------------------------
class WorkerRanks:
    """One engine's worker ranks as its executor reaches them: the version each holds, every call, and
    failures on command (a rank that fails its write restores itself, as DeltaReplica.write does)."""

    def __init__(self, n: int = 2, *, fail_write=(), fail_rollback=()):
        self.held = [3] * n
        self.calls: list[str] = []
        self.paused_at_write: list[object] = []
        self.fail_write, self.fail_rollback = set(fail_write), set(fail_rollback)
        self.core = None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        replies = []
        for r in range(len(self.held)):
            if method == "delta_patch":
                self.paused_at_write.append(self.core.scheduler.pause_state)
                if r in self.fail_write:
                    replies.append(error_reply(RuntimeError("disk on fire")))
                    continue
                self.held[r] = 4
                replies.append({"apply_ms": 0.5 + r})
            elif method == "delta_rollback":
                if r in self.fail_rollback:
                    replies.append(error_reply(RuntimeError("rollback buffer lost")))
                    continue
                replies.append({"rolled_back": self.held[r] == 4})
                self.held[r] = 3
            else:
                raise AssertionError(f"unexpected worker call {method}")
        return replies


def engines(objs, ranks: list[WorkerRanks], *, connector_on=()):
    cores = []
    for e, workers in enumerate(ranks):
        core = EngineCoreStandIn()
        core.__dict__.update(make_core(objs, connector=e in connector_on, executor=workers).__dict__)
        core.events = []
        workers.core = core
        cores.append(core)
    return cores


def write(objs, cores, mode="keep", version=4):
    from vllm_delta.vllm.api_server.api_process import ApiProcess
    from vllm_delta.vllm.api_server.worker_update import patch_through_engine_core
    from vllm_delta.vllm.shared.options import StoreSpec

    api = ApiProcess.of(AsyncLLMStandIn(cores), StoreSpec("/nonexistent-store"))
    staged = Staged(Update("t", [version], version), [], 0.0)
    return asyncio.run(patch_through_engine_core(api, staged, PatchOptions(mode)))


def history(core):
    return [(h["mode"], h["label"]) for h in enginecore.engine_timeline(core)["history"]]


def test_every_engine_writes_in_one_pause(objs):
    from vllm.v1.core.sched.interface import PauseState

    ranks = [WorkerRanks(2) for _ in range(3)]
    cores = engines(objs, ranks)
    applied = write(objs, cores)
    assert [w.held for w in ranks] == [[4, 4]] * 3
    assert [c._weight_version for c in cores] == ["4"] * 3
    assert all(w.paused_at_write == [PauseState.PAUSED_ALL] * 2 for w in ranks)  # every engine paused first
    assert [c.events for c in cores] == [["pause:keep", "reset_prefix_cache", "resume"]] * 3
    assert applied.apply_ms == 1.5 and applied.inflight is None
    assert [history(c) for c in cores] == [[("keep", "4")]] * 3


@pytest.mark.parametrize("mode", ["keep", "inflight"])
def test_a_rank_failing_on_one_engine_rolls_back_every_engine(objs, mode):
    ranks = [WorkerRanks(2), WorkerRanks(2, fail_write=[1]), WorkerRanks(2)]
    cores = engines(objs, ranks)
    request = running(cores[0], objs, "cmpl-a-0", PROMPT)  # holds KV on engine 0
    running(cores[1], objs, "cmpl-b-0", PROMPT)
    with pytest.raises(PatchFailedError) as exc:
        write(objs, cores, mode)
    message = str(exc.value)
    assert "rolled back on every engine" in message and "engine 1" in message and "rank 1" in message
    assert [w.held for w in ranks] == [[3, 3]] * 3  # nothing changed anywhere
    assert [c._weight_version for c in cores] == ["3"] * 3
    # Engines 0 and 2 wrote, then undid it (ROLLBACK_ALL); engine 1 rolled back its own ranks.
    assert [w.calls for w in ranks] == [["delta_patch", "delta_rollback"]] * 3
    assert history(cores[0]) == history(cores[2]) == [(mode, "4"), ("rollback", "3")]
    assert history(cores[1]) == []
    if mode == "keep":  # nothing ran between the writes and the rollback: caches stay valid, all resumed
        assert [c.events for c in cores] == [["pause:keep", "resume"]] * 3
        assert cached_tokens(cores[0], objs, PROMPT) == 32
    else:  # engine 0 may have stepped on the new weights: its hashes dropped, its running request tainted
        assert getattr(request, enginecore.TAINT_ATTR) is True
        assert enginecore.engine_timeline(cores[0])["history"][1]["switch"] == {"cmpl-a-0": 0}
        assert cached_tokens(cores[0], objs, PROMPT) == 0
        assert cached_tokens(cores[1], objs, PROMPT) == 32  # the failed engine wrote nothing
        assert [c.events for c in cores] == [[]] * 3  # no pause


@pytest.mark.parametrize("mode", ["keep", "inflight"])
def test_a_failed_rollback_stops_every_engine(objs, mode):
    from vllm.v1.core.sched.interface import PauseState

    ranks = [WorkerRanks(2), WorkerRanks(2, fail_write=[0]), WorkerRanks(2, fail_rollback=[1])]
    cores = engines(objs, ranks)
    with pytest.raises(RollbackFailedError, match="could not be rolled back.*engine 2"):
        write(objs, cores, mode)
    assert ranks[0].held == [3, 3] and ranks[2].held == [3, 4]  # engine 2's rank 1 could not be undone
    assert enginecore.engine_timeline(cores[2])["inconsistent"]
    assert all(c.scheduler.pause_state != PauseState.UNPAUSED for c in cores)  # nothing schedules
    assert all("resume" not in c.events for c in cores)
    # Later updates are refused by the inconsistent engine; the others end on what they held.
    with pytest.raises(RollbackFailedError, match="a rollback failed earlier"):
        write(objs, cores, mode, version=5)
    assert ranks[0].held == [3, 3]


def test_an_inflight_refusal_on_one_engine_is_409_and_undoes_the_others(objs):
    ranks = [WorkerRanks(2), WorkerRanks(2), WorkerRanks(2)]
    cores = engines(objs, ranks, connector_on=[1])
    with pytest.raises(InflightRefusedError, match="engine 1.*KV connector.*no engine keeps any writes"):
        write(objs, cores, "inflight")
    assert [w.held for w in ranks] == [[3, 3]] * 3 and [c._weight_version for c in cores] == ["3"] * 3
    assert ranks[1].calls == []  # refused before writing


@pytest.mark.parametrize("mode", ["keep", "inflight"])
def test_eplb_is_refused_by_every_engine_core(objs, mode):
    """A server with EPLB (shared/eplb.py): every engine core refuses its PATCH_ALL before any rank is
    called; where only one engine's config says so (the check is each engine's own), the others' writes
    are undone and the refusal names that engine."""
    import copy

    from vllm_delta.errors import EplbRefusedError

    def with_eplb(core):
        core.vllm_config = copy.deepcopy(core.vllm_config)
        core.vllm_config.parallel_config.enable_eplb = True

    for n in (1, 2):  # one engine (no data parallelism) and two: the same 409
        ranks = [WorkerRanks(2) for _ in range(n)]
        cores = engines(objs, ranks)
        for core in cores:
            with_eplb(core)
        with pytest.raises(EplbRefusedError, match="--enable-eplb"):
            write(objs, cores, mode)
        assert [w.calls for w in ranks] == [[]] * n and [w.held for w in ranks] == [[3, 3]] * n
        assert [c._weight_version for c in cores] == ["3"] * n and [history(c) for c in cores] == [[]] * n

    ranks = [WorkerRanks(2) for _ in range(3)]
    cores = engines(objs, ranks)
    with_eplb(cores[1])
    with pytest.raises(EplbRefusedError, match="engine 1.*--enable-eplb"):
        write(objs, cores, mode)
    assert [w.held for w in ranks] == [[3, 3]] * 3 and [c._weight_version for c in cores] == ["3"] * 3
    assert ranks[1].calls == []  # refused before writing
    assert history(cores[0]) == history(cores[2]) == [(mode, "4"), ("rollback", "3")]


def test_one_engine_answers_as_before(objs):
    ranks = [WorkerRanks(2, fail_write=[1])]
    cores = engines(objs, ranks)
    with pytest.raises(PatchFailedError) as exc:
        write(objs, cores)
    assert str(exc.value).startswith("update to version 4 failed and was rolled back on every rank: rank 1:")
    assert "engine" not in str(exc.value)
    with pytest.raises(InflightRefusedError) as exc:
        write(objs, engines(objs, [WorkerRanks(2)], connector_on=[0]), "inflight")
    assert str(exc.value).startswith("in-flight update refused: a KV connector")


# -- staging and verification per world -----------------------------------------------------------
class StagedOnly(TwoPhaseUpdate[str]):
    """The protocol's order with the ranks' staging replies given: what it verifies, writes, releases."""

    def __init__(self, per_engine: list[list[StageSummary | Exception]], current: dict, target: dict):
        raw = [[error_reply(s) if isinstance(s, Exception) else to_wire(s) for s in e] for e in per_engine]
        self.replies = rpc.Replies.of_engines(StageSummary, raw)
        self.current = current
        self.header = SimpleNamespace(
            version=4, tensors={n: SimpleNamespace(checksum=to_hex(v)) for n, v in target.items()}
        )
        self.written = False
        self.released: list[str] = []
        self.dropped: list[int] = []

    async def stage_ranks(self, update):
        return self.replies

    async def verification_basis(self, update):
        return self.current, self.header

    async def patch_ranks(self, staged, options):
        self.written = True
        return "written"

    async def release(self, ticket):
        self.released.append(ticket)

    async def drop_cached(self, versions):
        self.dropped = versions


def summary(partials: dict[str, int], rank=0, world_size=1) -> StageSummary:
    return StageSummary([4], partials, nnz=1, bytes=1, stage_ms=1.0, rank=rank, world_size=world_size)


def apply(steps: StagedOnly) -> str:
    return asyncio.run(steps.apply(Update("t", [4], 4), PatchOptions()))


def test_every_engines_copy_is_verified_before_any_writes():
    current, target = {"w": 10, "e": 100}, {"w": 13, "e": 107}
    good = [summary({"w": 1, "e": 7}, 0, 2), summary({"w": 2}, 1, 2)]  # an engine's two TP ranks
    steps = StagedOnly([good, good, good], current, target)
    assert apply(steps) == "written" and steps.released == ["t"]
    bad = [summary({"w": 1, "e": 7}, 0, 2), summary({"w": 3}, 1, 2)]
    steps = StagedOnly([good, bad, good], current, target)
    with pytest.raises(ChecksumMismatchError, match="engine 1: staged result.*'w'"):
        apply(steps)
    assert not steps.written and steps.released == ["t"] and steps.dropped == [4]  # a 422 drops the copies


def test_experts_split_across_engines_are_one_copy():
    """MoE data parallelism: vLLM splits the experts across the engines (one world spanning them), so
    only every engine's partials together make the change; each engine alone is not a copy."""
    from vllm_delta.checksums import verify_partials

    current, target = {"router": 5, "experts": 50}, {"router": 6, "experts": 59}
    engine0 = [summary({"router": 1, "experts": 4}, 0, 2)]  # owns the router and experts 0..3
    engine1 = [summary({"experts": 5}, 1, 2)]  # experts 4..7
    steps = StagedOnly([engine0, engine1], current, target)
    assert apply(steps) == "written"
    assert [list(w) for w in worlds(steps.replies.all())] == [[0, 1]]
    with pytest.raises(ChecksumMismatchError):  # engine 0's share alone does not reach the target
        verify_partials(current, [engine0[0].partials], steps.header)


def test_ranks_that_do_not_form_whole_worlds_are_refused():
    assert [list(w) for w in worlds([summary({}, 0, 1), summary({}, 0, 1)])] == [[0], [1]]
    with pytest.raises(DeltaError, match="do not form whole worlds"):
        worlds([summary({}, 1, 2)])  # one engine's half of a world that spans engines
    with pytest.raises(DeltaError, match="do not form whole worlds"):
        worlds([summary({}, 0, 2), summary({}, 0, 2)])


def test_a_staging_failure_on_one_engine_writes_nothing_anywhere():
    good = [summary({"w": 3})]
    steps = StagedOnly([good, [RuntimeError("out of memory")]], {"w": 10}, {"w": 13})
    with pytest.raises(WorkerError, match="engine 1 rank 0: RuntimeError: out of memory"):
        apply(steps)
    assert not steps.written and steps.released == ["t"]


# -- the service over two engines of toy replicas -----------------------------------------------------
def toy_engines(uri: str, cache: str, n: int = 2):
    """n engines (TP=1 each): a toy model at version 0 with its DeltaReplica, the real worker methods,
    the engine-core stand-in around them; and the AsyncLLM stand-in over vLLM's client."""
    from vllm_delta.reconstruct import open_chain
    from vllm_delta.store import DeltaStore
    from vllm_delta.vllm.worker import methods as worker

    class Worker:
        def __init__(self, model, engine):
            self.model = model
            self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=engine))

        def get_model(self):
            return self.model

    worker.install(Worker)

    class Executor:
        def __init__(self, w):
            self.worker = w

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    files = open_chain(DeltaStore(uri, cache_dir=cache), 0)
    cores, replicas = [], []
    for e in range(n):
        replica = toy_replica(files)
        model = replica.model
        core = EngineCoreStandIn()
        core.model_executor, core.scheduler, core.batch_queue, core._weight_version = (
            Executor(Worker(model, e)),
            None,
            None,
            "0",
        )
        core.events = []
        cores.append(core)
        replicas.append(replica)
    return AsyncLLMStandIn(cores), cores, replicas


def weights(replica) -> list[torch.Tensor]:
    return [p.detach().clone() for p in replica.model.parameters()]


def test_the_service_over_two_engines(tmp_path, monkeypatch):
    import uuid

    from vllm_delta.store import DeltaStore
    from vllm_delta.vllm.api_server.metrics import metrics
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.shared.options import StoreSpec

    monkeypatch.setenv(FAULTS_ENV, "1")
    uri = f"memory://dp-units-{uuid.uuid4().hex[:8]}/run"
    gen = torch.Generator().manual_seed(0)
    w = {n: torch.randn(s, generator=gen) for n, s in {"q": (4, 4), "k": (4, 4), "v": (4, 4), "wt": (6, 4)}.items()}
    _publish(uri, range(4), gen, w)
    cache = str(tmp_path / "cache")
    store = DeltaStore(uri, cache_dir=cache)
    recorded = {v: store.open(v).header.checksum for v in range(4)}
    client, cores, replicas = toy_engines(uri, cache)

    async def scenario():
        service = DeltaService.of(client, StoreSpec(uri, cache_dir=cache))
        await service.startup()
        st = await service.status()
        assert (st.version, st.checksum) == (0, recorded[0])
        assert [(e.engine, e.version) for e in st.engines] == [(0, 0), (1, 0)] and st.engines_disagree is None
        assert [(e.engine, e.checksum) for e in st.verification.engines] == [(0, recorded[0]), (1, recorded[0])]
        assert [c._weight_version for c in cores] == ["0", "0"]  # every engine labelled at start-up

        out = await service.update(UpdateRequest(1))
        assert out.version == 1 and out.elements_written == 2 * out.nnz  # both engines wrote every change
        assert [r.served.version for r in replicas] == [1, 1] and [c._weight_version for c in cores] == ["1", "1"]
        v = await service.checks.verify("request")
        assert v.ok and [e.checksum for e in v.engines] == [recorded[1]] * 2

        # A staging fault on engine 1: nothing written on either engine, nothing held.
        before = [weights(r) for r in replicas]
        with pytest.raises(WorkerError, match="engine 1 rank 0: InjectedFaultError: injected fault while staging"):
            await service.update(UpdateRequest(2, fault="stage@1:0"))
        assert [r.served.version for r in replicas] == [1, 1] and [r.tickets for r in replicas] == [{}, {}]
        # A write fault on engine 1 after engine 0 wrote: both back on version 1, bit for bit.
        with pytest.raises(PatchFailedError, match="rolled back on every engine.*engine 1"):
            await service.update(UpdateRequest(2, fault="commit@1:0"))
        assert [r.served.version for r in replicas] == [1, 1] and [c._weight_version for c in cores] == ["1", "1"]
        for r, b in zip(replicas, before):
            assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(weights(r), b))
        assert (await service.update(UpdateRequest(2))).version == 2
        assert [r.served.version for r in replicas] == [2, 2]

        # A weight changed behind the plugin's back on engine 1 only: the verification names it.
        name, _ = replicas[1].patch_behind_our_back()
        v = await service.checks.verify("request")
        assert not v.ok and v.mismatched == [name]
        assert v.engines[0].checksum == recorded[2] and v.engines[1].checksum != recorded[2]
        assert (await service.status()).checksum == v.engines[1].checksum  # the engine that is off
        replicas[1].patch_behind_our_back()  # flipped back: seen as a change once, then all is well
        assert (await service.checks.verify("request")).mismatched == [name]
        assert (await service.checks.verify("request")).ok

        # Engines that disagree (as after a rollback that failed): loud, and no update runs.
        kept = replicas[1].served
        replicas[1].served = type(kept)(1, recorded[1], {})
        with pytest.raises(EnginesDisagreeError, match="engine 0: version 2.*engine 1: version 1"):
            await service.update(UpdateRequest(3))
        st = await service.status()
        assert st.version == 1 and "engine 1: version 1" in st.engines_disagree
        assert [(e.engine, e.version) for e in st.engines] == [(0, 2), (1, 1)]
        ready = service.readiness(None)
        assert not ready.ready and "different versions" in ready.reason
        assert metrics().engines_disagree._value.get() == 1
        assert [r.served.version for r in replicas] == [2, 1] and [r.tickets for r in replicas] == [{}, {}]
        replicas[1].served = kept  # they agree again: the next read says so
        assert (await service.update(UpdateRequest(3))).version == 3
        st = await service.status()
        assert st.engines_disagree is None and service.readiness(None).ready
        assert metrics().engines_disagree._value.get() == 0
        assert [r.served.version for r in replicas] == [3, 3]
        return st

    st = asyncio.run(scenario())
    assert st.checksum == st.version_checksum == recorded[3]
