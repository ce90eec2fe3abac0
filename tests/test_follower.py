"""The follower's logic against a real store and a real apply engine (an in-process replica on CPU
tensors standing in for a vLLM server: the same plan, staging, verification and commit steps the
server's DeltaService runs). Real servers following a store are tested in tests/vllm/test_fleet.py."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from vllm_delta import DeltaStore, Publisher, checksum, replay
from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.apply.layout import Layout
from vllm_delta.checksums import verify_partials
from vllm_delta.errors import DeltaError
from vllm_delta.server_api import FollowStatus, from_wire, to_wire
from vllm_delta.store.ledger import Ledger
from vllm_delta.vllm.api_server.follower import Follower, FollowOptions, next_target
from vllm_delta.vllm.shared.options import LoaderOptions, server_options, split_extra_config
from vllm_delta.vllm.shared.plan import plan_update


class Replica:
    """What a server holds: live tensors, the served version, and how it updates (as the service)."""

    def __init__(self, store: DeltaStore, version: int):
        self.store = store
        self.version, tensors = replay(store, version)
        self.tensors = {n: t.clone() for n, t in tensors.items()}
        self.engine = ApplyEngine(self.tensors, Layout.identity({n: tuple(t.shape) for n, t in tensors.items()}))
        self.header = store.open(version).header
        self.applied: list[list[int]] = []
        self.undone: list[list[int]] = []  # backward updates: the versions undone, newest first

    async def served(self) -> int | None:
        return self.version

    async def apply(self, version: int) -> float:
        return self._update(plan_update(self.store, self.version, self.header.checksum, version))

    async def back(self, served: int, version: int) -> float | None:
        """What the service's follow_back does: backward where the store allows it, else a replay."""
        if served != self.version:
            return None
        return self._update(plan_update(self.store, self.version, self.header.checksum, version, allow_reanchor=True))

    def _update(self, plan) -> float:
        files = [self.store.open(r.version, record=r) for r in plan.files]
        back_to = files.pop().header if plan.undo_to is not None else None
        staged = self.engine.stage(files, back_to=back_to)
        target = back_to or files[-1].header
        sums = {n: int(e.checksum, 16) for n, e in self.header.tensors.items()}
        verify_partials(sums, [staged.partials], target)
        ms = self.engine.patch(staged)
        self.version, self.header = target.version, target
        (self.undone if back_to is not None else self.applied).append(plan.versions)
        return ms

    async def checksums(self) -> tuple[str, str]:
        return checksum(self.tensors), self.header.checksum


def make_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(40, 30, generator=gen).to(torch.bfloat16),
        "b": torch.randn(50, generator=gen).to(torch.bfloat16),
    }


def step(w: dict[str, torch.Tensor], v: int) -> None:
    for t in w.values():
        flat = t.view(-1)
        flat[(v * 13) % flat.numel()] += 0.5


def run(coro):
    return asyncio.run(coro)


def test_follower_catches_up_in_one_update_and_reports(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights()
    pub = Publisher(store.uri, anchor_every=100)
    pub.publish(w, version=0)
    pub.flush()
    replica = Replica(store, 0)
    follower = Follower(
        store,
        FollowOptions(follow=True, report=True, replica_id="r-1"),
        served=replica.served,
        apply=replica.apply,
        checksums=replica.checksums,
    )
    for v in range(1, 5):
        step(w, v)
        pub.publish(w, version=v)
    pub.close()
    run(follower.poll_once())
    assert replica.version == 4 and replica.applied == [[1, 2, 3, 4]]  # one update, one pause
    assert checksum(replica.tensors) == checksum(w)
    assert follower.state.lag == 0 and follower.state.updates == 1
    (report,) = Ledger(store).reports()
    assert report.replica_id == "r-1" and report.served_version == 4 and report.checksum == checksum(w)
    run(follower.poll_once())  # nothing new: no update
    assert follower.state.updates == 1 and follower.state.polls == 2


def test_chain_cap_walks_long_chains_in_steps(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(1)
    with Publisher(store.uri, anchor_every=100) as pub:
        for v in range(0, 8):
            step(w, v)
            pub.publish(w, version=v)
    assert next_target(store, 0, 7, 3) == 3 and next_target(store, 5, 7, 3) == 7 and next_target(store, None, 7, 3) == 7
    replica = Replica(store, 0)
    follower = Follower(
        store,
        FollowOptions(follow=True, chain_cap=3),
        served=replica.served,
        apply=replica.apply,
        checksums=replica.checksums,
    )
    for _ in range(3):
        run(follower.poll_once())
    assert replica.applied == [[1, 2, 3], [4, 5, 6], [7]]
    assert checksum(replica.tensors) == checksum(w)


def test_corrupt_version_is_skipped_until_a_good_one_appears(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(2)
    pub = Publisher(store.uri, anchor_every=3)
    for v in range(0, 2):
        step(w, v)
        pub.publish(w, version=v)
    pub.flush()
    replica = Replica(store, 1)
    follower = Follower(
        store, FollowOptions(follow=True), served=replica.served, apply=replica.apply, checksums=replica.checksums
    )
    step(w, 2)
    pub.publish(w, version=2)
    pub.flush()
    path = os.path.join(store.root, store.record(2).file)
    with open(path, "r+b") as f:  # damage the payload, keep the size
        f.seek(-16, os.SEEK_END)
        tail = f.read(16)
        f.seek(-16, os.SEEK_END)
        f.write(bytes(b ^ 0x5A for b in tail))
    before = checksum(replica.tensors)
    run(follower.poll_once())
    assert replica.version == 1 and checksum(replica.tensors) == before  # never applied
    assert 2 in follower.state.skipped and follower.state.last_error_version == 2
    run(follower.poll_once())  # not retried
    assert follower.state.updates == 0
    step(w, 3)
    pub.publish(w, version=3)  # an anchor (anchor_every=3): its chain avoids version 2
    pub.close()
    run(follower.poll_once())
    assert replica.version == 3 and checksum(replica.tensors) == checksum(w)


def test_store_faults_are_retried(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(3)
    with Publisher(store.uri) as pub:
        pub.publish(w, version=0)
    replica = Replica(store, 0)
    calls = {"n": 0}

    async def flaky_apply(version: int) -> float:
        calls["n"] += 1
        if calls["n"] == 1:
            raise DeltaError("store timed out")  # a 500-class fault: retried at the next poll
        return await replica.apply(version)

    follower = Follower(
        store, FollowOptions(follow=True), served=replica.served, apply=flaky_apply, checksums=replica.checksums
    )
    step(w, 1)
    with Publisher(store.uri, anchor_every=100) as pub2:
        pub2.publish(w, version=1)  # a fresh Publisher anchors
    run(follower.poll_once())
    assert replica.version == 0 and follower.state.last_error and not follower.state.skipped
    run(follower.poll_once())
    assert replica.version == 1 and checksum(replica.tensors) == checksum(w)


def test_an_update_a_client_made_first_is_not_applied_again(tmp_path):
    """The service answers None when the served version is already at or past the target (a client's
    /v1/delta/update_weights won the lock): the follower counts no update, records no error."""
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(4)
    with Publisher(store.uri, anchor_every=100) as pub:
        for v in range(0, 3):
            step(w, v)
            pub.publish(w, version=v)
    replica = Replica(store, 0)

    async def client_got_there_first(version: int) -> float | None:
        await replica.apply(version)  # the client's update, under the lock
        return None  # ... so the follower's own finds nothing to do

    follower = Follower(
        store,
        FollowOptions(follow=True),
        served=replica.served,
        apply=client_got_there_first,
        checksums=replica.checksums,
    )
    run(follower.poll_once())
    status = follower.status
    assert replica.applied == [[1, 2]] and status.served == 2 and status.lag == 0
    assert status.updates == 0 and status.last_error is None and not status.skipped


def test_report_only_never_applies(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = make_weights(5)
    with Publisher(store.uri, anchor_every=100) as pub:
        pub.publish(w, version=0)
        step(w, 1)
        pub.publish(w, version=1)
    replica = Replica(store, 0)
    follower = Follower(
        store,
        FollowOptions(follow=False, report=True, replica_id="pushed-0"),
        served=replica.served,
        apply=replica.apply,
        checksums=replica.checksums,
    )
    run(follower.poll_once())
    assert replica.applied == [] and follower.status.lag == 1 and not follower.status.following
    (report,) = Ledger(store).reports()
    assert (report.replica_id, report.served_version, report.newest_seen) == ("pushed-0", 0, 1)


def test_follow_options_from_the_loader_config():
    opts = LoaderOptions.from_extra_config(
        {
            "delta_store": "/s",
            "delta_follow": True,
            "delta_poll_s": 0.5,
            "delta_follow_mode": "wait",
            "delta_chain_cap": 8,
            "delta_report": True,
            "delta_report_s": 3,
            "delta_replica_id": "rollout-0",
        }
    )
    assert opts.follow == FollowOptions(True, 0.5, "wait", 8, True, 3, "rollout-0")
    assert LoaderOptions.from_extra_config({"delta_store": "/s"}).follow == FollowOptions()
    ours, rest = split_extra_config({"delta_store": "/s", "delta_follow": True, "num_threads": 2})
    assert ours == {"delta_store": "/s", "delta_follow": True} and rest == {"num_threads": 2}
    options = server_options("delta", '{"delta_store": "/s", "delta_report": true}')
    assert options is not None and options.follow.report and not options.follow.follow
    bad = {
        "delta_follow": "yes",
        "delta_poll_s": 0,
        "delta_report_s": "10",
        "delta_follow_mode": "later",
        "delta_chain_cap": 0,
        "delta_replica_id": "../etc",
    }
    for key, value in bad.items():
        with pytest.raises(ValueError, match=key):
            LoaderOptions.from_extra_config({"delta_store": "/s", key: value})


def test_follow_status_json_round_trip(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    follower = Follower(
        store,
        FollowOptions(follow=True, report=True, replica_id="r-9"),
        served=lambda: None,  # type: ignore[arg-type,return-value]
        apply=lambda v: None,  # type: ignore[arg-type,return-value]
        checksums=lambda: None,  # type: ignore[arg-type,return-value]
    )
    follower.state.skipped[7] = "IntegrityError: damaged"
    follower.state.newest_seen, follower.state.served, follower.state.last_pause_ms = 9, 6, 12.5
    status = follower.status
    doc = json.loads(json.dumps(to_wire(status)))
    assert doc["lag"] == 3 and doc["skipped"] == {"7": "IntegrityError: damaged"}
    assert from_wire(FollowStatus, doc) == status
