"""Staging reads an open version file's bytes with preadv (format/mapped_files.py) and falls back to the
mapping when the path no longer names the file that was mapped: the same bytes either way."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from vllm_delta.apply import staging
from vllm_delta.format import VersionFile, mapped_files
from vllm_delta.testing.apply_fixtures import random_changes, write_delta


def _version(tmp_path, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    hf = {"a": torch.randn(64, 300, generator=gen).bfloat16(), "b": torch.randn(1000, generator=gen).bfloat16()}
    path = str(tmp_path / "v1.safetensors")
    shapes = {k: tuple(t.shape) for k, t in hf.items()}
    write_delta(path, version=1, base=0, codec="chunked", shapes=shapes, changes=random_changes(hf, 0.2, seed))
    return path


class _Decoder:  # what staging's _Host borrows from its Decoder: a pool and a byte count
    def __init__(self):
        self.pool = ThreadPoolExecutor(2)
        self.host_bytes = 0
        self.device = torch.device("cpu")


def _read(vf: VersionFile, ranges) -> np.ndarray:
    host = staging._Host(_Decoder(), {})
    fetched = host.read(ranges)
    fetched.wait()
    return fetched.data.numpy().copy()


def _ranges(vf: VersionFile):
    blob = vf.file_payload()["blob"].numpy()
    return blob, [(blob, 0, blob.size), (blob, 7, min(blob.size, 4103))]


@pytest.mark.parametrize("after", ["as_is", "replaced", "removed"])
def test_staging_reads_an_open_file_by_preadv_or_its_mapping(tmp_path, monkeypatch, after):
    path = _version(tmp_path)
    with VersionFile(path) as vf:
        blob, ranges = _ranges(vf)
        want = np.concatenate([blob[a:b] for _, a, b in ranges])
        span = mapped_files.span_of(blob.ctypes.data, blob.size)
        assert span is not None and span.path == os.path.abspath(path)
        if after == "replaced":  # another file (another inode) under the same path: read from the mapping
            shutil.copy(path, path + ".new")
            os.replace(path + ".new", path)
        elif after == "removed":
            os.unlink(path)
        reads = {"pread": 0, "map": 0}
        pread, copy = mapped_files.pread_into, staging._copy_into

        def counted(name, fn):
            def inner(*a):
                reads[name] += 1
                return fn(*a)

            return inner

        monkeypatch.setattr(staging, "READ_PIECE_BYTES", 1000)  # several pieces a range
        monkeypatch.setattr(mapped_files, "pread_into", counted("pread", pread))
        monkeypatch.setattr(staging, "_copy_into", counted("map", copy))
        fds = len(os.listdir("/proc/self/fd"))
        got = _read(vf, ranges)
        assert np.array_equal(got, want)
        assert len(os.listdir("/proc/self/fd")) == fds  # the file's descriptors closed once read
        assert (reads["pread"] > 0, reads["map"] > 0) == ((True, False) if after == "as_is" else (False, True))
    assert mapped_files.span_of(blob.ctypes.data, blob.size) is None  # closed: unregistered


def test_a_short_file_is_an_error_not_zeros(tmp_path):
    path = _version(tmp_path)
    with open(path, "rb") as f:
        data = f.read()
    dst = np.zeros(64, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped_files.pread_into(dst, 0, fd, 0, 64)
        assert bytes(dst) == data[:64]
        with pytest.raises(OSError, match="short"):
            mapped_files.pread_into(dst, 0, fd, len(data) - 10, 64)
    finally:
        os.close(fd)


def test_pieces_cancelled_before_they_run_still_close_the_file(tmp_path, monkeypatch):
    """Staging cancels the reads still queued when an update fails: the file's descriptor is closed anyway."""
    import threading

    path = _version(tmp_path)
    size = os.path.getsize(path)
    pool = ThreadPoolExecutor(1)
    gate = threading.Event()
    pool.submit(gate.wait)  # the one worker is busy: every piece below waits in the queue
    monkeypatch.setattr(staging, "READ_PIECE_BYTES", 100)
    fds = len(os.listdir("/proc/self/fd"))
    fd = os.open(path, os.O_RDONLY)
    futures = staging._pread_pieces(pool, np.zeros(size, dtype=np.uint8), 0, fd, 0, size)
    assert len(futures) > 2 and len(os.listdir("/proc/self/fd")) == fds + 1
    assert all(f.cancel() for f in futures[1:])
    gate.set()
    futures[0].result()
    pool.shutdown(wait=True)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_closed_file_leaves_no_registration_behind(tmp_path):
    """close() unregisters at once and for good: the file's finalizer is spent, so collecting the object
    later cannot remove the registration of another file mapped at the same address by then."""
    import gc

    a = VersionFile(_version(tmp_path))
    blob_a = a.file_payload()["blob"].numpy()
    a.close()
    assert not a._unregister.alive and mapped_files.span_of(blob_a.ctypes.data, 1) is None
    b_path = str(tmp_path / "b")
    os.makedirs(b_path)
    with VersionFile(_version(tmp_path / "b", seed=1)) as b:
        blob_b = b.file_payload()["blob"].numpy()
        del a
        gc.collect()
        assert mapped_files.span_of(blob_b.ctypes.data, blob_b.size) is not None
