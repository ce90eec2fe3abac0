"""Writes through a mapping of tmpfs pages (mapped_writes, PayloadWriter): the same bytes as
positioned writes, only inside allocated space, and positioned writes wherever that is not so."""

from __future__ import annotations

import errno
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vllm_delta import mapped_writes
from vllm_delta.format import PayloadWriter, VersionHeader

SHM = "/dev/shm"
needs_shm = pytest.mark.skipif(
    not (os.path.isdir(SHM) and mapped_writes.fs_type(os.path.join(SHM, "x")) == "tmpfs"),
    reason="needs a tmpfs at /dev/shm (Linux)",
)


@pytest.fixture
def shm_dir():
    """A fresh folder on the tmpfs at /dev/shm, removed afterwards."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="vllm-delta-test-", dir=SHM)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


MOUNTINFO = [
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
    "25 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw",
    "26 25 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw",
    "27 22 0:24 / /data\\040set rw - xfs /dev/vdb rw",
    "28 22 0:25 / /dev/shmx rw - ext4 /dev/vdc rw",
]


def test_mount_type_is_the_longest_mount_point_above_the_folder():
    assert mapped_writes.mount_type(MOUNTINFO, "/dev/shm") == "tmpfs"
    assert mapped_writes.mount_type(MOUNTINFO, "/dev/shm/store/v1") == "tmpfs"
    assert mapped_writes.mount_type(MOUNTINFO, "/dev/shmx/a") == "ext4"  # a prefix of the name, not a parent
    assert mapped_writes.mount_type(MOUNTINFO, "/dev") == "devtmpfs"
    assert mapped_writes.mount_type(MOUNTINFO, "/data set/x") == "xfs"  # octal escapes in mount points
    assert mapped_writes.mount_type(MOUNTINFO, "/home/u") == "ext4"
    assert mapped_writes.mount_type(["garbage", ""], "/x") == ""


def _write(folder, blob, index, *, hint, pool, piece=64):
    header = VersionHeader(version=1, kind="anchor", tensors={}, checksum="0" * 16)
    parts = [("blob", torch.uint8, 1), ("index", torch.int64, 1)]
    path = os.path.join(folder, "f.safetensors")
    old = PayloadWriter.PIECE_BYTES
    PayloadWriter.PIECE_BYTES = piece  # several pieces per append
    try:
        with PayloadWriter(path, header, parts, pool, size_hint=hint) as out:
            for chunk in blob.tensor_split(5):
                out.append("blob", chunk)
            out.append("index", index)
    finally:
        PayloadWriter.PIECE_BYTES = old
    with open(path, "rb") as f:
        return f.read()


class _Count:
    """Counts the calls to a real function of mapped_writes (which still runs)."""

    def __init__(self, monkeypatch, name):
        self.calls = 0
        real = getattr(mapped_writes, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(mapped_writes, name, counted)


@needs_shm
@pytest.mark.parametrize("hint_share", [2.0, 0.5])
def test_a_file_on_tmpfs_is_the_same_bytes_by_mapping(tmp_path, monkeypatch, shm_dir, hint_share):
    """Pieces inside the allocated bytes are mapped copies, the rest positioned writes (hint_share
    0.5: the allocation covers about half); the file equals the one written by positioned writes on
    the same payload, and its size is the payload's whatever was allocated."""
    monkeypatch.setenv(mapped_writes.ENV, "1")
    g = torch.Generator().manual_seed(3)
    blob = torch.randint(0, 256, (50_000,), generator=g, dtype=torch.uint8)
    index = torch.randint(-(2**62), 2**62, (33,), generator=g, dtype=torch.int64)
    reference = _write(str(tmp_path), blob, index, hint=0, pool=None)  # no hint, no pool: pwrite only
    mapped = _Count(monkeypatch, "copy_mapped")
    written = _Count(monkeypatch, "pwrite_all")
    with ThreadPoolExecutor(4) as pool:
        data = _write(shm_dir, blob, index, hint=int(hint_share * (blob.numel() + index.numel() * 8)), pool=pool)
    assert data == reference
    assert mapped.calls > 0
    assert (written.calls > 0) == (hint_share < 1)


@needs_shm
def test_no_mapped_write_where_allocation_failed(tmp_path, monkeypatch, shm_dir):
    """A tmpfs without room for the allocation (simulated: posix_fallocate raises ENOSPC, which a
    full /dev/shm would; it cannot be filled here) writes every piece by pwrite: a mapped page that
    cannot be allocated would kill the process with SIGBUS instead of raising."""

    def no_room(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    mapped = _Count(monkeypatch, "copy_mapped")
    blob = torch.arange(20_000, dtype=torch.int64).to(torch.uint8)
    index = torch.arange(5, dtype=torch.int64)
    reference = _write(str(tmp_path), blob, index, hint=0, pool=None)
    with ThreadPoolExecutor(2) as pool:
        data = _write(shm_dir, blob, index, hint=10**6, pool=pool)
    assert data == reference
    assert mapped.calls == 0


def test_no_mapping_off_tmpfs(tmp_path, monkeypatch):
    """Where the folder is not tmpfs (a disk: mapped writes measured 4-5x slower there), every piece is
    a positioned write, with the space allocated ahead all the same."""
    monkeypatch.setattr(mapped_writes, "fs_type", lambda path: "ext4")
    mapped = _Count(monkeypatch, "copy_mapped")
    blob = torch.arange(9_000, dtype=torch.int64).to(torch.uint8)
    index = torch.arange(5, dtype=torch.int64)
    reference = _write(str(tmp_path / ".."), blob, index, hint=0, pool=None)
    with ThreadPoolExecutor(2) as pool:
        data = _write(str(tmp_path), blob, index, hint=10**6, pool=pool)
    assert data == reference
    assert mapped.calls == 0


def test_copy_mapped_writes_at_unaligned_offsets(tmp_path):
    """A mapping starts at a page boundary; the copy lands at the byte asked for."""
    path = str(tmp_path / "m")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert mapped_writes.allocate(fd, 3 * 4096 + 100) == 3 * 4096 + 100
        data = torch.arange(5000, dtype=torch.int32).to(torch.uint8)
        mapped_writes.copy_mapped(fd, data, 4096 + 77)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[4096 + 77 : 4096 + 77 + 5000] == bytes(data.tolist())
    assert raw[: 4096 + 77] == bytes(4096 + 77)


def test_the_switch_turns_mapped_writes_on_and_off(monkeypatch):
    monkeypatch.setattr(mapped_writes, "CHOOSER", mapped_writes.WriteChooser())
    monkeypatch.setattr(mapped_writes, "fs_type", lambda path: "tmpfs")
    monkeypatch.setenv(mapped_writes.ENV, "1")
    assert all(mapped_writes.maps_well("/dev/shm/x") for _ in range(5))
    monkeypatch.setenv(mapped_writes.ENV, "0")
    assert not any(mapped_writes.maps_well("/dev/shm/x") for _ in range(5))
    monkeypatch.setattr(mapped_writes, "fs_type", lambda path: "ext4")
    monkeypatch.setenv(mapped_writes.ENV, "1")
    assert not mapped_writes.maps_well("/data/x")  # never off tmpfs


def test_the_chooser_tries_both_ways_then_takes_the_faster_and_rechecks(caplog):
    caplog.set_level(logging.INFO, logger="vllm_delta")
    c = mapped_writes.WriteChooser(explore=2, keep=3, recheck=5)
    first = [c.choose() for _ in range(2)]
    assert first == [True, True]  # nothing measured: mapped first
    c.record(False, 10**9, 1.0)  # the process's first file: not counted (one-time costs)
    c.record(True, 100, 1.0)
    c.record(True, 100, 1.0)  # mapped: 100 B/s
    assert [c.choose() for _ in range(2)] == [False, False]  # then pwrite, until it has two files
    c.record(False, 300, 1.0)
    c.record(False, 300, 1.0)  # pwrite: 300 B/s
    picks = [c.choose() for _ in range(10)]  # choices 5..14: the 5th and 10th recheck the slower way
    assert picks == [True, False, False, False, False, True, False, False, False, False]
    said = [r.getMessage() for r in caplog.records if "files on tmpfs" in r.getMessage()]
    assert len(said) == 1 and "by pwrite" in said[0]  # once, when the choice is made
    for _ in range(3):
        c.record(True, 900, 1.0)  # mapping got faster (only the last 3 count)
    assert [c.choose() for _ in range(4)] == [False, True, True, True]  # choice 15: a recheck of pwrite
    c.record(True, 0, 1.0)  # nothing written: no rate
    c.record(False, 10, 0.0)
    assert c.rates() == {True: [900.0] * 3, False: [300.0, 300.0]}


@needs_shm
def test_files_on_tmpfs_feed_the_chooser_with_their_ways_speed(tmp_path, monkeypatch, shm_dir):
    """By default each file on tmpfs reports how fast its pieces were written, under the way it used;
    the first files try both ways, and every file has the same bytes."""
    chooser = mapped_writes.WriteChooser(explore=1)
    chooser.record(True, 1, 1.0)  # as if this process had written its first file already
    monkeypatch.setattr(mapped_writes, "CHOOSER", chooser)
    monkeypatch.delenv(mapped_writes.ENV, raising=False)
    blob = torch.arange(30_000, dtype=torch.int64).to(torch.uint8)
    index = torch.arange(5, dtype=torch.int64)
    reference = _write(str(tmp_path), blob, index, hint=0, pool=None)
    with ThreadPoolExecutor(2) as pool:
        files = [_write(shm_dir, blob, index, hint=10**6, pool=pool) for _ in range(3)]
    assert all(f == reference for f in files)
    rates = chooser.rates()
    assert len(rates[True]) >= 1 and len(rates[False]) >= 1 and len(rates[True]) + len(rates[False]) == 3
    assert all(r > 0 for r in rates[True] + rates[False])


@needs_shm
def test_a_restarted_file_reports_only_the_pass_that_stays(monkeypatch, shm_dir):
    """A codec that falls back writes the payload again (`restart`): the chooser hears the bytes and
    span of the second pass only, not the failed first one's as well."""
    heard: list[tuple[bool, int, float]] = []

    class Listening(mapped_writes.WriteChooser):
        def record(self, mapped: bool, nbytes: int, seconds: float) -> None:
            heard.append((mapped, nbytes, seconds))

    monkeypatch.setattr(mapped_writes, "CHOOSER", Listening())
    monkeypatch.setenv(mapped_writes.ENV, "1")
    first, second = torch.zeros(40_000, dtype=torch.uint8), torch.ones(10_000, dtype=torch.uint8)
    index = torch.arange(5, dtype=torch.int64)
    header = VersionHeader(version=1, kind="anchor", tensors={}, checksum="0" * 16)
    parts = [("blob", torch.uint8, 1), ("index", torch.int64, 1)]
    with ThreadPoolExecutor(2) as pool:
        with PayloadWriter(os.path.join(shm_dir, "r.safetensors"), header, parts, pool, size_hint=10**6) as out:
            out.append("blob", first)
            time.sleep(0.2)  # a failed first pass that took long
            out.restart()
            second_pass = time.perf_counter()
            out.append("blob", second)
            out.append("index", index)
        closed = time.perf_counter()
    assert len(heard) == 1
    mapped, nbytes, seconds = heard[0]
    assert mapped and nbytes == second.numel() + index.numel() * 8 and 0 < seconds <= closed - second_pass
