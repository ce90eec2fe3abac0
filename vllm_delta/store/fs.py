"""One store root reached through fsspec: fresh reads, deadlines, and errors that name the store.

What changes here is how the store talks to a filesystem (fsspec options, S3 deadlines and retries,
the error classes a backend raises, listing caches); what changes in `delta_store.py` is what the
store reads and writes. Every remote operation has a deadline (`timeout_s`); a timeout raises
StoreTimeoutError (504), an unreachable store StoreUnavailableError (503), both naming the store
(`store_error`). Reads bypass fsspec's listing caches: an object may have changed or just appeared
since the last listing (docs/FORMAT.md, "Reading").
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from ..errors import DeltaError, StoreTimeoutError, StoreUnavailableError
from .records import TMP_PREFIX

log = logging.getLogger("vllm_delta.store")

DEFAULT_TIMEOUT_S = 60.0  # deadline of one store operation (a download: plus its size at MIN_RATE)
DOWNLOAD_MIN_BYTES_PER_S = 5e6  # a download of n bytes may take timeout_s + n / this
# s3fs/botocore defaults retry a frozen server for ~7 minutes (5 botocore x 5 s3fs attempts x 15 s):
# a few short attempts here, and every call also gets an asyncio deadline (`timeout=`).
S3_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 20,
    "retries": {"total_max_attempts": 3, "mode": "standard"},
}

_TIMEOUT_NAMES = frozenset(
    {"FSTimeoutError", "ReadTimeoutError", "ConnectTimeoutError", "ReadTimeout", "ConnectTimeout", "TimeoutException"}
)
_UNAVAILABLE_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientOSError",
        "ClientPayloadError",
        "ConnectError",
        "RemoteProtocolError",
        "ProxyConnectionError",
    }
)


TRUNCATED_READS = 2  # reads of one small object whose body came back short, before it is an error


def _cut_short(exc: BaseException) -> bool:
    """A response body shorter than its Content-Length (by class name: aiohttp is not imported here)."""
    return any(c.__name__ == "ClientPayloadError" for c in type(exc).__mro__)


def store_error(exc: BaseException, uri: str, what: str) -> DeltaError | None:
    """The DeltaError a failed store operation means (timeout 504, unreachable 503), or None if it is
    none of those. Recognized by class name, so that neither botocore nor aiohttp need be imported."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _TIMEOUT_NAMES or isinstance(exc, TimeoutError):
        return StoreTimeoutError(f"store {uri} did not answer in time ({what}): {type(exc).__name__}: {str(exc)[:200]}")
    if names & _UNAVAILABLE_NAMES or isinstance(exc, ConnectionError):
        return StoreUnavailableError(f"store {uri} is unreachable ({what}): {type(exc).__name__}: {str(exc)[:200]}")
    return None


def normalize_uri(uri: str | os.PathLike[str]) -> str:
    """Local paths absolute (with or without `file://`), remote URIs without a trailing slash."""
    uri = os.fspath(uri)
    if "://" not in uri:
        return os.path.abspath(os.path.expanduser(uri))
    if uri.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(uri[len("file://") :]))
    return uri.rstrip("/")


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def fsync(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def modified(entry: dict[str, Any]) -> float | None:
    """Last-modified time of an fsspec listing entry (local, s3fs and HfFileSystem spell it differently)."""
    for key in ("uploaded_at", "LastModified", "mtime", "last_modified"):
        value = entry.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _storage_options(uri: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """fsspec options as given, plus deadlines for S3 (the user's own keys win) and a private instance
    for remote filesystems: fsspec shares instances (and their listing caches) between equal options."""
    protocol = fsspec.core.split_protocol(uri)[0]
    if protocol in (None, "file", "local"):
        return dict(options)
    out = {"skip_instance_cache": True, **options}
    if protocol in ("s3", "s3a"):
        config = {**S3_CONFIG, "read_timeout": min(20.0, max(1.0, timeout_s))}
        out["config_kwargs"] = {**config, **dict(options.get("config_kwargs") or {})}
    return out


class StoreFS:
    """The filesystem under one store URI: `fs` (fsspec), `root` (the store's path in it), and the
    bounded, fresh operations the store is built from."""

    def __init__(self, uri: str, storage_options: dict[str, Any], timeout_s: float):
        self.uri = uri
        self.timeout_s = timeout_s
        options = _storage_options(uri, storage_options, timeout_s)
        self.fs, root = fsspec.core.url_to_fs(uri, **options)
        self.root: str = root.rstrip("/") or root
        self.is_local = isinstance(self.fs, LocalFileSystem)
        # fsspec's asyncio deadline (`timeout=` on every call) exists for async filesystems only.
        self._async = isinstance(self.fs, AsyncFileSystem)
        self.is_s3 = hasattr(self.fs, "_call_s3")
        if self.is_s3:
            self.fs.retries = 1  # s3fs's own retry loop around botocore's (an attribute, not an option)
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()

    def warn_once(self, key: str, message: str) -> None:
        """Log a warning naming the store, once per `key` (a file that does not parse, a foreign name)."""
        with self._warned_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("%s: %s", self.uri, message)

    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def deadline(self, timeout: float | None = None) -> dict[str, float]:
        """The keyword arguments that bound one fsspec call (none for synchronous filesystems)."""
        return {"timeout": timeout or self.timeout_s} if self._async else {}

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Translate a timeout or an unreachable store into StoreTimeoutError / StoreUnavailableError."""
        try:
            yield
        except (FileNotFoundError, DeltaError):
            raise
        except Exception as exc:
            err = store_error(exc, self.uri, what)
            if err is None:
                raise
            raise err from exc

    def cat(self, path: str, what: str) -> builtins.bytes:
        """One object's bytes, read afresh (a stale parent listing would answer 'not found' unasked). A
        body cut short (aiohttp's ClientPayloadError: fewer bytes than its Content-Length, seen from an
        S3 server rewriting the object while it was read) is read again once before it is an error."""
        if self.is_local:
            with open(path, "rb") as f:
                return f.read()
        with self.guard(what):
            for attempt in range(TRUNCATED_READS):
                self.fs.invalidate_cache(path)
                try:
                    if self.is_s3:
                        return bytes(self.fs.cat_file(path, max_concurrency=1, **self.deadline()))  # one GET
                    return bytes(self.fs.cat_file(path, **self.deadline()))
                except Exception as exc:
                    if attempt + 1 == TRUNCATED_READS or not _cut_short(exc):
                        raise
                    log.info("%s: %s was cut short (%s): reading it again", self.uri, what, type(exc).__name__)
            raise AssertionError("unreachable")  # the loop returns or raises

    def ls(self, folder: str) -> list[dict[str, Any]]:
        """Files directly in `folder` (relative to the root), listed afresh (fsspec caches listings)."""
        path = self.path(folder)
        with self.guard(f"listing {folder}/"):
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True, **self.deadline())
            except FileNotFoundError:
                return []
        return [e for e in entries if e.get("type") == "file"]

    def names(self, folder: str) -> list[str]:
        """Names of the files directly in `folder`, listed afresh, without a stat of each (local)."""
        path = self.path(folder)
        if self.is_local:
            try:
                return [e.name for e in os.scandir(path) if e.is_file()]
            except FileNotFoundError:
                return []
        return [basename(e["name"]) for e in self.ls(folder)]

    def find(self, folder: str) -> list[str]:
        """Every file under `folder` (relative to the root), as paths relative to it, listed afresh."""
        path = self.path(folder)
        try:
            with self.guard(f"listing {folder}/"):
                self.fs.invalidate_cache(path)
                paths = self.fs.find(path, **self.deadline())
        except FileNotFoundError:
            return []
        return [p[len(path) + 1 :] for p in paths if p.startswith(path + "/")]

    def list_after(self, folder: str, key: str) -> list[str]:
        """Names in `folder` that sort after `key` (S3 only: ListObjectsV2 StartAfter, every page)."""
        bucket, _, prefix = self.root.partition("/")
        start = f"{prefix}/{folder}/" if prefix else f"{folder}/"
        names: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": start, "StartAfter": start + key}
        with self.guard(f"listing {folder}/ after {key}"):
            while True:
                page = self.fs.call_s3("list_objects_v2", **kwargs, **self.deadline())
                names += [o["Key"][len(start) :] for o in page.get("Contents", [])]
                if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                    return names
                kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def exists(self, path: str) -> bool:
        if self.is_local:
            return os.path.exists(path)
        with self.guard(f"looking up {path}"):
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path, **self.deadline()))

    def size(self, path: str, what: str) -> int:
        """An object's size as the store has it now (FileNotFoundError if there is none)."""
        if self.is_local:
            return os.path.getsize(path)
        with self.guard(what):
            self.fs.invalidate_cache(path)
            return int(self.fs.info(path, **self.deadline())["size"])

    def remove(self, path: str, what: str) -> None:
        """Delete one object; one that is already gone is fine."""
        with self.guard(what), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path, **self.deadline())

    def download(self, path: str, dest: str, nbytes: int, what: str) -> None:
        """Copy an object of `nbytes` to the local file `dest` (deadline: timeout_s + its size at 5 MB/s)."""
        with self.guard(what):
            self.fs.invalidate_cache(path)
            self.fs.get_file(path, dest, **self.deadline(self.timeout_s + nbytes / DOWNLOAD_MIN_BYTES_PER_S))

    def place(self, src: str, dest: str, *, move: bool, tmp_name: str, mode: int) -> bool:
        """Put the local file `src` at `dest` in a local store, durable (fsynced file and folder): renamed
        when `move` and both are on one filesystem (then given `mode`), else copied through `tmp_name`
        in the destination folder. True if `src` was renamed into place."""
        folder = os.path.dirname(dest)
        os.makedirs(folder, exist_ok=True)
        moved = False
        if move:
            fsync(src)
            try:
                os.replace(src, dest)
                os.chmod(dest, mode)
                moved = True
            except OSError as exc:
                if exc.errno != errno.EXDEV:  # another filesystem: copy below
                    raise
        if not moved:
            tmp = os.path.join(folder, tmp_name)
            try:
                shutil.copyfile(src, tmp)
                fsync(tmp)
                os.replace(tmp, dest)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        fsync(folder, directory=True)  # the data's name must be durable before the record's
        return moved

    def upload(self, src: str, dest: str, nbytes: int, what: str) -> int:
        """Upload the local file `src` of `nbytes` to `dest`; returns the size the store then holds."""
        with self.guard(what):
            # The deadline matters most here: a PUT to a frozen server waits forever for its
            # `100 Continue` otherwise (aiohttp arms no timer for it).
            self.fs.put_file(src, dest, **self.deadline(self.timeout_s + nbytes / DOWNLOAD_MIN_BYTES_PER_S))
        return self.size(dest, what)

    def write_small(self, path: str, data: builtins.bytes) -> None:
        """Write a small object atomically, replacing an older one (readers see old or new, whole)."""
        if not self.is_local:
            with self.guard(f"writing {path}"):
                self.fs.pipe_file(path, builtins.bytes(data), **self.deadline())  # an object store PUT is atomic
            return
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{TMP_PREFIX}{secrets.token_hex(8)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DOWNLOAD_MIN_BYTES_PER_S",
    "S3_CONFIG",
    "StoreFS",
    "basename",
    "fsync",
    "modified",
    "normalize_uri",
    "store_error",
]
