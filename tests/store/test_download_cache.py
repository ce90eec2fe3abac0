"""The download cache's one-download-per-file rule (store/cache.py): processes and threads that want
the same file of one cache folder at the same moment read it from the store once; the others wait and
take the verified copy. Real processes (spawned), real flocks on a real folder."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import multiprocessing
import os
import threading
import time

import pytest

from vllm_delta.errors import IntegrityError
from vllm_delta.store.cache import DownloadCache
from vllm_delta.store.records import DataFile

BODY = bytes(range(256)) * 4096  # 1 MiB
NAME = "data/0000000001-delta-abc.safetensors"
DATA = DataFile(file=NAME, bytes=len(BODY), sha256=hashlib.sha256(BODY).hexdigest())


def slow_download(log_path: str, delay_s: float = 0.5):
    """A download that takes `delay_s` and notes each call in `log_path` (one line per call)."""

    def download(dest: str) -> None:
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()} {threading.get_ident()}\n")
        time.sleep(delay_s)
        with open(dest, "wb") as f:
            f.write(BODY)

    return download


def calls(log_path: str) -> int:
    if not os.path.exists(log_path):
        return 0
    with open(log_path) as f:
        return len(f.read().splitlines())


def _copy_in_a_process(cache_dir: str, log_path: str, start_at: float, out: multiprocessing.Queue) -> None:
    time.sleep(max(0.0, start_at - time.time()))
    path = DownloadCache("s3://bucket/store", cache_dir).copy(DATA, version=1, download=slow_download(log_path))
    with open(path, "rb") as f:
        out.put((path, f.read() == BODY))


def test_two_processes_starting_together_download_a_file_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    log_path, start_at = str(tmp_path / "downloads"), time.time() + 3.0  # both past their imports
    procs = [
        ctx.Process(target=_copy_in_a_process, args=(str(tmp_path / "cache"), log_path, start_at, out))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert calls(log_path) == 1
    assert results[0] == results[1] and results[0][1] is True
    folder = os.path.dirname(results[0][0])
    assert os.listdir(folder) == [os.path.basename(NAME)]  # no temp file, no lock file left


def test_threads_of_one_process_download_a_file_once(tmp_path):
    cache = DownloadCache("s3://bucket/store", str(tmp_path / "cache"))
    log_path = str(tmp_path / "downloads")
    paths: list[str] = []
    threads = [
        threading.Thread(target=lambda: paths.append(cache.copy(DATA, version=1, download=slow_download(log_path))))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert calls(log_path) == 1 and len(paths) == 4 and len(set(paths)) == 1


def test_a_failed_download_leaves_the_next_waiter_to_fetch_it(tmp_path):
    """The first download comes out damaged (refused: IntegrityError); a thread that waited on it then
    downloads the file itself, and gets the good copy."""
    cache = DownloadCache("s3://bucket/store", str(tmp_path / "cache"))
    log_path = str(tmp_path / "downloads")
    started = threading.Event()

    def damaged(dest: str) -> None:
        started.set()
        slow_download(log_path)(dest)
        with open(dest, "r+b") as f:
            f.write(b"\xff")

    errors: list[Exception] = []

    def first() -> None:
        try:
            cache.copy(DATA, version=1, download=damaged)
        except IntegrityError as exc:
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(10)
    path = cache.copy(DATA, version=1, download=slow_download(log_path))  # waits for the first, then fetches
    t.join(30)
    assert len(errors) == 1 and "sha256" in str(errors[0])
    assert calls(log_path) == 2
    with open(path, "rb") as f:
        assert f.read() == BODY


def test_a_lock_held_too_long_is_passed_by(tmp_path, caplog):
    """A peer that holds the file's lock and never finishes (hung) delays a download by `lock_wait_s`
    at most; then the file is fetched anyway, and a warning says so."""
    cache = DownloadCache("s3://bucket/store", str(tmp_path / "cache"))
    cache.lock_wait_s = 0.3
    folder = cache.folder()
    fd = os.open(os.path.join(folder, f".{os.path.basename(NAME)}.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a separate open file description: excludes this process's copy too
    try:
        log_path = str(tmp_path / "downloads")
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="vllm_delta.store.cache"):
            path = cache.copy(DATA, version=1, download=slow_download(log_path, delay_s=0.0))
        waited = time.monotonic() - t0
    finally:
        os.close(fd)
    assert calls(log_path) == 1 and os.path.getsize(path) == len(BODY)
    assert waited >= 0.3
    assert "no download lock" in caplog.text


def test_a_file_system_without_flock_fetches_at_once_and_says_why(tmp_path, caplog, monkeypatch):
    """Where flock is refused (NFS without a lock daemon answers ENOLCK), the copy is fetched at once,
    without waiting `lock_wait_s`, and the warning names the refusal, not a wait. This machine's file
    systems all lock, so `fcntl.flock` is replaced by one that refuses (a stand-in, the only one here)."""
    import errno

    def refuse(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    cache = DownloadCache("s3://bucket/store", str(tmp_path / "cache"))
    cache.lock_wait_s = 30.0
    log_path = str(tmp_path / "downloads")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vllm_delta.store.cache"):
        path = cache.copy(DATA, version=1, download=slow_download(log_path, delay_s=0.0))
    assert time.monotonic() - t0 < 10.0  # not the 30 s wait
    assert calls(log_path) == 1 and open(path, "rb").read() == BODY
    assert "No locks available" in caplog.text and "fetching it without one" in caplog.text
    assert " in 30 s" not in caplog.text


@pytest.mark.parametrize("age_s, kept", [(0, True), (3600, False)])
def test_prune_removes_a_dead_process_lock_file(tmp_path, age_s, kept):
    cache = DownloadCache("s3://bucket/store", str(tmp_path / "cache"))
    lock = os.path.join(cache.folder(), ".0000000001-delta-abc.safetensors.lock")
    open(lock, "w").close()
    old = time.time() - age_s
    os.utime(lock, (old, old))
    cache.prune()
    assert os.path.exists(lock) == kept


def test_a_copy_pruned_while_it_is_hashed_is_downloaded_again(tmp_path, monkeypatch):
    """Another process sharing the folder prunes the copy while this one checks its sha256: the copy is
    not there, so it is downloaded again (not a FileNotFoundError out of the check)."""
    from vllm_delta.store import cache as cache_mod

    cache = DownloadCache("s3://bucket/store", str(tmp_path / "cache"))
    log_path = str(tmp_path / "downloads")
    path = cache.copy(DATA, version=1, download=slow_download(log_path, 0.0))
    fresh = DownloadCache("s3://bucket/store", str(tmp_path / "cache"))  # another process: hashes it again
    real, pruned = cache_mod.file_sha256, []

    def pruned_while_hashed(p: str) -> str:
        if not pruned:
            pruned.append(p)
            os.remove(p)
        return real(p)

    monkeypatch.setattr(cache_mod, "file_sha256", pruned_while_hashed)
    assert fresh.copy(DATA, version=1, download=slow_download(log_path, 0.0)) == path
    assert pruned == [path] and calls(log_path) == 2
    with open(path, "rb") as f:
        assert f.read() == BODY
