"""DeltaStore under real faults (issue 8): readers see what other processes publish, a store that is
down or frozen fails fast with an error naming it and works again once it is back, the download
cache verifies, heals and stays bounded, and an unwritable cache is a clear error.

The S3 server here is this module's own (rclone serve s3 on 127.0.0.1): the tests stop and freeze it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import subprocess
import time
import uuid

import pytest
from test_store import History, publish_history

from vllm_delta.errors import (
    CacheError,
    FormatError,
    IntegrityError,
    StoreTimeoutError,
    StoreUnavailableError,
    VersionNotFoundError,
)
from vllm_delta.format import VersionFile
from vllm_delta.store import TMP_PREFIX, DeltaStore, VersionRecord, store_error
from vllm_delta.testing.s3 import S3Server

TIMEOUT_S = 4.0  # tight, but not so tight that a loaded 2-core machine trips it while the store is up


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture
def history() -> History:
    return History()


def new_uri(s3) -> str:
    return s3.uri(f"faults-{uuid.uuid4().hex[:10]}")


def reader_of(s3, uri: str, cache: str, **kwargs) -> DeltaStore:
    return DeltaStore(uri, s3.storage_options, cache_dir=cache, timeout_s=TIMEOUT_S, **kwargs)


def damage_object(store: DeltaStore, relpath: str) -> bytes:
    """Flip the last bytes of an object in the store (through S3, as any writer would); returns the
    original bytes."""
    path = store.root + "/" + relpath
    data = store.fs.cat_file(path)
    store.fs.pipe_file(path, data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    return data


def flip(path: str, n: int = 8) -> bytes:
    with open(path, "r+b") as f:
        f.seek(-n, os.SEEK_END)
        data = f.read(n)
        f.seek(-n, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in data))
    return data


# -- fresh reads ---------------------------------------------------------------------------------
def test_reader_sees_versions_and_assets_published_after_it_listed(s3, history, tmp_path):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
    writer.objects.put_asset("config.json", b"{}")
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    assert reader.versions() == [0, 1] and reader.latest() == 1
    assert reader.objects.assets() == ["config.json"]  # the reader's listings are cached by fsspec now
    publish_history(writer, history, str(tmp_path), [(2, 1), (3, 2)])
    writer.objects.put_asset("tokenizer.json", b"[]")
    # What a worker does: read a record and open the version it names, with no listing in between.
    assert reader.record(3).base == 2
    with reader.open(3) as vf:
        history.check_file(vf)
    assert reader.objects.get_asset("tokenizer.json") == b"[]"
    assert reader.resolve(2) == 2 and reader.latest() == 3


def test_latest_polls_only_what_is_new(s3, history, tmp_path):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    assert reader.latest() == 1
    full_at = reader.record_reader.poller.counts.full_listings
    requests: list[str] = []
    reader.fs.s3.meta.events.register("before-send.s3", lambda request, **kw: requests.append(request.url))
    publish_history(writer, history, str(tmp_path), [(2, 1), (3, 2)])
    assert reader.latest() == 3
    polls = reader.record_reader.poller.counts
    assert polls.full_listings == full_at, "a poll between full listings must not list everything"
    # With a head: three GETs (head.json, the newest record, the next one), no listing.
    assert not [u for u in requests if "list-type=2" in u], requests
    assert sorted(u.rsplit("/", 1)[-1] for u in requests) == ["0000000003.json", "0000000004.json", "head.json"]
    # Without one (an older publisher's store): the records after the newest seen, and one GET.
    writer.fs.rm_file(writer.root + "/head.json")
    publish_history(writer, history, str(tmp_path), [(4, 3)])
    writer.fs.rm_file(writer.root + "/head.json")
    requests.clear()
    assert reader.latest() == 4
    listings = [u for u in requests if "list-type=2" in u]
    assert len(listings) == 1 and "start-after=" in listings[0], requests
    assert reader.record_reader.poller.counts.full_listings == full_at
    # The newest record seen disappears (the store was emptied and refilled): a full listing.
    writer.fs.rm_file(writer.root + "/versions/0000000004.json")
    writer.fs.rm_file(writer.root + "/versions/0000000003.json")
    assert reader.latest() == 2
    assert reader.record_reader.poller.counts.full_listings > full_at


def test_a_rewritten_store_is_read_afresh_where_it_matters(s3, tmp_path):
    uri = new_uri(s3)
    run_a, run_b = History(seed=1), History(seed=2)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, run_a, str(tmp_path), [(0, None), (1, 0)])
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    old = reader.record(1)
    writer.fs.rm(writer.root, recursive=True)  # wiped, then refilled by another run, same numbers
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, run_b, str(tmp_path), [(0, None), (1, 0), (2, 1)])
    assert reader.record(1) == old  # remembered...
    new = reader.record(1, fresh=True)  # ...but a decision reads it again
    assert new.checksum == run_b.sums(1)[0] != old.checksum
    assert [r.checksum for r in reader.plan(1, 2, fresh=True)] == [run_b.sums(2)[0]]
    with reader.open(2, fresh=True) as vf:
        run_b.check_file(vf)


# -- deadlines -------------------------------------------------------------------------------------
def test_a_frozen_store_times_out_and_recovers(history, tmp_path):
    with S3Server() as s3:
        uri = new_uri(s3)
        publish_history(DeltaStore(uri, s3.storage_options), history, str(tmp_path), [(0, None), (1, 0)])
        # Tight deadlines, and a first call before the freeze (a new S3 client takes a while to set up).
        writer = DeltaStore(uri, s3.storage_options, timeout_s=TIMEOUT_S)
        reader = reader_of(s3, uri, str(tmp_path / "cache"))
        assert reader.latest() == 1 and writer.latest() == 1
        path = str(tmp_path / "v2.safetensors")
        header = history.write_delta(path, 2, 1)
        s3.freeze()
        try:
            for name, op in [
                ("record", lambda: reader.record(1, fresh=True)),
                ("listing", reader.versions),
                ("download", lambda: reader.local_path(1)),
                ("upload", lambda: writer.writer.commit_file(header, path)),  # a PUT would wait forever without it
                ("asset", lambda: writer.objects.put_asset("x.json", b"{}")),
            ]:
                t0 = time.monotonic()
                with pytest.raises(StoreTimeoutError, match=f"store {uri}") as info:
                    op()
                took = time.monotonic() - t0
                assert took < 4 * TIMEOUT_S + 2, (name, took)
                assert info.value.http_status == 504
        finally:
            s3.thaw()
        assert reader.versions() == [0, 1]
        with reader.open(1) as vf:
            history.check_file(vf)
        writer.writer.commit_file(header, path)
        assert reader.latest() == 2


def test_a_store_that_is_down_is_unavailable_until_it_is_back(history, tmp_path):
    with S3Server() as s3:
        uri = new_uri(s3)
        writer = DeltaStore(uri, s3.storage_options)
        publish_history(writer, history, str(tmp_path), [(0, None)])
        # botocore's retries back off for a few seconds before they give up on a refused connection:
        # a deadline longer than that, so that "unreachable" (503) is told from "too slow" (504).
        reader = DeltaStore(uri, s3.storage_options, cache_dir=str(tmp_path / "cache"), timeout_s=15)
        port = s3.port
        s3.down()
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailableError, match=f"store {uri} is unreachable") as info:
                reader.latest()
            assert info.value.http_status == 503 and time.monotonic() - t0 < 15
            with pytest.raises(StoreUnavailableError):
                reader.local_path(0)
        finally:
            s3.up()
        assert s3.port == port
        assert reader.latest() == 0
        with reader.open(0) as vf:
            history.check_file(vf)


def test_store_errors_are_recognized_by_kind():
    class ReadTimeoutError(Exception):
        pass

    class EndpointConnectionError(Exception):
        pass

    assert isinstance(store_error(ReadTimeoutError("x"), "s3://b/p", "op"), StoreTimeoutError)
    assert isinstance(store_error(TimeoutError(), "s3://b/p", "op"), StoreTimeoutError)
    assert isinstance(store_error(EndpointConnectionError("x"), "s3://b/p", "op"), StoreUnavailableError)
    assert isinstance(store_error(ConnectionRefusedError(), "s3://b/p", "op"), StoreUnavailableError)
    assert store_error(ValueError("x"), "s3://b/p", "op") is None


def test_s3_options_get_deadlines_and_a_private_instance(s3):
    options = {**s3.storage_options, "config_kwargs": {**s3.storage_options["config_kwargs"], "read_timeout": 7}}
    store = DeltaStore(s3.uri("opts"), options, timeout_s=30)
    config = store.fs.config_kwargs
    assert config["read_timeout"] == 7  # the user's value wins
    assert config["connect_timeout"] == 5 and config["retries"]["total_max_attempts"] == 3
    assert config["response_checksum_validation"] == "when_required"
    assert store.fs.retries == 1
    other = DeltaStore(s3.uri("opts"), s3.storage_options)
    assert other.fs is not store.fs  # listing caches are never shared with anyone else's instance


# -- the download cache ----------------------------------------------------------------------------
def test_cache_heals_a_damaged_or_partial_copy(s3, history, tmp_path):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    assert reader.record(1).sha256 is not None
    path = reader.local_path(1)
    good = open(path, "rb").read()
    # Damaged in place (same size): the digest says so, the copy is fetched again.
    flip(path)
    other = reader_of(s3, uri, str(tmp_path / "cache"))  # another process: nothing memoized
    assert other.local_path(1) == path and open(path, "rb").read() == good
    # A partial copy under the final name (a process killed by an older version, a copy tool).
    with open(path, "r+b") as f:
        f.truncate(100)
    assert reader.local_path(1) == path and open(path, "rb").read() == good
    with reader.open(1) as vf:
        history.check_file(vf)


def test_damaged_store_file_is_refused_and_nothing_is_cached_until_it_is_restored(s3, history, tmp_path):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    relpath = reader.record(1).file
    saved = damage_object(writer, relpath)
    with pytest.raises(IntegrityError, match="sha256"):
        reader.local_path(1)
    assert os.listdir(reader.cache.folder()) == []
    writer.fs.pipe_file(writer.root + "/" + relpath, saved)
    with reader.open(1) as vf:
        history.check_file(vf)


def test_old_records_without_a_digest_are_checked_by_size_and_dropped_on_demand(s3, history, tmp_path):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
    record_path = writer.root + "/versions/0000000001.json"
    doc = json.loads(writer.fs.cat_file(record_path))
    del doc["sha256"]  # what an older publisher wrote
    writer.fs.pipe_file(record_path, json.dumps(doc).encode())
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    assert reader.record(1).sha256 is None
    path = reader.local_path(1)
    good = open(path, "rb").read()
    flip(path)  # same size: accepted by size (the staging checksums catch it)
    assert reader.local_path(1) == path and open(path, "rb").read() != good
    assert reader.cache.prune(versions=[1]) == [os.path.basename(path)]  # what a server does after a 422
    assert reader.local_path(1) == path and open(path, "rb").read() == good


def _pruned_after_check(store: DeltaStore, times: int) -> list[str]:
    """The window a shared cache opens: another process prunes the copy after this one checked it and
    before it opened it (the first `times` checks). Returns the paths pruned that way."""
    real, pruned = store.cache.copy, []

    def copy(data, *, version, download):
        path = real(data, version=version, download=download)
        if len(pruned) < times:
            os.remove(path)
            pruned.append(path)
        return path

    store.cache.copy = copy  # type: ignore[method-assign]
    return pruned


def test_a_copy_pruned_before_its_open_is_fetched_again_once(s3, history, tmp_path, caplog):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    pruned = _pruned_after_check(reader, 1)
    with caplog.at_level("WARNING", logger="vllm_delta.store.delta_store"), reader.open(1) as vf:
        history.check_file(vf)
    assert len(pruned) == 1 and os.path.exists(pruned[0])  # fetched again, verified, in the cache
    assert "vanished before it was opened: fetching it again" in caplog.text
    # Twice in a row: a clear, transient error (503); nothing is left half-done, the next open works.
    pruned = _pruned_after_check(reader, 2)
    with pytest.raises(CacheError, match="vanished twice") as err:
        reader.open(0)
    assert err.value.http_status == 503 and err.value.version == 0
    with reader.open(0) as vf:
        history.check_file(vf)


def test_a_local_version_deleted_before_its_open_is_not_found(tmp_path, history, monkeypatch):
    store = DeltaStore(str(tmp_path / "s"))
    (rec,) = publish_history(store, history, str(tmp_path), [(0, None)])
    real = store.files.local_paths

    def deleted_after_check(rec_):
        paths = real(rec_)
        os.remove(os.path.join(store.root, rec.file))
        os.remove(os.path.join(store.root, "versions", "0000000000.json"))  # retention took it whole
        return paths

    monkeypatch.setattr(store.files, "local_paths", deleted_after_check)  # where open() finds the files
    with pytest.raises(VersionNotFoundError, match="removed"):
        store.open(0)


def test_a_server_pruning_a_shared_cache_keeps_what_a_peer_ahead_of_it_stages(s3, history, tmp_path):
    """Two servers following one store share a host's cache folder (vLLM's `delta_cache_dir`). The one
    behind prunes after its update: the newer copies the one ahead downloaded (and may be staging) stay;
    older ones off its chain go."""
    from vllm_delta.vllm.shared.cache_keep import CacheKeeper

    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0), (2, 1), (3, None), (4, 3), (5, 4)])
    behind, ahead = (reader_of(s3, uri, str(tmp_path / "cache")) for _ in range(2))
    paths = {v: ahead.local_path(v) for v in range(6)}
    CacheKeeper(behind, None).prune(served=3)
    assert {v for v, p in paths.items() if os.path.exists(p)} == {3, 4, 5}  # 3's chain is 3 itself
    for v in (4, 5):
        with ahead.open(v) as vf:
            history.check_file(vf)
    CacheKeeper(ahead, None).prune(served=5)
    assert {v for v, p in paths.items() if os.path.exists(p)} == {3, 4, 5}
    CacheKeeper(behind, None).prune(served=5, staged=[])
    assert behind.cache.total_bytes() == sum(os.path.getsize(paths[v]) for v in (3, 4, 5))


def test_prune_keeps_what_is_asked_removes_leftovers_and_caps(s3, history, tmp_path):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0), (2, 1), (3, None)])
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    paths = {v: reader.local_path(v) for v in range(4)}
    folder = os.path.dirname(paths[0])
    stale, fresh = os.path.join(folder, TMP_PREFIX + "dead"), os.path.join(folder, TMP_PREFIX + "busy")
    for p in (stale, fresh):
        open(p, "wb").write(b"x" * 1000)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    removed = reader.cache.prune(keep=[1, 2, 3])
    assert sorted(removed) == sorted([os.path.basename(paths[0]), os.path.basename(stale)])
    assert os.path.exists(fresh)  # another process may be downloading into it
    os.remove(fresh)
    total = reader.cache.total_bytes()
    assert total == sum(os.path.getsize(paths[v]) for v in (1, 2, 3))
    # The cap: oldest first, never a protected (staged) version.
    cap = os.path.getsize(paths[3]) + os.path.getsize(paths[2]) - 1
    removed = reader.cache.prune(keep=[1, 2, 3], max_bytes=cap, protect=[2])
    assert sorted(removed) == sorted(os.path.basename(paths[v]) for v in (1, 3))
    assert reader.cache.total_bytes() == os.path.getsize(paths[2])


def _unwritable(folder: str):
    """Make `folder` unwritable even for root (chattr +i), else by its mode; a context manager."""

    @contextlib.contextmanager
    def ctx():
        root = os.geteuid() == 0
        if root:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", folder]).returncode:
                pytest.skip("no chattr +i here: cannot make a folder read-only for root")
        else:
            os.chmod(folder, 0o555)
        try:
            yield
        finally:
            if root:
                subprocess.run(["chattr", "-i", folder], check=True)
            else:
                os.chmod(folder, 0o755)

    return ctx()


def test_a_read_only_cache_is_a_clear_error_until_it_is_writable(s3, history, tmp_path):
    uri = new_uri(s3)
    writer = DeltaStore(uri, s3.storage_options)
    publish_history(writer, history, str(tmp_path), [(0, None)])
    reader = reader_of(s3, uri, str(tmp_path / "cache"))
    folder = reader.cache.folder()
    with _unwritable(folder):
        with pytest.raises(CacheError, match="download cache") as info:
            reader.local_path(0)
        assert info.value.http_status == 503
        assert reader.cache.prune() == []  # nothing to prune, no exception either
    with reader.open(0) as vf:
        history.check_file(vf)


def test_a_full_cache_is_a_clear_error_until_there_is_room(s3, history, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        uri = new_uri(s3)
        big = History({"w": (256, 256)})  # a 128 KiB anchor
        writer = DeltaStore(uri, s3.storage_options)
        publish_history(writer, big, str(tmp_path), [(0, None)])
        reader = reader_of(s3, uri, str(mnt))
        with pytest.raises(CacheError, match=os.strerror(errno.ENOSPC)):
            reader.local_path(0)
        assert [n for n in os.listdir(reader.cache.folder()) if n.startswith(TMP_PREFIX)] == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    with reader.open(0) as vf:  # the folder is on the disk again: room
        big.check_file(vf)


# -- records and headers ---------------------------------------------------------------------------
def test_non_hex_checksums_are_format_errors(tmp_path, history):
    store = DeltaStore(str(tmp_path / "s"))
    (rec,) = publish_history(store, history, str(tmp_path), [(0, None)])
    doc = json.loads(rec.to_json())
    doc["checksum"] = "zz" + doc["checksum"][2:]
    with pytest.raises(FormatError, match="hex"):
        VersionRecord.from_json(json.dumps(doc))
    path = os.path.join(store.root, rec.file)
    vf = VersionFile(path)
    header = vf.header
    first = next(iter(header.tensors))
    header.tensors[first] = dataclasses.replace(header.tensors[first], checksum="not-hex-at-all!!")
    with pytest.raises(FormatError, match="hex"):
        header.validate()


def test_records_without_the_optional_digest_still_parse(tmp_path, history):
    store = DeltaStore(str(tmp_path / "s"))
    (rec,) = publish_history(store, history, str(tmp_path), [(0, None)])
    doc = json.loads(rec.to_json())
    assert "sha256" not in doc  # a local store's readers use the file itself: no digest is written
    old = VersionRecord.from_json(json.dumps(doc))
    assert old.sha256 is None and "sha256" not in json.loads(old.to_json())
    with pytest.raises(VersionNotFoundError):
        store.resolve(10**10)


@pytest.mark.parametrize("cuts", [1, 2])
def test_a_read_cut_short_is_read_again_once(monkeypatch, cuts):
    """An object whose body came back shorter than its Content-Length (aiohttp's ClientPayloadError; seen
    from rclone's S3 server while the trainer rewrote head.json) is read again once: a transient fault
    does not become a follower's error. Twice cut short, it is the store's 503 error. (fsspec's real
    in-memory filesystem, its reads cut short on purpose: the S3 server here cannot be made to.)"""
    from vllm_delta.store.fs import StoreFS

    fs = StoreFS(f"memory://cut-short-{cuts}", {}, timeout_s=5)
    path = fs.path("head.json")
    fs.fs.pipe_file(path, b'{"latest": 3}')

    class ClientPayloadError(Exception):  # aiohttp's class name, which is what the store recognizes
        pass

    real, calls = fs.fs.cat_file, []

    def cut_short(p, **kw):
        calls.append(p)
        if len(calls) <= cuts:
            raise ClientPayloadError("Response payload is not completed: not enough data for content length")
        return real(p, **kw)

    monkeypatch.setattr(fs.fs, "cat_file", cut_short)
    if cuts == 1:
        assert fs.cat(path, "reading head.json") == b'{"latest": 3}' and len(calls) == 2
    else:
        with pytest.raises(StoreUnavailableError, match="head.json.*ClientPayloadError"):
            fs.cat(path, "reading head.json")
        assert len(calls) == 2


def test_other_read_errors_are_not_read_again(monkeypatch):
    from vllm_delta.store.fs import StoreFS

    fs = StoreFS("memory://not-again", {}, timeout_s=5)
    calls = []

    def refused(p, **kw):
        calls.append(p)
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(fs.fs, "cat_file", refused)
    with pytest.raises(StoreUnavailableError, match="head.json"):
        fs.cat(fs.path("head.json"), "reading head.json")
    assert len(calls) == 1
