"""The mirror (issue 20) on real stores: local directories and two real S3 servers (rclone on 127.0.0.1,
other endpoints and other credentials) standing for two regions. What a pass copies (records last,
verified, every part, assets, marks), corrupt source files, stores that go down, two mirrors into one
destination, the ledger flowing back into the source's staleness gate, and the destination's
retention. vLLM followers in a region, and a mirror process SIGKILLed in
the middle of a copy: tests/vllm/test_regions.py."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import torch
from test_ledger import report
from test_parts import commit, write_parts

from vllm_delta import DeltaStore, Publisher, replay
from vllm_delta.cli import main as cli_main
from vllm_delta.errors import MirrorLeaseError, StalenessTimeoutError, VersionExistsError
from vllm_delta.mirror import LEASE_FOLDER, Mirror, MirrorOptions, mirror
from vllm_delta.store.ledger import Ledger
from vllm_delta.store.marks import blocked_by
from vllm_delta.testing.proxy import S3Proxy
from vllm_delta.testing.s3 import S3Server
from vllm_delta.trainer import PublisherOptions, StalenessPolicy, StoreOptions
from vllm_delta.trainer.staleness import StalenessGate

REGION_KEYS = ("EUACCESSKEY789", "EUSECRETKEY012")  # the second region's server has keys of its own


@pytest.fixture(scope="module")
def region(tmp_path_factory):
    """The second S3 server: another endpoint, other credentials."""
    key, secret = REGION_KEYS
    with S3Server(str(tmp_path_factory.mktemp("region")), access_key=key, secret_key=secret) as s3:
        yield s3


def new_store(kind: str, tmp_path, s3: S3Server | None) -> DeltaStore:
    name = f"run-{uuid.uuid4().hex[:8]}"
    if kind == "local":
        return DeltaStore(str(tmp_path / name))
    assert s3 is not None
    return DeltaStore(s3.uri(name), s3.storage_options, cache_dir=str(tmp_path / f"cache-{name}"))


def publish(store: DeltaStore, versions: range, *, anchor_every: int = 3, seed: int = 0) -> dict[int, str]:
    """Versions of a small model (an anchor every `anchor_every`), config.json as an asset; checksums."""
    gen = torch.Generator().manual_seed(seed)
    w = {"a": torch.randn(64, 48, generator=gen).to(torch.bfloat16), "b": torch.randn(96, generator=gen).bfloat16()}
    out = {}
    opts = PublisherOptions(store=StoreOptions(storage_options=store.storage_options))
    with Publisher(store.uri, anchor_every=anchor_every, options=opts) as pub:
        for v in versions:
            for t in w.values():
                t.view(-1)[(v * 7) % t.numel() :: 11] += 0.25
            out[v] = pub.publish(w, version=v).checksum
    if not store.objects.assets():
        store.objects.put_asset("config.json", b'{"model_type": "tiny"}')
    return out


def assert_same(src: DeltaStore, dst: DeltaStore, versions: list[int]) -> None:
    """The destination holds exactly `versions`, each bit-identical to the source's."""
    assert dst.versions() == versions
    for v in versions:
        a, b = src.record(v, fresh=True), dst.record(v, fresh=True)
        assert (a.kind, a.base, a.checksum, a.files, a.sizes) == (b.kind, b.base, b.checksum, b.files, b.sizes)
        assert all(d.sha256 for d in b.data_files)  # the destination's records carry every file's sha256
        _, ta = replay(src, v)
        _, tb = replay(dst, v)
        assert all(torch.equal(ta[n].view(torch.int16), tb[n].view(torch.int16)) for n in ta)
    assert dst.objects.assets() == src.objects.assets()
    for name in src.objects.assets():
        assert dst.objects.get_asset(name) == src.objects.get_asset(name)


@pytest.mark.parametrize("pair", ["local->local", "s3->s3", "s3->local", "local->s3"])
def test_a_pass_copies_every_version_verified_and_records_last(pair, tmp_path, s3_server, region):
    src_kind, dst_kind = pair.split("->")
    src = new_store(src_kind, tmp_path, s3_server)
    dst = new_store(dst_kind, tmp_path, region)
    publish(src, range(0, 5))  # anchors 0 and 3
    p = mirror(src, dst, options=MirrorOptions(region="eu", everything=True))
    assert p is not None and p.copied == [0, 1, 2, 3, 4] and not p.corrupt and not p.skipped
    assert_same(src, dst, [0, 1, 2, 3, 4])
    assert dst.head() is not None and dst.head().version == 4  # type: ignore[union-attr]
    assert dst.objects.names(LEASE_FOLDER) == []  # a clean stop gives the lease back
    publish(src, range(5, 7))
    p = mirror(src, dst, options=MirrorOptions(region="eu"))
    assert p is not None and p.copied == [5, 6]
    assert_same(src, dst, list(range(7)))
    p = mirror(src, dst, options=MirrorOptions(region="eu"))
    assert p is not None and p.copied == []  # nothing new: nothing read but the polls


def test_the_first_pass_starts_at_the_newest_anchor(tmp_path):
    src, dst = DeltaStore(str(tmp_path / "src")), DeltaStore(str(tmp_path / "dst"))
    publish(src, range(0, 8))  # anchors 0, 3, 6
    p = mirror(src, dst)
    assert p is not None and p.copied == [6, 7]
    assert_same(src, dst, [6, 7])


def test_a_first_pass_starts_below_a_newest_anchor_marked_bad(tmp_path):
    """A marked newest anchor blocks its chain; the first pass then starts at the anchor before it, so
    a new region serves what the source's readers serve instead of nothing."""
    src, dst = DeltaStore(str(tmp_path / "src")), DeltaStore(str(tmp_path / "dst"))
    publish(src, range(0, 8))  # anchors 0, 3, 6
    src.mark_bad(6, "diverged")
    p = mirror(src, dst)
    assert p is not None and p.copied == [3, 4, 5] and sorted(p.skipped) == [6, 7]
    assert_same(src, dst, [3, 4, 5])
    assert dst.latest() == 5


def test_multi_part_versions_are_copied_part_by_part(tmp_path, s3_server, region):
    src = new_store("s3", tmp_path, s3_server)
    dst = new_store("s3", tmp_path, region)
    for version, base in ((0, None), (1, 0), (2, 1)):
        commit(src, write_parts(str(tmp_path), version, base))
    with S3Proxy(s3_server.endpoint_url) as proxy:
        counted = DeltaStore(src.uri, proxy.storage_options(s3_server.storage_options))
        p = mirror(counted, dst, options=MirrorOptions(everything=True))
        # every part read once from the source, no more
        sizes = sum(size for v in (0, 1, 2) for size in src.record(v).sizes)
        assert proxy.counts.bytes_out("GET", "data") == sizes
    assert p is not None and p.copied == [0, 1, 2]
    for v in (0, 1, 2):
        rec = dst.record(v)
        assert len(rec.parts) == 2 and rec.parts == src.record(v).parts
    assert_same(src, dst, [0, 1, 2])


def flip_tail(store: DeltaStore, file: str) -> None:
    """Damage the payload's last bytes in place, keeping the size (what bit rot does)."""
    path = f"{store.root}/{file}"
    data = store.fs.cat_file(path)
    store.fs.pipe_file(path, data[:-16] + bytes(b ^ 0x5A for b in data[-16:]))


@pytest.mark.parametrize("src_kind", ["s3", "local"])
def test_a_corrupt_source_file_is_never_copied_and_is_marked(src_kind, tmp_path, s3_server, region, caplog):
    # S3 records carry sha256; local ones do not: there the mirror checks the payload itself.
    src = new_store(src_kind, tmp_path, s3_server)
    dst = new_store("s3", tmp_path, region)
    publish(src, range(0, 2), anchor_every=4)
    mirror(src, dst)
    publish(src, range(2, 4), anchor_every=4, seed=0)  # a new Publisher: 2 is an anchor, 3 a delta on it
    src2 = DeltaStore(src.uri, src.storage_options)
    flip_tail(src2, src2.record(3).files[0])
    publish(src, range(4, 5), anchor_every=4, seed=0)  # 4: an anchor again (a new Publisher)
    flip_tail(src2, src2.record(4).files[0])  # ... corrupt too
    with caplog.at_level("WARNING"):
        p = mirror(src, dst)
    assert p is not None and p.copied == [2] and p.corrupt == [3, 4]
    assert dst.versions() == [0, 1, 2]  # never copied as good
    assert "failed verification" in caplog.text
    dst_marks, src_marks = dst.marks(), src.marks()
    assert sorted(dst_marks) == [3, 4] and "corrupt in the source" in dst_marks[3].reason
    assert sorted(src_marks) == [3, 4]  # marked in the source too: its trainer's gate and next anchor
    assert blocked_by(src.chain(4), src_marks) is not None
    # The trainer's next version: an anchor (it reads the marks after each commit) -> copied.
    publish(src, range(5, 7), anchor_every=100, seed=1)
    p = mirror(src, dst)
    assert p is not None and p.copied == [5, 6] and dst.versions() == [0, 1, 2, 5, 6]
    assert_same(src, dst, [0, 1, 2, 5, 6])


def test_a_delta_on_a_version_the_destination_lacks_is_skipped(tmp_path):
    src, dst = DeltaStore(str(tmp_path / "src")), DeltaStore(str(tmp_path / "dst"))
    publish(src, range(0, 3), anchor_every=10)
    src.mark_bad(1, "diverged")  # marked before the mirror saw it: 1 and 2 are blocked
    p = mirror(src, dst, options=MirrorOptions(everything=True))
    assert p is not None and p.copied == [0] and sorted(p.skipped) == [1, 2]
    assert "marked bad" in p.skipped[1] and list(dst.marks()) == [1]  # the mark travels anyway


def test_marks_made_in_the_source_reach_the_destination(tmp_path, s3_server, region):
    src = new_store("s3", tmp_path, s3_server)
    dst = new_store("s3", tmp_path, region)
    publish(src, range(0, 3))
    mirror(src, dst)
    mark = src.mark_bad(2, "reward hacking")
    p = mirror(src, dst)
    assert p is not None and p.marks == [2]
    assert dst.marks() == {2: mark} and blocked_by(dst.chain(2), dst.marks()) == mark
    p = mirror(src, dst)
    assert p is not None and p.marks == []  # copied once


def test_two_mirrors_into_one_destination_are_refused(tmp_path, capsys):
    src, dst = DeltaStore(str(tmp_path / "src")), DeltaStore(str(tmp_path / "dst"))
    other = DeltaStore(str(tmp_path / "other-src"))
    publish(src, range(0, 2))
    publish(other, range(0, 2), seed=5)
    first = Mirror(src, dst, MirrorOptions(region="eu", owner="mirror-eu"))
    first.run_once()  # holds the lease
    second = Mirror(other, dst, MirrorOptions(region="us", owner="mirror-us"))
    with pytest.raises(MirrorLeaseError, match="mirror-eu") as err:
        second.run_once()
    assert err.value.http_status == 409 and "one mirror per destination" in str(err.value)
    assert cli_main(["mirror", other.uri, dst.uri, "--owner", "mirror-us"]) == 1
    assert "MirrorLeaseError" in capsys.readouterr().err
    assert dst.versions() == [0, 1] and dst.record(1).checksum == src.record(1).checksum
    # The same owner, restarted (a new process), takes its lease back at once.
    again = Mirror(src, dst, MirrorOptions(region="eu", owner="mirror-eu"))
    again.run_once()
    with pytest.raises(MirrorLeaseError, match="lost the lease"):
        first.run_once()  # the old incarnation notices before its next commit
    again.close()
    # A dead holder's lease expires after its TTL.
    stale = Mirror(src, dst, MirrorOptions(region="eu", owner="dead", lease_ttl_s=0.5))
    stale.run_once()
    time.sleep(0.6)
    with pytest.raises(VersionExistsError):  # takes the lease, then refuses another source's versions
        Mirror(other, dst, MirrorOptions(region="us", owner="mirror-us", lease_ttl_s=0.5, everything=True)).run_once()


def test_the_ledger_flows_back_and_the_gate_waits_on_the_region(tmp_path, s3_server, region, capsys):
    src = new_store("s3", tmp_path, s3_server)
    dst = new_store("s3", tmp_path, region)
    publish(src, range(0, 3))
    m = Mirror(src, dst, MirrorOptions(region="eu"))
    regional = Ledger(dst)
    regional.report(report("follower-1", served=2, checksum=src.record(2).checksum))
    p = m.run_once()
    assert p.forwarded == 1
    (fwd,) = Ledger(src).reports()
    assert (fwd.replica_id, fwd.region, fwd.served_version) == ("eu.follower-1", "eu", 2)
    assert m.run_once().forwarded == 0  # unchanged: not written again
    assert cli_main(["fleet", src.uri, "--storage-options", json.dumps(src.storage_options), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["replica_id"], row["region"], row["checksum_ok"]) == ("eu.follower-1", "eu", True)
    # Publishing 4 with max_staleness 1 needs the regional replica at >= 3: its report, forwarded.
    gate = StalenessGate(src, StalenessPolicy(max_staleness=1, min_replicas=1, timeout_s=0.5, poll_s=0.05))
    gate.first = 0
    with pytest.raises(StalenessTimeoutError):
        gate.wait(4)
    regional.report(report("follower-1", served=3))
    m.run_once()
    assert gate.wait(4) < 0.5
    # A regional report that goes away goes away in the source too.
    regional.remove("follower-1")
    m.run_once()
    assert Ledger(src).reports() == []
    m.close()


def test_the_destination_keeps_its_own_retention(tmp_path):
    src, dst = DeltaStore(str(tmp_path / "src")), DeltaStore(str(tmp_path / "dst"))
    publish(src, range(0, 10))  # anchors 0, 3, 6, 9
    Ledger(dst).report(report("r", served=1))  # a live regional replica serves 1: kept with its chain
    p = mirror(src, dst, options=MirrorOptions(everything=True, keep_anchors=1, forward_ledger=False))
    assert p is not None and p.copied == list(range(10))
    assert dst.versions() == [0, 1, 9] and src.versions() == list(range(10))


def test_store_faults_are_retried_with_backoff(tmp_path, s3_server, region):
    src = new_store("s3", tmp_path, s3_server)
    dst = new_store("s3", tmp_path, region)
    publish(src, range(0, 2))
    with S3Proxy(s3_server.endpoint_url) as proxy, S3Proxy(region.endpoint_url) as proxy_b:
        via = DeltaStore(src.uri, proxy.storage_options(s3_server.storage_options), timeout_s=5)
        into = DeltaStore(dst.uri, proxy_b.storage_options(region.storage_options), timeout_s=5)
        m = Mirror(via, into, MirrorOptions(poll_s=0.1, backoff_max_s=0.4))
        stop = threading.Event()
        t = threading.Thread(target=m.follow, args=(stop,))
        t.start()
        try:
            deadline = time.monotonic() + 30
            while dst.latest() != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert dst.latest() == 1
            proxy.down()  # the source's region is unreachable
            publish(src, range(2, 4))
            time.sleep(1.5)
            assert t.is_alive() and dst.latest() == 1  # retrying, nothing half-copied
            proxy.up()
            deadline = time.monotonic() + 30
            while dst.latest() != 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert dst.latest() == 3
            proxy_b.down()  # now the destination's region
            publish(src, range(4, 6))
            time.sleep(1.5)
            assert t.is_alive() and dst.latest() == 3
            proxy_b.up()
            deadline = time.monotonic() + 30
            while dst.latest() != 5 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert dst.latest() == 5
        finally:
            stop.set()
            t.join(timeout=30)
    assert not t.is_alive()
    assert_same(src, dst, [0, 1, 2, 3, 4, 5])
    assert dst.objects.names(LEASE_FOLDER) == []
