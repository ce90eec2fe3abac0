"""Bad versions marked once for the whole fleet (issue 19, item 3): the follower's rule, the staleness
gate released by a mark, the Publisher's next anchor, the CLI (`mark-bad`, `inspect`, `fleet`), and
the errors (no such version, a store the caller cannot write). Local stores and the real S3 test
server; a read-only S3 client is the counting proxy refusing writes with 403 AccessDenied. Real vLLM
followers skipping a marked version: tests/vllm/test_fleet.py."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

import pytest
import torch
from test_follower import Replica, make_weights, step
from test_ledger import report
from test_store_faults import _unwritable

from vllm_delta import DeltaStore, Publisher, checksum, replay
from vllm_delta.cli import main as cli_main
from vllm_delta.errors import StalenessTimeoutError, StoreAccessError, VersionNotFoundError
from vllm_delta.store.ledger import Ledger
from vllm_delta.store.marks import blocked_by
from vllm_delta.testing.proxy import S3Proxy
from vllm_delta.trainer import PublisherOptions, StalenessPolicy, StoreOptions
from vllm_delta.trainer.staleness import StalenessGate
from vllm_delta.vllm.api_server.follower import Follower, FollowOptions, next_target


def damage(store: DeltaStore, version: int) -> None:
    """Flip the payload's last bytes, keeping the size: no reader can apply the version."""
    path = os.path.join(store.root, store.record(version).file)  # type: ignore[arg-type]
    with open(path, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        tail = f.read(16)
        f.seek(-16, os.SEEK_END)
        f.write(bytes(b ^ 0x5A for b in tail))


def publish_run(store: DeltaStore, w: dict[str, torch.Tensor], versions: range, anchor_every: int = 100) -> None:
    with Publisher(store.uri, anchor_every=anchor_every) as pub:
        for v in versions:
            step(w, v)
            pub.publish(w, version=v)


def test_the_latest_usable_version_is_below_every_mark(tmp_path):
    """What a server started at "latest" loads: the newest version whose chain passes no mark; below a
    marked anchor, the newest before it; None when every chain is marked."""
    store = DeltaStore(str(tmp_path / "s"))
    w = make_weights()
    publish_run(store, w, range(0, 8), anchor_every=3)  # anchors 0, 3, 6
    assert store.latest_usable() == 7
    store.mark_bad(7, "diverged")
    assert store.latest_usable() == 6
    store.mark_bad(4, "diverged")  # 5 is built on 4; 6 is an anchor
    assert store.latest_usable() == 6
    store.mark_bad(6, "diverged")  # the newest anchor: below it, 4 is marked, so 3
    assert store.latest_usable() == 3
    store.mark_bad(0, "diverged")
    store.mark_bad(3, "diverged")
    assert store.latest_usable() is None
    assert DeltaStore(str(tmp_path / "empty")).latest_usable() is None


def test_the_follower_moves_up_to_the_mark_and_waits_for_the_next_anchor(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(7)
    publish_run(store, w, range(0, 10))  # one anchor (0), deltas 1..9
    replica = Replica(store, 5)
    follower = Follower(
        store, FollowOptions(follow=True), served=replica.served, apply=replica.apply, checksums=replica.checksums
    )
    store.mark_bad(8, "diverged")
    marks = store.marks()
    assert next_target(store, 5, 9, 64, marks) == 7  # along 9's chain, up to the version before the mark
    assert next_target(store, 5, 9, 1, marks) == 6 and next_target(store, None, 9, 64, marks) == 7
    assert next_target(store, 7, 9, 64, marks) is None and next_target(store, 8, 9, 64, marks) is None
    asyncio.run(follower.poll_once())
    assert replica.version == 7 and replica.applied == [[6, 7]]
    asyncio.run(follower.poll_once())  # 9 lies past the mark: nothing applied, 9 shown as blocked
    assert replica.version == 7 and replica.applied == [[6, 7]]
    assert "version 8 is marked bad (diverged)" in follower.state.skipped[9]
    assert follower.state.last_error is None  # a mark is not an error of the follower
    step(w, 10)
    with Publisher(store.uri) as pub:  # a fresh Publisher anchors: 10's chain avoids 8
        pub.publish(w, version=10)
    asyncio.run(follower.poll_once())
    assert replica.version == 10 and checksum(replica.tensors) == checksum(w)


def test_a_version_marked_after_it_was_served_is_never_built_on(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(8)
    publish_run(store, w, range(0, 4))
    replica = Replica(store, 2)
    store.mark_bad(2, "bad rewards")
    follower = Follower(
        store, FollowOptions(follow=True), served=replica.served, apply=replica.apply, checksums=replica.checksums
    )
    asyncio.run(follower.poll_once())
    assert replica.version == 2 and replica.applied == [] and 3 in follower.state.skipped


# -- a marked version left by itself (issue 36, item 2) ------------------------------------------------
def leaving(store: DeltaStore, replica: Replica, **options) -> Follower:
    return Follower(
        store,
        FollowOptions(follow=True, **options),
        served=replica.served,
        apply=replica.apply,
        checksums=replica.checksums,
        back=replica.back,
    )


def image(store: DeltaStore, version: int) -> str:
    return checksum(replay(store, version)[1])


def test_a_follower_leaves_a_marked_version_by_the_backward_path(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    publish_run(store, make_weights(9), range(0, 7))  # one anchor (0), deltas 1..6
    replica = Replica(store, 5)
    follower = leaving(store, replica)
    asyncio.run(follower.poll_once())  # 6 is newer: applied as usual
    assert replica.version == 6 and replica.undone == [] and follower.status.leave_marked
    store.mark_bad(6, "reward hacking")
    asyncio.run(follower.poll_once())  # within one poll: 6 undone, 5 served, bit for bit
    assert replica.version == 5 and replica.undone == [[6]] and checksum(replica.tensors) == image(store, 5)
    left = follower.status.last_left
    assert left is not None and (left.version, left.to, left.marked, left.reason) == (6, 5, 6, "reward hacking")
    assert follower.state.last_error is None
    store.mark_bad(3, "diverged")  # a mark below the served version: its chain passes it
    asyncio.run(follower.poll_once())
    assert replica.version == 2 and replica.undone == [[6], [5, 4, 3]]
    assert checksum(replica.tensors) == image(store, 2) and follower.status.last_left.marked == 3
    asyncio.run(follower.poll_once())  # nothing more to do: 6 is blocked, 2 is clean
    assert replica.version == 2 and replica.undone == [[6], [5, 4, 3]] and replica.applied == [[6]]
    assert "version 3 is marked bad" in follower.state.skipped[6]


def test_leaving_is_capped_falls_back_to_a_replay_and_can_be_turned_off(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    publish_run(store, make_weights(10), range(0, 6))
    store.mark_bad(3, "diverged")
    replica = Replica(store, 5)
    asyncio.run(leaving(store, replica, leave_marked=False).poll_once())  # today's behaviour: stays
    assert replica.version == 5 and replica.undone == []
    follower = leaving(store, replica, chain_cap=2)
    for want in (3, 2):  # at most two versions back per update: 5 -> 3, then 3 -> 2
        asyncio.run(follower.poll_once())
        assert replica.version == want
    assert replica.undone == [[5, 4], [3]] and checksum(replica.tensors) == image(store, 2)
    # A store of raw deltas has no backward path: the target's chain is replayed (allow_reanchor).
    raw = DeltaStore(str(tmp_path / "raw"))
    with Publisher(raw.uri, anchor_every=100, codec="raw") as pub:
        w = make_weights(11)
        for v in range(0, 4):
            step(w, v)
            pub.publish(w, version=v)
    raw.mark_bad(3, "diverged")
    replica = Replica(raw, 3)
    asyncio.run(leaving(raw, replica).poll_once())
    assert replica.version == 2 and replica.applied == [[0, 1, 2]] and checksum(replica.tensors) == image(raw, 2)


def test_a_marked_anchor_leaves_nowhere_to_go_and_busy_requests_delay_the_move(tmp_path):
    from vllm_delta.errors import VersionBoundConflictError

    store = DeltaStore(str(tmp_path / "store"))
    publish_run(store, make_weights(12), range(0, 4))
    store.mark_bad(0, "wrong base model")
    replica = Replica(store, 2)
    follower = leaving(store, replica)
    asyncio.run(follower.poll_once())
    assert replica.version == 2 and "no unmarked version on its chain" in (follower.state.last_error or "")

    other = DeltaStore(str(tmp_path / "other"))
    publish_run(other, make_weights(13), range(0, 4))
    other.mark_bad(3, "diverged")
    replica = Replica(other, 3)
    refusals = {"n": 1}

    async def busy_back(served: int, version: int) -> float | None:
        if refusals["n"]:  # a request bounded above 2 still runs: the gate refuses the downgrade (409)
            refusals["n"] -= 1
            raise VersionBoundConflictError("an update to version 2 would run 1 running request(s) below ...")
        return await replica.back(served, version)

    follower = Follower(
        other,
        FollowOptions(follow=True),
        served=replica.served,
        apply=replica.apply,
        checksums=replica.checksums,
        back=busy_back,
    )
    asyncio.run(follower.poll_once())
    assert replica.version == 3 and 2 not in follower.state.skipped  # not the version's fault: tried again
    asyncio.run(follower.poll_once())
    assert replica.version == 2 and replica.undone == [[3]]


def gated_publisher(store: DeltaStore, *, max_staleness: int, min_replicas: int, timeout_s: float = 30.0) -> Publisher:
    policy = StalenessPolicy(max_staleness, min_replicas, timeout_s=timeout_s, poll_s=0.05)
    return Publisher(store.uri, anchor_every=100, options=PublisherOptions(staleness=policy))


def test_a_mark_frees_a_gated_trainer_and_its_next_version_is_an_anchor(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    ledger = Ledger(store)
    w = torch.zeros(64, dtype=torch.bfloat16)
    with gated_publisher(store, max_staleness=1, min_replicas=2) as pub:
        ledger.report(report("a", served=1))
        ledger.report(report("b", served=1))
        for v in range(3):  # 0 (anchor), 1, 2: 0 and 1 never wait (first + K), 2 needs them at >= 1
            pub.publish({"w": w + v}, version=v)
        pub.flush()
        # Version 2 is what every replica skips (corrupt): they stay at 1.
        outcome: dict[str, object] = {}

        def publish_3() -> None:
            try:
                outcome["info"] = pub.publish({"w": w + 3}, version=3)  # needs 2 replicas at >= 2
            except BaseException as exc:  # noqa: BLE001 - checked by the test thread
                outcome["error"] = exc

        t = threading.Thread(target=publish_3)
        t.start()
        time.sleep(0.6)
        assert t.is_alive(), "publish 3 should wait for the replicas"
        Publisher.mark_bad(pub, 2, "corrupt: every follower skips it")  # as an operator would, any thread
        t.join(timeout=10)
        assert not t.is_alive() and "error" not in outcome, outcome
        info = outcome["info"]
        assert info.kind == "anchor" and info.base is None  # type: ignore[attr-defined]
        assert pub._gate is not None and pub._gate.released_by == {2}
        info.uploaded.result(timeout=10)  # type: ignore[attr-defined]
        assert store.record(3).kind == "anchor"
        # The replicas move to 3; the next version is a delta again and waits for them as usual.
        ledger.report(report("a", served=3))
        ledger.report(report("b", served=3))
        info = pub.publish({"w": w + 4}, version=4)
        assert info.kind == "delta" and info.base == 3


def test_the_gate_counts_only_replicas_that_cannot_get_closer(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(9)
    publish_run(store, w, range(0, 10))
    ledger = Ledger(store)
    ledger.report(report("at-7", served=7))
    ledger.report(report("at-5", served=5))  # 6 and 7 are reachable: it can still get closer
    gate = StalenessGate(store, StalenessPolicy(max_staleness=1, min_replicas=2, timeout_s=0.5, poll_s=0.05))
    gate.first = 0
    with pytest.raises(StalenessTimeoutError):
        gate.wait(10)  # needs 2 replicas at >= 9
    store.mark_bad(8, "nan in the weights")
    with pytest.raises(StalenessTimeoutError, match="1 of 2"):
        gate.wait(10)  # at-7 counts now (8 and 9 are blocked), at-5 does not
    ledger.report(report("at-5", served=7))
    assert gate.wait(10) >= 0.0 and gate.released_by == {8}
    # Without marks in the way, the bound is the plain one again.
    ledger.report(report("at-5", served=9))
    ledger.report(report("at-7", served=9))
    assert gate.wait(10) < 0.5 and gate.released_by == frozenset()


def publish_three(pub: Publisher, w: torch.Tensor) -> None:
    for v in range(3):
        pub.publish({"w": w + v}, version=v)
    pub.flush()


def test_publisher_mark_bad_makes_the_next_version_an_anchor(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = torch.zeros(64, dtype=torch.bfloat16)
    with Publisher(store.uri, anchor_every=100) as pub:
        publish_three(pub, w)
        mark = pub.mark_bad(1, "diverged")
        assert mark.version == 1 and store.marks() == {1: mark}
        assert pub.publish({"w": w + 3}, version=3).kind == "anchor"
        assert pub.publish({"w": w + 4}, version=4).kind == "delta"
        with pytest.raises(VersionNotFoundError):
            pub.mark_bad(99, "no such version")
        info = pub.publish({"w": w + 5}, version=5)
        info.uploaded.result(timeout=10)
        pub.mark_bad(0, "an old version, not on the current chain")
        assert pub.publish({"w": w + 6}, version=6).kind == "delta"


def test_a_mark_by_someone_else_is_read_after_the_next_commit(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = torch.zeros(64, dtype=torch.bfloat16)
    with Publisher(store.uri, anchor_every=100) as pub:
        publish_three(pub, w)
        assert cli_main(["mark-bad", store.uri, "--version", "2", "--reason", "operator says so"]) == 0
        pub.publish({"w": w + 3}, version=3).uploaded.result(timeout=10)  # built before it knew
        assert store.record(3).kind == "delta"
        assert pub.publish({"w": w + 4}, version=4).kind == "anchor"  # learned after 3's commit


def test_mark_bad_cli_inspect_and_fleet(tmp_path, capsys):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(10)
    publish_run(store, w, range(0, 4))
    Ledger(store).report(report("srv-1", served=1, checksum=store.record(1).checksum))
    Ledger(store).report(report("srv-2", served=2, checksum=store.record(2).checksum))
    capsys.readouterr()
    assert cli_main(["mark-bad", store.uri, "--version", "2", "--reason", "reward hacking", "--by", "alice"]) == 0
    assert "version 2" in capsys.readouterr().out
    assert cli_main(["inspect", store.uri]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "BAD: reward hacking" in next(line for line in lines if line.split()[0] == "2")
    assert "BAD" not in next(line for line in lines if line.split()[0] == "3")
    assert cli_main(["inspect", store.uri, "--json"]) == 0
    rows = {r["version"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[2]["bad"]["reason"] == "reward hacking" and rows[2]["bad"]["by"] == "alice" and rows[3]["bad"] is None
    assert cli_main(["fleet", store.uri]) == 0
    out = capsys.readouterr().out
    assert "version 2 is marked bad (alice" in out
    assert "waits: version 2 is marked bad" in next(line for line in out.splitlines() if line.startswith("srv-1"))
    assert "serves a version marked bad" in next(line for line in out.splitlines() if line.startswith("srv-2"))
    assert cli_main(["fleet", store.uri, "--json"]) == 0
    rows = {r["replica_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows["srv-1"]["blocked_by"], rows["srv-1"]["marked_bad"]) == (2, None)
    assert (rows["srv-2"]["blocked_by"], rows["srv-2"]["marked_bad"]) == (None, "reward hacking")
    # Bad input: a clear error, nothing written.
    assert cli_main(["mark-bad", store.uri, "--version", "7", "--reason", "x"]) == 1
    assert "VersionNotFoundError" in capsys.readouterr().err
    assert cli_main(["mark-bad", store.uri, "--version", "latest", "--reason", "x"]) == 2
    assert cli_main(["mark-bad", store.uri, "--version", "3", "--reason", ""]) == 1
    assert sorted(store.marks()) == [2]


def test_marking_a_store_the_caller_cannot_write_is_a_clear_error(tmp_path, capsys):
    store = DeltaStore(str(tmp_path / "store"))
    publish_run(store, make_weights(11), range(0, 2))
    before = sorted(os.listdir(store.root))
    with _unwritable(store.root):
        with pytest.raises(StoreAccessError, match="refuses writes") as err:
            store.mark_bad(1, "bad")
        assert err.value.http_status == 403
        assert cli_main(["mark-bad", store.uri, "--version", "1", "--reason", "bad"]) == 1
        assert "StoreAccessError" in capsys.readouterr().err
    assert sorted(os.listdir(store.root)) == before and store.marks() == {}


def test_marks_on_s3_and_a_read_only_s3_client(s3_server, tmp_path):
    uri = s3_server.uri(f"marks-{uuid.uuid4().hex[:8]}")
    writer = DeltaStore(uri, s3_server.storage_options)
    w = make_weights(12)
    opts = PublisherOptions(store=StoreOptions(storage_options=s3_server.storage_options))
    with Publisher(uri, anchor_every=100, options=opts) as pub:
        for v in range(4):
            step(w, v)
            pub.publish(w, version=v)
    with S3Proxy(s3_server.endpoint_url, read_only=True) as proxy:
        reader = DeltaStore(uri, proxy.storage_options(s3_server.storage_options))
        assert reader.latest() == 3  # reads go through
        with pytest.raises(StoreAccessError, match="refuses writes"):
            reader.mark_bad(2, "from a read-only client")
        assert proxy.counts.requests("PUT", "bad") == 1
    assert writer.marks() == {}
    argv = ["mark-bad", uri, "--version", "2", "--reason", "corrupt", "--storage-options"]
    assert cli_main([*argv, json.dumps(s3_server.storage_options)]) == 0
    marks = writer.marks()
    assert list(marks) == [2] and blocked_by(writer.chain(3), marks) == marks[2]
    assert blocked_by(writer.chain(1), marks) is None
