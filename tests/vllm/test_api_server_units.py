"""The API process's parts on their own, without a vLLM engine (issue 37): `Ranks`, `LiveChecks`,
`Operations` and `PrefetchSlot`, over toy worker ranks (plain objects answering the RPC calls with the
versions and live sums the test sets, every call recorded) in a real event loop. The same parts inside a
running server: test_gating_units.py (the service over a stand-in engine) and the tests/vllm servers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from vllm_delta.checksums import MASK64, add_sums, combine, to_hex
from vllm_delta.errors import DeltaError, EnginesDisagreeError, PatchFailedError, ServerBusyError
from vllm_delta.server_api import UpdateRequest, to_wire
from vllm_delta.vllm.api_server import live_checks as live_checks_module
from vllm_delta.vllm.api_server.api_process import ApiProcess
from vllm_delta.vllm.api_server.deadline import Deadline
from vllm_delta.vllm.api_server.gating import VersionGate
from vllm_delta.vllm.api_server.live_checks import LiveChecks
from vllm_delta.vllm.api_server.operations import Operations
from vllm_delta.vllm.api_server.prefetch import Prefetched, PrefetchSlot
from vllm_delta.vllm.api_server.ranks import Ranks
from vllm_delta.vllm.shared import rpc
from vllm_delta.vllm.shared.messages import Probed, RankSums, Released, StageSummary, WorkerStatus
from vllm_delta.vllm.shared.options import StoreSpec
from vllm_delta.vllm.shared.plan import UpdatePlan
from vllm_delta.vllm.shared.two_phase import Staged, Update

pytestmark = pytest.mark.vllm_objects  # no engine, no server: make check-vllm-next runs them against the newest vLLM

SUMS = {"w": 11, "v": 12}


def checksum_of(sums: dict[str, int]) -> str:
    return to_hex(combine(sums.items()))


class ToyWorkers:
    """`engines` engine cores of `ranks` worker ranks each (one world per engine), serving `version` with
    `checksum`. Rank 0 of each engine holds `sums` (its share of the live sums), the others none, so a
    world's live sums are `sums`. `per_engine` overrides what one engine serves; every call is recorded."""

    def __init__(self, version: int | None = 3, sums: dict[str, int] | None = None, *, engines=1, ranks=2):
        self.version, self.sums = version, dict(SUMS if sums is None else sums)
        self.checksum = checksum_of(self.sums)
        self.engines, self.ranks = engines, ranks
        self.probed = True
        self.per_engine: dict[int, tuple[int | None, str | None, dict[str, int]]] = {}
        self.rank_version: dict[tuple[int, int], int] = {}  # (engine, rank) -> another version (a torn read)
        self.calls: list[str] = []
        self.on_call = lambda name: None

    def served(self, engine: int) -> tuple[int | None, str | None, dict[str, int]]:
        return self.per_engine.get(engine, (self.version, self.checksum, self.sums))

    async def send(self, name: str, kwargs: dict[str, Any]) -> list[list[Any]]:
        self.calls.append(name)
        self.on_call(name)
        out = []
        for e in range(self.engines):
            version, checksum, sums = self.served(e)
            replies: list[Any] = []
            for r in range(self.ranks):
                share = sums if r == 0 else {}
                if name == "delta_status":
                    v = self.rank_version.get((e, r), version)
                    live = share if kwargs.get("live_sums") else None
                    status = WorkerStatus(r, v, checksum, self.probed, live_sums=live, world_size=self.ranks)
                    replies.append(to_wire(status))
                elif name == "delta_live_sums":
                    replies.append(to_wire(RankSums(version, share, r, self.ranks)))
                elif name == "delta_served_sums":
                    replies.append(to_wire(RankSums(version, sums, r, self.ranks)))
                elif name == "delta_probe":
                    self.probed = True
                    replies.append(to_wire(Probed([])))
                elif name == "delta_release":
                    replies.append(to_wire(Released(kwargs["ticket"])))
                else:
                    raise AssertionError(f"unexpected RPC {name}")
            out.append(replies)
        return out


class ToyEngine:
    """vLLM's engine client as the parts see it: how many engine cores it fronts."""

    def __init__(self, engines: int):
        self.engine_core = type("Core", (), {"core_engines": list(range(engines))})()


class ToyCache:
    """The download cache keeper: what it was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, Any]] = []

    def applied(self, versions, reanchor):
        self.told.append(("applied", versions))

    def undone(self, target):
        self.told.append(("undone", target))

    def prune(self, served, staged):
        self.told.append(("prune", served))


def parts(toy: ToyWorkers, tmp_path) -> tuple[ApiProcess, Ranks, Operations]:
    spec = StoreSpec(str(tmp_path), update_timeout_s=5.0)
    transport = toy.send
    api = ApiProcess(
        ToyEngine(toy.engines), rpc.Workers(transport), rpc.EngineCore(transport), spec, Deadline(5.0, spec.uri)
    )
    ranks = Ranks(api, lambda: None, VersionGate(), lambda: ToyCache())  # type: ignore[arg-type,return-value]
    return api, ranks, Operations(api.deadline)


# -- Ranks -----------------------------------------------------------------------------------------
def test_ranks_read_every_rank_once_and_tell_an_outside_change(tmp_path):
    """One RPC reads every rank; what they serve is noted (and told to the version gate); a version no
    update of this process made is an outside change (told once per change); ranks of one engine that
    disagree are an error."""
    toy = ToyWorkers(3)
    _, ranks, _ = parts(toy, tmp_path)
    changes: list[int | None] = []
    ranks.on_outside_change = lambda: changes.append(toy.version)

    async def scenario():
        rank0, every = await ranks.read()
        assert (rank0.version, rank0.checksum, len(every)) == (3, toy.checksum, 2) and toy.calls == ["delta_status"]
        assert ranks.served.version == 3 and ranks.gate.served == 3 and ranks.seen_recently()
        await ranks.read()
        assert changes == []  # the same version: nothing changed
        toy.version, toy.checksum = 4, "0" * 16  # written past the plugin
        await ranks.read()
        assert changes == [4] and ranks.served.version == 4 and ranks.gate.served == 4
        await ranks.read()
        assert changes == [4]
        ranks.note_served(5, "1" * 16)  # an update of this process wrote 5 ...
        toy.version, toy.checksum = 5, "1" * 16
        await ranks.read()  # ... so the ranks serving it is no outside change
        assert changes == [4]
        toy.rank_version[(0, 1)] = 6  # rank 1 serves something else: a torn read, or a broken rank
        with pytest.raises(DeltaError, match="worker ranks disagree on the served version"):
            await ranks.read()

    asyncio.run(scenario())


def test_ranks_of_engines_that_disagree_are_loud(tmp_path):
    """Data-parallel engines serving different versions: an error for an update (agree=True), else the
    lowest version noted (the gate never admits a request on older weights), an outside change, and
    `disagreement` set until they agree again."""
    toy = ToyWorkers(3, engines=2)
    _, ranks, _ = parts(toy, tmp_path)
    changes: list[str] = []
    ranks.on_outside_change = lambda: changes.append("forget")

    async def scenario():
        await ranks.read()
        assert ranks.disagreement is None and [e.version for e in ranks.engines] == [3, 3]
        toy.per_engine[1] = (2, "2" * 16, SUMS)
        with pytest.raises(EnginesDisagreeError, match="restart the server"):
            await ranks.read()
        assert "engine 1: version 2" in (ranks.disagreement or "") and ranks.served.version == 2
        assert changes
        rank0, every = await ranks.read(agree=False)  # status reads on
        assert rank0.version == 3 and len(every) == 4
        del toy.per_engine[1]
        await ranks.read()
        assert ranks.disagreement is None

    asyncio.run(scenario())


def test_ranks_served_sums_are_asked_once_per_served_version(tmp_path):
    """The sums staged partials add to: the served version's recorded sums, asked of the ranks once (then
    known until the served version or checksum changes, or given by the update that wrote it); with no
    store version served, the live sums of every copy, which must agree."""
    toy = ToyWorkers(3)
    _, ranks, _ = parts(toy, tmp_path)

    async def scenario():
        served, _ = await ranks.read()
        assert await ranks.served_sums(served) == SUMS and toy.calls == ["delta_status", "delta_served_sums"]
        assert await ranks.served_sums(served) == SUMS and toy.calls.count("delta_served_sums") == 1
        ranks.note_served(4, "4" * 16, {"w": 1})  # an update wrote 4 and knows its sums
        toy.version, toy.checksum = 4, "4" * 16
        served, _ = await ranks.read()
        assert await ranks.served_sums(served) == {"w": 1} and toy.calls.count("delta_served_sums") == 1
        toy.version = None  # weights of no store version
        served, _ = await ranks.read()
        assert await ranks.served_sums(served) == SUMS and toy.calls[-1] == "delta_live_sums"

    asyncio.run(scenario())

    two = ToyWorkers(None, engines=2)
    two.per_engine[1] = (None, two.checksum, {"w": 1, "v": 12})
    _, ranks2, _ = parts(two, tmp_path)

    async def differ():
        served, _ = await ranks2.read(agree=False)
        with pytest.raises(EnginesDisagreeError, match="hold different weights"):
            await ranks2.served_sums(served)

    asyncio.run(differ())


def test_ranks_live_state_probes_a_layout_first(tmp_path):
    """The live sums of every copy of the weights in one read, the layout probed first if no rank has
    been (then read again); a rank that does not report its share is an error."""
    toy = ToyWorkers(3, {"w": 5}, engines=2)
    toy.probed = False
    _, ranks, _ = parts(toy, tmp_path)

    async def scenario():
        served, copies = await ranks.live_state()
        assert toy.calls == ["delta_status", "delta_probe", "delta_status"] and served.probed
        assert [(c.engines, c.sums) for c in copies] == [([0], {"w": 5}), ([1], {"w": 5})]
        assert copies[0].checksum == checksum_of({"w": 5})

    asyncio.run(scenario())


# -- LiveChecks ------------------------------------------------------------------------------------
def test_live_checks_are_the_live_sums_one_writer(tmp_path):
    """Start-up learns the live sums; a status then reads them without a worker call; an update's partials
    move them (`applied`); an outside change the ranks see forgets them, and they are learnt again when
    asked; a verification compares a recomputation with what was kept and names what changed."""
    toy = ToyWorkers(3)
    _, ranks, operations = parts(toy, tmp_path)
    checks = LiveChecks(ranks, operations)

    async def scenario():
        rank0 = await checks.at_startup()
        assert rank0.version == 3 and checks.verification is not None and checks.verification.ok
        assert checks.current()[0] == toy.checksum and toy.calls == ["delta_status"]
        assert await checks.learnt() == toy.checksum and toy.calls == ["delta_status"]  # kept: no call
        # An update of this process from 3 to 4 with these partials (two ranks' shares).
        ranks.note_served(4, "4" * 16)
        checks.applied(3, 4, [{"w": 1}, {"v": MASK64}], {"w": 99, "v": 99})
        moved = add_sums([SUMS, {"w": 1}, {"v": MASK64}])
        assert checks.live.sums == moved and checks.current()[0] == checksum_of(moved)
        # The ranks now report 5: written past the plugin. The sums are unknown until recomputed.
        toy.version, toy.checksum = 5, "5" * 16
        await ranks.read()
        assert checks.current() == (None, None) and not checks.live.known_for(5)
        assert await checks.learnt() == checksum_of(toy.sums)  # one read with the live sums
        assert toy.calls[-1] == "delta_status" and checks.live.known_for(5)
        # A verification: a weight changed behind the plugin's back.
        toy.sums["v"] += 1
        v = await checks.verify("request")
        assert not v.ok and v.mismatched == ["v"] and v.trigger == "request" and checks.verification is v

    asyncio.run(scenario())


def test_live_checks_wait_for_an_update_then_answer_busy(tmp_path, monkeypatch):
    """A verification takes the update lock: it waits for a running update, then says the server is busy
    (503) rather than read half-written weights; a recomputation outside the lock is thrown away if an
    update started while it read."""
    monkeypatch.setattr(live_checks_module, "VERIFY_WAIT_S", 0.05)
    toy = ToyWorkers(3)
    _, ranks, operations = parts(toy, tmp_path)
    checks = LiveChecks(ranks, operations)

    async def scenario():
        await ranks.read()
        async with operations.lock:
            with pytest.raises(ServerBusyError, match="verify later"):
                await checks.verify("request")
        toy.on_call = lambda name: setattr(operations, "started", operations.started + 1)
        await checks.learn()  # an update "started" during the read: what was read may be torn
        assert not checks.live.known_for(3) and checks.current() == (None, None)
        toy.on_call = lambda name: None
        await checks.learn()
        assert checks.live.known_for(3)

    asyncio.run(scenario())


# -- Operations ------------------------------------------------------------------------------------
def test_operations_run_one_at_a_time_and_keep_the_last_failure(tmp_path):
    """One update or prefetch at a time: what runs is shown while it runs (and cleared after), a failure
    is kept with the name clients match on (a failed patch is still "CommitFailedError") and its status,
    a refusal counts as a failure before anything runs, and a second operation waits for the first."""
    refused: list[str] = []

    def refuse(name):
        if name == "stage":
            refused.append(name)
            raise DeltaError("refused here")

    operations = Operations(Deadline(5.0, str(tmp_path)), refuse)
    order: list[str] = []

    async def first():
        async with operations.run("update", 4):
            assert operations.busy and operations.in_progress.operation == "update"
            assert (
                operations.in_progress.version == 4 and operations.deadline.left("running") <= 5.0
            )  # its deadline runs
            order.append("first in")
            await asyncio.sleep(0.05)
            order.append("first out")

    async def second():
        await asyncio.sleep(0.01)
        async with operations.run("update", 5):
            order.append("second")

    async def scenario():
        await asyncio.gather(first(), second())
        assert order == ["first in", "first out", "second"] and not operations.busy and operations.started == 2
        with pytest.raises(PatchFailedError):
            async with operations.run("update", 6):
                raise PatchFailedError("update to version 6 failed and was rolled back")
        f = operations.last_failure
        assert f is not None and (f.operation, f.version, f.type, f.status) == ("update", 6, "CommitFailedError", 500)
        assert operations.in_progress is None and not operations.lock.locked()
        with pytest.raises(DeltaError, match="refused here"):
            async with operations.run("stage", 7):
                raise AssertionError("a refused operation never runs")
        assert refused == ["stage"] and operations.last_failure.operation == "stage"

    asyncio.run(scenario())


# -- PrefetchSlot ----------------------------------------------------------------------------------
def test_prefetch_slot_holds_one_update_for_the_update_that_takes_it(tmp_path):
    """The prefetched update is taken only by an update of the same plan from the same served version with
    the same method (then no longer held); anything else leaves it held; dropping it releases its ticket
    on every rank."""
    toy = ToyWorkers(3)
    api, _, _ = parts(toy, tmp_path)
    slot = PrefetchSlot(api.workers)
    plan = UpdatePlan(target=5, versions=[4, 5], reanchor=False, nnz=7, bytes=96)
    summary = StageSummary([4, 5], {"w": 1}, nnz=7, bytes=96, stage_ms=1.0, timings={})
    staged = Staged(Update("t1", [4, 5], 5), [summary, summary], 2.5)
    served = WorkerStatus(0, 3, toy.checksum, True)

    async def scenario():
        assert slot.versions == [] and slot.take(served, plan, "delta") is None
        slot.held = Prefetched(3, plan, staged, steps=None)  # type: ignore[arg-type]  # the steps are not run here
        assert slot.versions == [4, 5] and slot.held.result().staged == [4, 5] and slot.held.result().version == 3
        assert slot.take(WorkerStatus(0, 2, "x", True), plan, "delta") is None  # another served version
        assert slot.take(served, UpdatePlan(target=4, versions=[4], reanchor=False), "delta") is None
        assert slot.take(served, plan, "vllm") is None  # another method
        assert slot.held is not None and toy.calls == []
        taken = slot.take(served, plan, "delta")
        assert taken is not None and taken.ticket == "t1" and slot.held is None and slot.versions == []
        slot.held = taken
        await slot.drop()
        assert slot.held is None and toy.calls == ["delta_release"]
        await slot.drop()  # nothing held: no call
        assert toy.calls == ["delta_release"]

    asyncio.run(scenario())
    assert UpdateRequest(5).version == 5  # the request a prefetch is taken by
