"""The follower's logic against a real store and a real apply engine (an in-process replica on CPU
tensors standing in for a vLLM server: the same plan, staging, verification and commit steps the
server's DeltaService runs). Real servers following a store are tested in tests/vllm/test_fleet.py."""

from __future__ import annotations

import asyncio
import os

import torch

from vllm_delta import DeltaStore, Publisher, checksum, replay
from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.apply.layout import Layout
from vllm_delta.checksums import verify_partials
from vllm_delta.errors import DeltaError
from vllm_delta.ledger import Ledger
from vllm_delta.vllm.follower import Follower, FollowOptions, next_target
from vllm_delta.vllm.plan import plan_update


class Replica:
    """What a server holds: live tensors, the served version, and how it updates (as the service)."""

    def __init__(self, store: DeltaStore, version: int):
        self.store = store
        self.version, tensors = replay(store, version)
        self.tensors = {n: t.clone() for n, t in tensors.items()}
        self.engine = ApplyEngine(self.tensors, Layout.identity({n: tuple(t.shape) for n, t in tensors.items()}))
        self.header = store.open(version).header
        self.applied: list[list[int]] = []

    async def served(self) -> int | None:
        return self.version

    async def apply(self, version: int) -> float:
        plan = plan_update(self.store, self.version, self.header.checksum, version)
        files = [self.store.open(v) for v in plan.versions]
        staged = self.engine.stage(files)
        sums = {n: int(e.checksum, 16) for n, e in self.header.tensors.items()}
        verify_partials(sums, [staged.partials], files[-1].header)
        ms = self.engine.commit(staged)
        self.version, self.header = files[-1].version, files[-1].header
        self.applied.append(plan.versions)
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
