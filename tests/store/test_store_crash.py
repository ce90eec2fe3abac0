"""Crash test: a publishing process is SIGKILLed at random points while a reader polls the store.

Readers must never see a partial version: every version that becomes visible opens fully and equals
the weights it claims, during the run and after every kill. Runs on a local store and on the real S3
server.

Starting a Python that imports torch takes seconds, so a "zygote" process imports everything once
and forks one publisher per round; the test kills that child by pid. The publisher's store waits a
little before each commit (`SlowCommitWriter`), which widens the window between "data uploaded" and
"record written" so that random kills land in it often; the store code itself is unchanged.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the zygote runs this file as a script
from test_store import History  # noqa: E402

from vllm_delta.store import TMP_PREFIX, DeltaStore  # noqa: E402
from vllm_delta.store.records import DATA_NAME_RE as _DATA_NAME  # noqa: E402
from vllm_delta.store.writes import VersionWriter  # noqa: E402

pytestmark = pytest.mark.slow  # crash rounds in subprocesses: make test-fast leaves them out

SHAPES = {"model.w": (64, 1024), "model.b": (1024,)}  # a 130 KB anchor, deltas of a few KB
HISTORY_SEED = 7
ANCHOR_EVERY = 8
MAX_VERSIONS_PER_ROUND = 400  # a bound; the kill comes long before
COMMIT_DELAY_S = 0.05
ERRORS = "publisher-errors.log"


def make_slow_store(uri: str, options: dict) -> DeltaStore:
    """A real DeltaStore whose writer announces each commit on stdout and then waits before writing the
    record."""

    class SlowCommitWriter(VersionWriter):
        def _commit_record(self, rec, token):
            print(f"commit {os.getpid()} {rec.version}", flush=True)  # its data is in the store by now
            time.sleep(COMMIT_DELAY_S)
            super()._commit_record(rec, token)

    store = DeltaStore(uri, options)
    store.writer = SlowCommitWriter(store.io, store.record_reader)
    return store


def publisher(store: DeltaStore, history: History, start: int, seed: int, work_dir: str) -> None:
    """Publish versions start, start+1, ... until killed (or the bound)."""
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="publisher-", dir=work_dir)
    print(f"ready {os.getpid()} {start}", flush=True)
    for v in range(start, start + MAX_VERSIONS_PER_ROUND):
        path = os.path.join(tmp, f"{v}.safetensors")
        if v % ANCHOR_EVERY == 0:
            header = history.write_anchor(path, v)
        else:
            header = history.write_delta(path, v, v - 1)
        store.writer.commit_file(header, path, move=rng.random() < 0.5)


def zygote() -> None:
    """Read `uri options_json start seed work_dir` lines; fork a publisher for each. Ends when stdin closes.

    The history lives here, so each child starts with the weights of its base already computed."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    # A thread pool started before fork() deadlocks the child's first parallel op: stay single-threaded.
    torch.set_num_threads(1)
    history = History(SHAPES, seed=HISTORY_SEED)
    for line in sys.stdin:
        uri, options, start, seed, work_dir = line.rstrip("\n").split("\t")
        start = int(start)
        history.sums(max(start - 1, 0))
        sys.stdout.flush()
        if os.fork() == 0:
            code = 0
            try:
                publisher(make_slow_store(uri, json.loads(options)), history, start, int(seed), work_dir)
            except BaseException as exc:  # noqa: BLE001 - the test reads the error file
                with open(os.path.join(work_dir, ERRORS), "a") as f:
                    f.write(f"publisher failed: {exc!r}\n")
                code = 1
            finally:
                os._exit(code)


class Reader(threading.Thread):
    """Polls the store; opens and checks every version as soon as it is visible."""

    def __init__(self, store: DeltaStore):
        super().__init__(daemon=True)
        self.store = store
        self.history = History(SHAPES, seed=HISTORY_SEED)
        self.checked: set[int] = set()
        self.errors: list[str] = []
        self.polls = 0
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while not self.stop.is_set() and time.monotonic() < deadline:
            self.polls += 1
            try:
                visible = self.store.versions()
                for v in visible:
                    if v not in self.checked:
                        with self.store.open(v) as vf:
                            self.history.check_file(vf)
                        self.checked.add(v)
                if not self.checked <= set(visible):
                    self.errors.append(f"versions disappeared: {sorted(self.checked - set(visible))}")
            except BaseException as exc:  # noqa: BLE001 - the test thread reports it
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            time.sleep(0.002)  # poll hard, but leave the publisher a core


def leftovers(store: DeltaStore) -> int:
    named = {os.path.basename(r.file) for r in store.records()}
    count = 0
    for folder in ("data", "versions"):
        for name in (os.path.basename(e["name"]) for e in store.io.ls(folder)):
            if name.startswith(TMP_PREFIX) or (_DATA_NAME.match(name) and name not in named):
                count += 1
    return count


def _read_line(stream, pid: int | None, word: str) -> list[str]:
    """The next `word` line from child `pid` (any pid if None); lines of earlier, killed children are skipped."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        fields = stream.readline().split()
        if not fields:
            pytest.fail("the zygote process ended")
        if fields[0] == word and (pid is None or int(fields[1]) == pid):
            return fields
    pytest.fail(f"no {word!r} line from publisher {pid} within 60 s")


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    for _ in range(500):  # until the kernel has reaped it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    pytest.fail(f"publisher {pid} survived SIGKILL")


def run_crash_rounds(uri: str, options: dict, *, rounds: int, seed: int, tmp_path) -> dict:
    """Even rounds kill a publisher inside its commit window (data uploaded, record not yet written);
    odd rounds kill it at a random time. A reader thread checks versions as they appear throughout."""
    rng = random.Random(seed)
    work_dir = tmp_path / "publishers"
    work_dir.mkdir()
    error_file = str(work_dir / ERRORS)
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    reader = Reader(DeltaStore(uri, options, cache_dir=str(tmp_path / "reader-cache")))
    history = History(SHAPES, seed=HISTORY_SEED)
    stats = {"rounds": rounds, "window_kills_invisible": 0, "leftover_files": 0}
    verified: set[int] = set()
    start, pid = 0, None
    try:
        reader.start()
        for r in range(rounds):
            proc.stdin.write(f"{uri}\t{json.dumps(options)}\t{start}\t{seed * 1000 + r}\t{work_dir}\n")
            proc.stdin.flush()
            t0 = time.monotonic()
            pid = int(_read_line(proc.stdout, None, "ready")[1])
            t1 = time.monotonic()
            commits = rng.randint(1, 4)
            for _ in range(commits):
                killed_in_window = int(_read_line(proc.stdout, pid, "commit")[2])
            if r % 2 == 1:
                time.sleep(rng.uniform(0.0, 0.15))  # anywhere in the next publish
                killed_in_window = None
            _kill(pid)
            # after the kill: a fresh reader sees a gapless run of complete versions
            fresh = DeltaStore(uri, options, cache_dir=str(tmp_path / f"after-{r}"))
            visible = fresh.versions()
            assert visible == list(range(len(visible))), f"round {r}: gaps in {visible}"
            # the publish before the last announced commit had returned: it must be there
            assert len(visible) >= start + commits - 1, f"round {r}: committed versions vanished"
            if killed_in_window is not None and killed_in_window not in visible:
                stats["window_kills_invisible"] += 1
            for v in visible:
                rec = fresh.record(v)
                assert fresh.fs.size(fresh.root + "/" + rec.file) == rec.bytes
                if v not in verified:
                    with fresh.open(v) as vf:
                        history.check_file(vf)
                    verified.add(v)
            start = len(visible)
            print(f"round {r}: ready {t1 - t0:.2f}s, kill after {time.monotonic() - t1:.2f}s, {len(visible)} versions")
            assert not reader.errors, reader.errors
        stats["leftover_files"] = leftovers(DeltaStore(uri, options))
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)  # a failed round must not leave its publisher running
            except ProcessLookupError:
                pass
        reader.stop.set()
        reader.join(timeout=60)
        proc.stdin.close()
        proc.wait(timeout=30)
    assert not reader.errors, reader.errors
    if os.path.exists(error_file):
        pytest.fail(open(error_file).read())
    stats.update(versions=len(verified), reader_checked=len(reader.checked), reader_polls=reader.polls)
    assert reader.checked, stats  # the reader saw versions while they were being published
    # kills inside the window leave their data behind, invisible (a late kill may miss the window)
    assert stats["window_kills_invisible"] >= 1 and stats["leftover_files"] >= 1, stats
    return stats


def test_crash_local(tmp_path):
    stats = run_crash_rounds(str(tmp_path / "store"), {}, rounds=10, seed=1, tmp_path=tmp_path)
    print(stats)


def test_crash_s3(s3_server, tmp_path):
    stats = run_crash_rounds(s3_server.uri("crash"), s3_server.storage_options, rounds=4, seed=2, tmp_path=tmp_path)
    print(stats)


if __name__ == "__main__" and sys.argv[1:] == ["zygote"]:
    zygote()
