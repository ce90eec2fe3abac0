"""The verified download cache of a remote store: local copies of version files, and their pruning.

A copy is used only after it is verified against its record (size, and the record's sha256 when it
has one, hashed once per process while the file's size, mtime and inode stay the same); a copy that
does not match is deleted and fetched again. Downloads land under a temporary name and are renamed
once complete and verified, so concurrent readers never see a partial file. One download of a file at
a time per cache folder, across processes (an `flock` on `.<file>.lock` beside it, removed once the
download ends): the TP ranks of a server starting together, or two servers sharing a host's cache
folder, read each file from the store once; the others wait and take the verified copy.
Whoever needs copies gone calls `prune` here (`DeltaStore.cache`): copies of versions no longer needed,
temp files of dead processes, and, above a byte cap, the oldest copies; a local store's cache holds
nothing. docs/FORMAT.md, "Reading".

What changes here is how copies are kept and checked; how a file is fetched is the caller's
(`DeltaStore` passes a download function), so this module does no remote I/O.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from ..errors import CacheError, IntegrityError
from .records import DATA_NAME_RE, TMP_PREFIX, DataFile, check_size

log = logging.getLogger(__name__)

TMP_STALE_S = 600.0  # a temp download untouched for this long is a leftover of a dead process
LOCK_POLL_S = 0.02
CACHE_ENTRIES_ENV = "VLLM_DELTA_CACHE_ENTRIES"


def cache_entries(default: int = 64) -> int:
    """The bound of the store's per-process LRU caches (parsed records, verified copies): `default`, or
    the positive integer in $VLLM_DELTA_CACHE_ENTRIES. Tests set it low so that a server's heap
    measurement is past every cache's warm-up after a few updates instead of 64."""
    raw = os.environ.get(CACHE_ENTRIES_ENV)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{CACHE_ENTRIES_ENV} must be a positive integer, not {raw!r}")
    return int(raw)


VERIFIED_ENTRIES = cache_entries()  # verified copies remembered (least recently used go first)
# What a full, read-only or forbidden cache raises while a download writes it: a CacheError (503).
_CACHE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM})


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class DownloadCache:
    """Verified local copies of one store's files, in `cache_dir/<hash of the URI>/` (default: a
    private temp dir, removed with this object). `uri` names the store in messages and keeps the
    copies of several stores sharing one `cache_dir` apart."""

    def __init__(self, uri: str, cache_dir: str | None):
        self.uri = uri
        self._cache_dir = cache_dir
        self._own = False
        self._verified: OrderedDict[str, tuple[int, int, int]] = OrderedDict()  # path -> stat it passed at
        self._lock = threading.Lock()
        # How long a download waits for another process's download of the same file before fetching it
        # itself (as without a lock: a hung peer never blocks this one for longer).
        self.lock_wait_s = 300.0

    def folder(self) -> str:
        """The cache folder (created on first use; CacheError if it cannot be)."""
        with self._lock:
            if self._cache_dir is None:
                self._cache_dir = tempfile.mkdtemp(prefix="vllm-delta-cache-")
                self._own = True
                weakref.finalize(self, shutil.rmtree, self._cache_dir, ignore_errors=True)
        folder = self._folder_path()
        assert folder is not None
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot use the download cache {folder}: {exc.strerror or exc}") from None
        return folder

    def _folder_path(self) -> str | None:
        """Where the cache folder is (None: no folder chosen yet, so no copy either); not created here."""
        cache_dir = self._cache_dir
        if cache_dir is None or self._own:
            return cache_dir
        # One folder per store, so that a cache_dir shared by several stores never mixes them.
        return os.path.join(cache_dir, hashlib.sha256(self.uri.encode()).hexdigest()[:16])

    def holds(self, path: str, data: DataFile) -> bool:
        """Whether the file at `path` (a copy here, or a local store's own file) is `data` as its record
        says: size, and sha256 when the record has one (hashed once per process per stat stamp)."""
        return self._verified_copy(path, data)

    def _verified_copy(self, path: str, data: DataFile) -> bool:
        """Whether `path` holds the data file: its size, and its sha256 when the record has one
        (hashed once per process while the file's size, mtime and inode stay the same)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        if st.st_size != data.bytes:
            return False
        if data.sha256 is None:
            return True
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            if self._verified.get(path) == stamp:
                self._verified.move_to_end(path)
                return True
        try:
            if file_sha256(path) != data.sha256:
                return False
        except FileNotFoundError:  # pruned meanwhile by another process sharing the folder
            return False
        self._remember(path, stamp)
        return True

    def _remember(self, path: str, stamp: tuple[int, int, int]) -> None:
        with self._lock:
            self._verified[path] = stamp
            self._verified.move_to_end(path)
            while len(self._verified) > VERIFIED_ENTRIES:
                self._verified.popitem(last=False)

    def copy(self, data: DataFile, *, version: int, download: Callable[[str], None]) -> str:
        """A verified copy of one of `version`'s files: the one there, or a fresh one that
        `download(dest)` writes to a local path and this checks against `data`."""
        folder = self.folder()
        final = os.path.join(folder, os.path.basename(data.file))
        if self._verified_copy(final, data):
            return final
        with self._download_lock(folder, os.path.basename(data.file)):
            if self._verified_copy(final, data):  # another process downloaded it while this one waited
                return final
            return self._download(folder, final, data, version, download)

    @contextlib.contextmanager
    def _download_lock(self, folder: str, name: str) -> Iterator[None]:
        """Hold `folder/.name.lock` exclusively (flock: across processes and between threads, released by
        the kernel when a holder dies). Waits up to `lock_wait_s`, then goes on without it; a cache
        where no lock can be taken (read-only, or a file system without flock) goes on without it at
        once. The holder removes the lock file as it ends: whoever gets a lock after it (on that file
        or a new one) first looks for the verified copy, so a removed lock file costs at most a second
        download when the first one failed."""
        fd = None
        path = os.path.join(folder, f".{name}.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.debug("%s: no download lock for %s: %s", self.uri, name, exc)
        held = False
        if fd is not None:
            try:
                held = _flock(fd, self.lock_wait_s)
                if not held:
                    log.warning(
                        "%s: no download lock on %s in %.0f s: fetching it anyway", self.uri, name, self.lock_wait_s
                    )
            except OSError as exc:  # a file system without flock: no peer can be excluded, none waited for
                log.warning("%s: no download lock on %s (%s): fetching it without one", self.uri, name, exc)
        try:
            yield
        finally:
            if fd is not None:
                if held:
                    with contextlib.suppress(OSError):
                        os.remove(path)
                os.close(fd)  # releases the flock

    def _download(self, folder: str, final: str, data: DataFile, version: int, download: Callable[[str], None]) -> str:
        if os.path.exists(final):
            log.warning("%s: cached %s does not match its record: fetching it again", self.uri, final)
            with contextlib.suppress(FileNotFoundError):
                os.remove(final)
        # A unique temp name, then a rename: concurrent readers never see a partial download.
        tmp = os.path.join(folder, f"{TMP_PREFIX}{secrets.token_hex(8)}-{os.path.basename(data.file)}")
        try:
            _cache_write(tmp, lambda: open(tmp, "wb").close())  # a read-only cache fails here, clearly
            try:
                download(tmp)
            except OSError as exc:
                if exc.errno in _CACHE_ERRNOS:
                    raise CacheError(f"cannot write the download cache {folder}: {exc.strerror or exc}") from None
                raise
            check_size(data, os.path.getsize(tmp), version=version)
            if data.sha256 is not None and file_sha256(tmp) != data.sha256:
                raise IntegrityError(
                    f"data file {data.file} does not have the sha256 its record says (damaged or replaced)",
                    version=version,
                )
            _cache_write(final, lambda: os.replace(tmp, final))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        if data.sha256 is not None:
            st = os.stat(final)
            self._remember(final, (st.st_size, st.st_mtime_ns, st.st_ino))
        return final

    def files(self) -> list[os.DirEntry[str]]:
        """The files in the cache folder (none before the first download: nothing is created here, so a
        local store's cache, never used, stays empty and absent)."""
        folder = self._folder_path()
        if folder is None:
            return []
        try:
            return [e for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def total_bytes(self) -> int:
        total = 0
        for e in self.files():
            with contextlib.suppress(FileNotFoundError):
                total += e.stat(follow_symlinks=False).st_size
        return total

    def prune(
        self,
        keep: Iterable[int] = (),
        versions: Iterable[int] | None = None,
        *,
        max_bytes: int | None = None,
        protect: Iterable[int] = (),
        newer_than: int | None = None,
    ) -> list[str]:
        """Delete copies of `versions` (default: all) except `keep` and those of versions above
        `newer_than`, and temp downloads and download locks nobody has touched for TMP_STALE_S (a killed
        process's). Then, with `max_bytes`, delete kept copies too, oldest version first, until the
        cache fits, except those of `protect` (a staged update's). Returns the deleted names."""
        kept_versions, protected = set(keep), set(protect)
        only = None if versions is None else set(versions)
        removed: list[str] = []
        kept: list[tuple[int, str, str, int]] = []
        stale = time.time() - TMP_STALE_S
        for e in self.files():
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            m = DATA_NAME_RE.match(e.name)
            if e.name.startswith(TMP_PREFIX) or _is_lock(e.name):  # a dead process's download or lock
                drop = st.st_mtime < stale
            elif m:
                v = int(m.group(1))
                newer = newer_than is not None and v > newer_than
                drop = v not in kept_versions and not newer and (only is None or v in only)
                if not drop:
                    kept.append((v, e.path, e.name, st.st_size))
            else:
                continue
            if drop and self._unlink(e.path):
                removed.append(e.name)
        if max_bytes is not None:
            total = sum(size for *_, size in kept)
            for v, path, name, size in sorted(kept):
                if total <= max_bytes:
                    break
                if v in protected:
                    continue
                if self._unlink(path):
                    removed.append(name)
                    total -= size
            if total > max_bytes:
                log.warning(
                    "%s: the download cache holds %d bytes (cap %d): all of it is in use", self.uri, total, max_bytes
                )
        return removed

    def _unlink(self, path: str) -> bool:
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        except OSError as exc:  # a read-only cache: nothing to prune, and nothing new lands there either
            log.warning("%s: cannot prune %s: %s", self.uri, path, exc.strerror or exc)
            return False
        with self._lock:
            self._verified.pop(path, None)
        return True


def _is_lock(name: str) -> bool:
    return name.startswith(".") and name.endswith(".lock")


def _flock(fd: int, wait_s: float) -> bool:
    """An exclusive flock on `fd` within `wait_s` (polled: a blocking flock could not give up); False when
    a peer held it all that time. Raises OSError where the file system has no flock."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL_S)


def _cache_write(path: str, write: Callable[[], object]) -> None:
    try:
        write()
    except OSError as exc:
        raise CacheError(
            f"cannot write the download cache at {path}: {exc.strerror or exc} (nothing was applied)"
        ) from None


__all__ = ["TMP_STALE_S", "DownloadCache", "file_sha256"]
