"""The replica ledger (replicas/<id>.json in the store): reports, staleness, expiry, retention, the
`vllm-delta fleet` command, and bounded staleness on the trainer side. Local stores and the real S3
test server."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import torch

from vllm_delta import DeltaStore, Publisher
from vllm_delta.cli import main as cli_main
from vllm_delta.errors import StalenessTimeoutError
from vllm_delta.store.ledger import REPLICAS_DIR, Ledger, ReplicaReport
from vllm_delta.trainer import PublisherOptions, StalenessPolicy, StoreOptions


def report(replica_id="r1", served=3, age_s=0.0, newest=None, checksum=None, error=None) -> ReplicaReport:
    now = time.time()
    return ReplicaReport(
        replica_id=replica_id,
        host="127.0.0.1",
        served_version=served,
        checksum=checksum,
        version_checksum=checksum,
        newest_seen=newest,
        last_pause_ms=12.5,
        last_error=error,
        heartbeat=now - age_s,
        started=now - 100,
    )


def publish_versions(uri: str, n: int, *, anchor_every: int = 2, storage_options=None) -> list:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    infos = []
    with Publisher(
        uri, anchor_every=anchor_every, options=PublisherOptions(store=StoreOptions(storage_options=storage_options))
    ) as pub:
        for v in range(n):
            flat = w.view(-1)
            flat[v * 7 % flat.numel()] += 1
            infos.append(pub.publish({"w": w}, version=v))
    return infos


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return DeltaStore(str(tmp_path / "store"))
    s3 = request.getfixturevalue("s3_server")
    return DeltaStore(s3.uri(f"ledger-{uuid.uuid4().hex[:8]}"), s3.storage_options)


def test_reports_round_trip_and_states(store):
    infos = publish_versions(store.uri, 4, storage_options=store.storage_options)
    ledger = Ledger(store, stale_after_s=30)
    ledger.report(report("a", served=3, checksum=infos[3].checksum))
    ledger.report(report("b", served=1, checksum="0" * 16, age_s=120))
    ledger.report(report("c", served=None))
    states = {s.report.replica_id: s for s in ledger.states()}
    assert set(states) == {"a", "b", "c"}
    assert states["a"].lag == 0 and states["a"].checksum_ok is True and not states["a"].stale
    assert states["b"].lag == 2 and states["b"].checksum_ok is False and states["b"].stale
    assert states["c"].lag is None and states["c"].checksum_ok is None
    assert ledger.live_versions() == {3}
    # a later report replaces the earlier one, seen at once by another reader of the same store
    ledger.report(report("a", served=2))
    fresh = Ledger(DeltaStore(store.uri, store.storage_options))
    assert {r.replica_id: r.served_version for r in fresh.reports()}["a"] == 2


def test_garbage_reports_are_skipped(store, caplog):
    ledger = Ledger(store)
    ledger.report(report("good"))
    for name, data in [("bad.json", b"{not json"), ("foreign.json", b'{"format": "x"}'), ("id.json", b"[1, 2]")]:
        store.objects.write(REPLICAS_DIR, name, data)
    bad_fields = json.loads(report("typed").to_json())
    bad_fields["served_version"] = "three"
    store.objects.write(REPLICAS_DIR, "typed.json", json.dumps(bad_fields).encode())
    assert [r.replica_id for r in ledger.reports()] == ["good"]
    assert "ignoring" in caplog.text


def test_bad_replica_ids_are_refused(store):
    for bad in ["", "../x", "a/b", ".hidden", "x" * 200]:
        with pytest.raises(ValueError):
            Ledger(store).report(report(bad))


def test_expire_and_retain_keep_what_live_replicas_serve(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    publish_versions(store.uri, 9, anchor_every=3)  # anchors 0, 3, 6
    ledger = Ledger(store)
    ledger.report(report("live", served=1))  # on the oldest anchor line
    ledger.report(report("dead", served=4, age_s=2 * 86400))  # expired (default: a day): protects nothing
    deleted = store.retain(1)
    assert [r.replica_id for r in ledger.reports()] == ["live"]
    assert 1 in store.versions() and 0 in store.versions()  # served version and its chain
    assert 4 not in store.versions() and 5 not in store.versions() and set(deleted) >= {2, 4, 5}
    assert store.chain(1)[0].version == 0


def test_fleet_cli(tmp_path, capsys):
    store = DeltaStore(str(tmp_path / "store"))
    infos = publish_versions(store.uri, 3)
    assert cli_main(["fleet", store.uri]) == 0
    assert "no replica reports" in capsys.readouterr().out
    Ledger(store).report(report("srv-1", served=2, checksum=infos[2].checksum))
    Ledger(store).report(report("srv-2", served=1, checksum="f" * 16, age_s=500, error="store timed out"))
    assert cli_main(["fleet", store.uri]) == 0
    out = capsys.readouterr().out
    line1 = next(line for line in out.splitlines() if line.startswith("srv-1"))
    line2 = next(line for line in out.splitlines() if line.startswith("srv-2"))
    assert " ok " in line1 and "STALE" not in line1
    assert "MISMATCH" in line2 and "STALE" in line2 and "store timed out" in line2
    assert cli_main(["fleet", store.uri, "--json"]) == 0
    rows = {r["replica_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["srv-1"]["lag"] == 0 and rows["srv-1"]["checksum_ok"] is True
    assert rows["srv-2"]["lag"] == 1 and rows["srv-2"]["stale"] is True and rows["srv-2"]["checksum_ok"] is False


def test_max_staleness_blocks_and_releases(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = torch.zeros(16, dtype=torch.bfloat16)
    ledger = Ledger(store)
    with Publisher(
        store.uri, options=PublisherOptions(staleness=StalenessPolicy(max_staleness=1, min_replicas=2, timeout_s=30))
    ) as pub:
        pub._gate.policy = pub._gate.policy.__class__(1, 2, 30.0, 0.05)  # poll fast in this test
        for v in (0, 1):  # versions <= first + K never wait
            pub.publish({"w": w + v}, version=v)
        ledger.report(report("a", served=1))
        released = threading.Event()

        def catch_up():
            time.sleep(0.5)
            assert not released.is_set()
            ledger.report(report("b", served=1))

        t = threading.Thread(target=catch_up)
        t.start()
        t0 = time.monotonic()
        pub.publish({"w": w + 2}, version=2)  # needs 2 replicas at >= 1
        released.set()
        t.join()
        assert time.monotonic() - t0 >= 0.4
        assert pub._gate.waited_s >= 0.4


def test_max_staleness_times_out_with_a_clear_error(tmp_path):
    store = DeltaStore(str(tmp_path / "store"))
    w = torch.zeros(16, dtype=torch.bfloat16)
    Ledger(store).report(report("old", served=0))
    Ledger(store).report(report("dead", served=5, age_s=3600))  # stale: does not count
    with Publisher(
        store.uri, options=PublisherOptions(staleness=StalenessPolicy(max_staleness=2, min_replicas=1, timeout_s=0.6))
    ) as pub:
        for v in range(3):
            pub.publish({"w": w + v}, version=v)
        with pytest.raises(StalenessTimeoutError, match=r"0 of 1 required replicas serve a version >= 1") as err:
            pub.publish({"w": w + 3}, version=3)
        assert "delta_report" in str(err.value)
        Ledger(store).report(report("old", served=2))
        pub.publish({"w": w + 3}, version=3)  # the gate holds no grudge: the next call goes through


def test_the_gate_rides_out_a_store_fault(s3_server):
    """A ledger read that fails (the store down: 503) is a poll with no replica, not a publish error."""
    from vllm_delta.testing.proxy import S3Proxy
    from vllm_delta.trainer.staleness import StalenessGate

    uri = s3_server.uri(f"gate-{uuid.uuid4().hex[:8]}")
    Ledger(DeltaStore(uri, s3_server.storage_options)).report(report("r", served=5))
    with S3Proxy(s3_server.endpoint_url) as proxy:
        store = DeltaStore(uri, proxy.storage_options(s3_server.storage_options), timeout_s=2)
        gate = StalenessGate(store, StalenessPolicy(max_staleness=1, min_replicas=1, timeout_s=60, poll_s=0.1))
        gate.first = 0
        proxy.down()
        threading.Timer(1.0, proxy.up).start()
        t0 = time.monotonic()
        assert gate.wait(6) >= 0.0  # the replica at 5 counts once the store answers again
        assert time.monotonic() - t0 >= 0.9
