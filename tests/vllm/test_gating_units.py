"""The version gate, the live checksum kept current and the readiness answer, without a vLLM engine.

The gate and its ASGI middleware run in a real event loop in front of a stand-in ASGI app (it records
what it received and answers); the service runs against a stand-in engine whose workers report live
sums the test controls (mocks: no engine is needed to decide these). The same behaviour on real
servers: test_vllm_gating.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from vllm_delta.errors import BadRequestError, VersionBoundConflictError, WeightVersionBehindError
from vllm_delta.server_api import MAX_VERSION, min_version_of, to_wire, version_bound_text
from vllm_delta.vllm.api_server.gating import HELD_HEADER, VersionGate, VersionGateMiddleware
from vllm_delta.vllm.api_server.live_sums import LiveSums

pytestmark = pytest.mark.vllm_objects  # no engine, no server: make check-vllm-next runs them against the newest vLLM


# -- parsing ---------------------------------------------------------------------------------------
def test_bounds_from_the_body_and_the_header():
    assert min_version_of([], {"prompt": "x"}) is None
    assert min_version_of([], {"min_weight_version": None}) is None  # null: no bound
    assert min_version_of([], {"min_weight_version": 7}) == 7
    assert min_version_of(["7"], None) == 7
    assert min_version_of([" 7 "], {"min_weight_version": 7}) == 7  # both, agreeing
    assert min_version_of(["0"], []) == 0
    assert version_bound_text(str(MAX_VERSION), "q") == MAX_VERSION
    bad_bodies = [-1, "7", True, 7.0, MAX_VERSION + 1, 10**30, [7], {"v": 7}]
    for value in bad_bodies:
        with pytest.raises(BadRequestError, match="min_weight_version must be an integer"):
            min_version_of([], {"min_weight_version": value})
    for text in ["-1", "seven", "7.0", "0x10", "", " ", "1e3", str(MAX_VERSION + 1), "9" * 400, "٣"]:
        with pytest.raises(BadRequestError, match="X-Min-Weight-Version must be an integer"):
            min_version_of([text], None)
    with pytest.raises(BadRequestError, match="disagree"):
        min_version_of(["7"], {"min_weight_version": 8})
    with pytest.raises(BadRequestError, match="disagree"):
        min_version_of(["7", "8"], None)
    with pytest.raises(BadRequestError) as exc:
        min_version_of([], {"min_weight_version": "x" * 10000})
    assert len(str(exc.value)) < 300  # quotes a short prefix only


def test_the_server_api_bound_is_the_stores():
    from vllm_delta.store import records

    assert MAX_VERSION == records.MAX_VERSION


# -- the gate --------------------------------------------------------------------------------------
def test_gate_admits_holds_until_the_commit_and_refuses():
    async def scenario():
        gate = VersionGate(wait_s=5.0)
        gate.note_served(3)
        assert await gate.admit(3) == 0.0  # at once
        assert gate.running == {3: 1}
        gate.release(3)
        assert gate.running == {}

        # Held: woken by the commit (note_served), not by a timer: well before the 5 s bound.
        async def commit_later():
            await asyncio.sleep(0.3)
            gate.note_served(5)

        task = asyncio.create_task(commit_later())
        t0 = time.monotonic()
        held = await gate.admit(5)
        took = time.monotonic() - t0
        await task
        assert 0.25 < held < 1.0 and took < 1.0, (held, took)
        gate.release(5)

        # Refused after the wait, naming both versions.
        gate.wait_s = 0.2
        with pytest.raises(WeightVersionBehindError) as exc:
            await gate.admit(9)
        assert (exc.value.served, exc.value.required) == (5, 9)
        assert "serves weight version 5" in str(exc.value) and "min_weight_version 9" in str(exc.value)
        assert gate.running == {}  # nothing registered

        # No version served (a plain checkpoint, or no store): refused, never admitted.
        empty = VersionGate(wait_s=0.0)
        with pytest.raises(WeightVersionBehindError, match="no store version"):
            await empty.admit(0)

    asyncio.run(scenario())


def test_a_commit_never_takes_a_running_request_below_its_bound():
    async def scenario():
        gate = VersionGate(wait_s=0.5)
        gate.note_served(8)
        await gate.admit(7)  # running with bound 7
        # An upgrade commits under it; a downgrade to 6 is refused while it runs.
        gate.begin_update(9)
        gate.end_update()
        with pytest.raises(VersionBoundConflictError, match="1 running request.*up to 7"):
            gate.begin_update(6)
        gate.begin_update(7)  # to exactly its bound: allowed
        gate.end_update()
        gate.release(7)

        # While a downgrade to 6 commits, a request with bound 7 is held (it could start on 6 otherwise);
        # a failed downgrade leaves 8 served: it is admitted at end_update.
        gate.begin_update(6)
        assert gate.floor() == 6
        waiter = asyncio.create_task(gate.admit(7))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        gate.end_update()
        assert await waiter > 0
        gate.release(7)

        # A successful downgrade: the request is refused after its wait, never admitted on 6.
        gate.begin_update(6)
        waiter = asyncio.create_task(gate.admit(7))
        await asyncio.sleep(0.05)
        gate.note_served(6)
        gate.end_update()
        with pytest.raises(WeightVersionBehindError):
            await waiter
        assert gate.running == {}

    asyncio.run(scenario())


def test_a_follower_leaving_a_marked_version_is_gated_like_a_replica_behind():
    """hold_at(N) (the follower is about to go back to N): requests bounded above N are admitted no more,
    as on a replica serving N (they wait, then 409); one still running refuses the downgrade until it
    ends; the hold lifts once the served version changes."""

    async def scenario():
        gate = VersionGate(wait_s=0.2)
        gate.note_served(8)
        await gate.admit(8)  # running with bound 8, on the marked version
        gate.hold_at(6)
        assert gate.floor() == 6
        with pytest.raises(WeightVersionBehindError, match="needs min_weight_version 7"):
            await gate.admit(7)  # behind for it now
        assert await gate.admit(6) == 0.0  # bounds up to 6 run as usual
        gate.release(6)
        with pytest.raises(VersionBoundConflictError, match="up to 8"):
            gate.begin_update(6)  # the running request keeps 8 until it ends
        gate.release(8)
        gate.begin_update(6)
        gate.note_served(6)
        gate.end_update()
        assert gate.floor() == 6
        gate.note_served(9)  # a later update: the hold is gone with what it was for
        assert gate.floor() == 9 and await gate.admit(9) == 0.0
        gate.release(9)

    asyncio.run(scenario())


# -- the middleware --------------------------------------------------------------------------------
class App:
    """A stand-in ASGI app: records the body it was given and answers 200 (or raises)."""

    def __init__(self, gate: VersionGate | None = None, fail: bool = False):
        self.bodies: list[bytes] = []
        self.running_seen: list[dict[int, int]] = []
        self.gate = gate
        self.fail = fail

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        if self.gate is not None:
            self.running_seen.append(self.gate.running)
        if self.fail:
            raise RuntimeError("the app failed")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})


async def call(middleware, body: bytes, headers=(), path="/v1/completions", chunks: int = 1):
    step = max(1, len(body) // chunks)
    parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(k.encode(), v.encode()) for k, v in headers]}
    await middleware(scope, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def test_middleware_passes_bodies_unchanged_and_answers_400_409():
    async def scenario():
        gate = VersionGate(wait_s=0.2)
        gate.note_served(4)
        app = App(gate)
        mw = VersionGateMiddleware(app, gate)
        plain = json.dumps({"prompt": "hi", "max_tokens": 3}).encode()
        assert (await call(mw, plain, chunks=3))[0] == 200
        bounded = json.dumps({"prompt": "hi", "min_weight_version": 4}).encode()
        status, headers, _ = await call(mw, bounded, chunks=4)
        assert status == 200 and headers[HELD_HEADER] == b"0"
        assert app.bodies == [plain, bounded]  # byte for byte, however it arrived
        assert app.running_seen[-1] == {4: 1} and gate.running == {}  # registered while it ran, then not
        # The key spelled with JSON escapes is still read.
        escaped = b'{"prompt": "hi", "min_weight_versio\\u006e": 9}'
        status, headers, body = await call(mw, escaped)
        assert status == 409 and headers[b"retry-after"] == b"1"
        error = json.loads(body)["error"]
        assert error["type"] == "WeightVersionBehindError" and error["code"] == 409
        assert (error["served_version"], error["required_version"]) == (4, 9)
        # Header only, on chat; header and body disagreeing; malformed values: 400, the app never runs.
        chat = json.dumps({"messages": []}).encode()
        assert (await call(mw, chat, [("X-Min-Weight-Version", "3")], path="/v1/chat/completions"))[0] == 200
        n = len(app.bodies)
        for body, headers in [
            (json.dumps({"min_weight_version": 5}).encode(), [("x-min-weight-version", "4")]),
            (json.dumps({"min_weight_version": -1}).encode(), []),
            (json.dumps({"min_weight_version": "4"}).encode(), []),
            (plain, [("X-Min-Weight-Version", "four")]),
        ]:
            status, _, answer = await call(mw, body, headers)
            assert status == 400, answer
            assert json.loads(answer)["error"]["param"] == "min_weight_version"
        assert len(app.bodies) == n and gate.running == {}
        # Other routes are not gated.
        assert (await call(mw, bounded.replace(b"4}", b"99}"), path="/v1/embeddings"))[0] == 200
        # A failing app still releases its registration.
        failing = VersionGateMiddleware(App(gate, fail=True), gate)
        with pytest.raises(RuntimeError):
            await call(failing, bounded)
        assert gate.running == {}

    asyncio.run(scenario())


# -- the live checksum kept current ----------------------------------------------------------------
def test_live_sums_kept_current_and_compared():
    from vllm_delta.checksums import MASK64, combine, to_hex

    live = LiveSums()
    first = live.recomputed(
        1, {"a": 5, "b": 7}, version_checksum=to_hex(combine([("a", 5), ("b", 7)])), trigger="startup", ms=1
    )
    assert first.ok and first.expected is None and live.known_for(1)
    # A commit adds the ranks' partials (two ranks here) to the sums kept current.
    live.applied(1, 2, [{"a": 3}, {"a": MASK64}], {"a": 99, "b": 99})
    assert live.version == 2 and live.sums == {"a": 7, "b": 7}
    # Unknown sums before a commit: the target's recorded ones.
    other = LiveSums()
    other.applied(None, 2, [{"a": 1}], {"a": 8, "b": 9})
    assert other.sums == {"a": 8, "b": 9}
    # A recomputation that finds "b" changed behind our back.
    v = live.recomputed(2, {"a": 7, "b": 8}, version_checksum=live.checksum, trigger="request", ms=2)
    assert not v.ok and v.mismatched == ["b"] and v.expected == to_hex(combine([("a", 7), ("b", 7)]))
    assert live.sums == {"a": 7, "b": 8}  # the truth from now on
    # The same recomputation again: nothing changed since, but the weights are still not the version's.
    again = live.recomputed(
        2, {"a": 7, "b": 8}, version_checksum=to_hex(combine([("a", 7), ("b", 7)])), trigger="audit", ms=2
    )
    assert not again.ok and again.mismatched == []
    live.forget()
    assert not live.known_for(2) and live.checksum is None


# -- the service: status, verification, readiness (a stand-in engine) ------------------------------
class FakeEngine:
    """Workers at `version` whose live sums the test sets; counts the calls that reach them."""

    def __init__(self, version: int, sums: dict[str, int]):
        from vllm_delta.checksums import combine, to_hex

        self.version = version
        self.recorded = to_hex(combine(sums.items()))
        self.sums = dict(sums)
        self.calls: list[str] = []

    async def collective_rpc(self, name, timeout=None, kwargs=None):
        from vllm_delta.vllm.shared.messages import WorkerStatus

        self.calls.append(name)
        if name == "delta_status":
            live = dict(self.sums) if kwargs.get("live_sums") else None
            return [to_wire(WorkerStatus(0, self.version, self.recorded, True, live_sums=live))]
        if name == "delta_set_label":
            from vllm_delta.vllm.shared.messages import LabelSet

            return [to_wire(LabelSet(label=str(self.version), previous_label="default", engine_step=0, time=0.0))]
        raise AssertionError(f"unexpected RPC {name}")


def test_status_without_worker_calls_and_verify_catches_a_write(tmp_path):
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.shared.options import StoreSpec

    async def scenario():
        engine = FakeEngine(3, {"w": 11, "v": 12})
        svc = DeltaService.of(engine, StoreSpec(str(tmp_path)))
        await svc.startup()
        assert engine.calls == ["delta_status", "delta_set_label"]
        assert svc.checks.verification is not None and svc.checks.verification.ok
        engine.calls.clear()
        for _ in range(3):
            st = await svc.status()
            assert (st.version, st.checksum, st.version_checksum) == (3, engine.recorded, engine.recorded)
        assert engine.calls == []  # no worker call
        assert svc.readiness(None).ready and svc.readiness(3).ready
        not_ready = svc.readiness(4)
        assert not not_ready.ready and "below 4" in (not_ready.reason or "")
        engine.sums["v"] += 1  # a weight changed behind the plugin's back
        assert (await svc.status()).checksum == engine.recorded  # status cannot know ...
        st = await svc.status(verify=True)  # ... a verification does
        assert engine.calls == ["delta_status"]
        assert st.verification is not None and not st.verification.ok
        assert st.verification.mismatched == ["v"] and st.verification.expected == engine.recorded
        assert st.checksum == st.verification.checksum != st.version_checksum

    asyncio.run(scenario())


def test_readiness_follows_the_followers_view(tmp_path):
    from vllm_delta.server_api import FollowStatus
    from vllm_delta.vllm.api_server.follower import FollowState
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.shared.options import FollowOptions, StoreSpec

    class Follower:  # the follower's state is all readiness reads
        options = FollowOptions(follow=True)
        state = FollowState(store="s")

        @property
        def status(self) -> FollowStatus:
            return self.state.snapshot(self.options)

    async def scenario():
        svc = DeltaService.of(FakeEngine(3, {"w": 1}), StoreSpec(str(tmp_path)))
        assert not svc.readiness(None).ready  # nothing read yet
        await svc.startup()
        svc.follower = Follower()  # type: ignore[assignment]
        r = svc.readiness(None)
        assert not r.ready and "has not read the store" in (r.reason or "")
        Follower.state.newest_seen = 5
        r = svc.readiness(None)
        assert not r.ready and r.newest_seen == 5 and "saw version 5" in (r.reason or "")
        assert svc.readiness(3).ready  # a bound it meets: ready for that traffic
        Follower.state.skipped[5] = "corrupt"  # the newest one is bad: nothing left to catch up
        assert svc.readiness(None).ready
        del Follower.state.skipped[5]
        svc.ranks.note_served(5, "x")
        assert svc.readiness(None).ready

    asyncio.run(scenario())


def test_the_background_audit_recomputes_on_its_own(tmp_path):
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.shared.options import StoreSpec

    async def scenario():
        engine = FakeEngine(3, {"w": 11})
        svc = DeltaService.of(engine, StoreSpec(str(tmp_path)))
        await svc.startup()
        svc.checks.start_audit(0.05)
        engine.sums["w"] += 1  # behind the plugin's back
        deadline = time.monotonic() + 10
        while (
            svc.checks.verification is None or svc.checks.verification.trigger != "audit"
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        v = svc.checks.verification
        assert v is not None and v.trigger == "audit" and not v.ok and v.mismatched == ["w"]
        async with svc.operations.lock:  # an update holds the lock: the audit skips its rounds, never waits
            calls = len(engine.calls)
            await asyncio.sleep(0.3)
            assert len(engine.calls) == calls
        await svc.stop()
        calls = len(engine.calls)
        await asyncio.sleep(0.2)
        assert len(engine.calls) == calls  # stopped

    asyncio.run(scenario())


def test_vllms_own_weight_routes_make_status_re_read_the_workers(tmp_path):
    from vllm_delta.checksums import combine, to_hex
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.api_server.vllm_routes import PastThePluginMiddleware
    from vllm_delta.vllm.shared.options import StoreSpec

    async def scenario():
        engine = FakeEngine(3, {"w": 11})
        svc = DeltaService.of(engine, StoreSpec(str(tmp_path)))
        await svc.startup()
        gate_app = App()
        marks = []

        def mark(scope, reset):
            marks.append((scope["path"], reset))
            svc.checks.past_the_plugin(weights_reset=reset)

        mw = PastThePluginMiddleware(gate_app, mark)
        assert (await call(mw, b"{}", path="/v1/completions"))[0] == 200
        assert marks == []  # not one of vLLM's weight routes
        # vLLM's native RL API moves the workers to version 5 past the plugin.
        engine.version, engine.sums = 5, {"w": 13}
        engine.recorded = to_hex(combine(engine.sums.items()))
        engine.calls.clear()
        assert (await call(mw, b'{"update_info": {}}', path="/update_weights"))[0] == 200
        assert marks == [("/update_weights", False)]
        st = await svc.status()  # re-reads once, sees another version, recomputes the live sums
        assert (st.version, st.checksum) == (5, engine.recorded)
        assert svc.gate.served == 5
        engine.calls.clear()
        await svc.status()
        assert engine.calls == []  # and then answers from memory again
        # vLLM's /update_weight_version relabels: marked (a re-read), the sums kept (nothing was written).
        assert (await call(mw, b'{"new_version": "x"}', path="/update_weight_version"))[0] == 200
        assert marks[-1] == ("/update_weight_version", False)
        st = await svc.status()
        assert engine.calls == ["delta_status"] and st.checksum == engine.recorded and st.verification.ok
        # /weight_checker computing checksums writes nothing ...
        engine.calls.clear()
        assert (await call(mw, b'{"action": "checksum"}', path="/weight_checker", chunks=3))[0] == 200
        assert marks[-1] == ("/weight_checker", False) and gate_app.bodies[-1] == b'{"action": "checksum"}'
        await svc.status()
        assert engine.calls == ["delta_status"]
        # ... its reset zeroes the weights with the workers' record unchanged: the live sums are forgotten
        # and the next status recomputes them, and says the weights are not the version's any more.
        engine.sums = {"w": 0}
        engine.calls.clear()
        assert (await call(mw, b'{"action": "reset"}', path="/weight_checker", chunks=2))[0] == 200
        assert marks[-1] == ("/weight_checker", True)
        st = await svc.status()
        assert engine.calls == ["delta_status", "delta_status"]  # the re-read, then the recomputation
        assert st.version == 5 and st.version_checksum == engine.recorded
        assert st.checksum == to_hex(combine([("w", 0)])) != engine.recorded
        v = st.verification
        assert v is not None and v.trigger == "outside" and not v.ok and v.mismatched == ["w"]
        assert (await svc.status()).verification == v and engine.calls == ["delta_status", "delta_status"]  # once
        # An update now stages against what the weights are (a re-anchor restores the version), not the record.
        served, _ = await svc.ranks.read()
        assert svc.checks.off_version_sums(served) == {"w": 0}
        assert await svc.checks.staged_against(served) == {"w": 0}
        await svc.stop()

    asyncio.run(scenario())
