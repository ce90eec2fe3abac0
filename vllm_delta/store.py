"""Versioned delta store over fsspec: atomic publish, listing, chains, retention (docs/FORMAT.md).

Layout under the store root:

    versions/<version:010d>.json                                  commit record of one version (VersionRecord)
    data/<version:010d>.<kind>.<token>.safetensors                the version file (format.py), or
    data/<version:010d>.<kind>.<token>.part<index:05d>.safetensors  one part of a multi-part version
    assets/<name>                                                 config.json, tokenizer files, ...

A version is visible iff its record is, and the record is written only after all its data files are
complete. Data file names carry a random token, so a stale or crashed writer never overwrites
committed data; whatever a crashed publish leaves behind is invisible and `retain` removes it later.
A one-file version has a record of format 1 (`file`); a multi-part version (a sharded publisher:
each rank uploads its part with `put_part`, then one coordinator `commit_parts`) a record of format 2
that lists its parts (`parts`: file, bytes, checksum and sha256 of each).

Reading (docs/FORMAT.md, "Reading"): a reader's view is never older than one call. Listings and
reads of records and assets bypass fsspec's listing caches; decisions that depend on a record re-read
it (`fresh=True`); `latest()` on S3 lists only the records after the newest one seen, with a full
listing at least every FULL_LISTING_S. Every remote operation has a deadline (`timeout_s`); a
timeout raises StoreTimeoutError (504), an unreachable store StoreUnavailableError (503), both
naming the store. Downloads of remote stores land in a cache that verifies every file before use
(size, and the record's sha256 of the file when it has one), heals (a bad copy is fetched again) and is pruned
by the server (`prune_cache`).
"""

from __future__ import annotations

import builtins  # VersionRecord has a field named `bytes`
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, fields
from datetime import datetime
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from .errors import (
    CacheError,
    DeltaError,
    FormatError,
    IntegrityError,
    MissingBaseError,
    StoreTimeoutError,
    StoreUnavailableError,
    VersionExistsError,
    VersionNotFoundError,
    short,
)
from .format import KINDS, Version, VersionFile, VersionHeader, VersionLike

log = logging.getLogger(__name__)

RECORD_FORMAT = "vllm-delta-record"
RECORD_FORMAT_VERSION = 1  # one-file versions
RECORD_PARTS_FORMAT_VERSION = 2  # multi-part versions
VERSIONS_DIR = "versions"
DATA_DIR = "data"
ASSETS_DIR = "assets"
TMP_PREFIX = ".tmp-"  # never a committed name: readers skip it, retain removes old ones
LEFTOVER_AGE_S = 3600.0  # a publish older than this is dead, not slow
MAX_VERSION = 10**10 - 1  # ten digits keep names sorted as numbers

DEFAULT_TIMEOUT_S = 60.0  # deadline of one store operation (a download: plus its size at MIN_RATE)
DOWNLOAD_MIN_BYTES_PER_S = 5e6  # a download of n bytes may take timeout_s + n / this
FULL_LISTING_S = 60.0  # latest(): a full listing at least this often (retention, rewritten stores)
RECORD_CACHE = 64  # parsed records (and verified cache files) kept per store; least recently used go first
TMP_STALE_S = 600.0  # cache: a temp download untouched for this long is a leftover of a dead process
# s3fs/botocore defaults retry a frozen server for ~7 minutes (5 botocore x 5 s3fs attempts x 15 s):
# a few short attempts here, and every call also gets an asyncio deadline (`timeout=`).
S3_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 20,
    "retries": {"total_max_attempts": 3, "mode": "standard"},
}

# Files moved in from mkstemp are 0600; committed files get the mode a plain create would give them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK

_RECORD_NAME = re.compile(r"^(\d{10})\.json$")
_DATA_NAME = re.compile(r"^(\d{10})\.(anchor|delta)\.([0-9a-f]{16})(?:\.part(\d{5}))?\.safetensors$")
MAX_PARTS = 10**5  # five digits of part index in a part file's name
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def record_name(version: int) -> str:
    return f"{version:010d}.json"


def data_name(version: int, kind: str, token: str, part: int | None = None) -> str:
    suffix = "" if part is None else f".part{part:05d}"
    return f"{version:010d}.{kind}.{token}{suffix}.safetensors"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_hex(x: object) -> bool:
    return isinstance(x, str) and _HEX16.match(x) is not None


def _check_sha256(value: object, what: str) -> None:
    if value is not None and not (isinstance(value, str) and _SHA256.match(value)):
        raise ValueError(f"{what} must be 64 lower-case hex digits, not {short(value)}")


@dataclass(frozen=True)
class PartRecord:
    """One part of a multi-part version, as its record lists it."""

    file: str  # data file path relative to the store root
    bytes: int  # its size
    checksum: str  # Σ_t key(t) · (partial sum of t over the part's elements): the parts add up to the whole
    sha256: str | None = None  # hex digest of the part file

    @classmethod
    def from_dict(cls, doc: dict) -> PartRecord:
        return cls(file=doc["file"], bytes=doc["bytes"], checksum=doc["checksum"], sha256=doc.get("sha256"))

    def to_dict(self) -> dict:
        doc = asdict(self)
        if self.sha256 is None:
            del doc["sha256"]
        return doc


@dataclass(frozen=True)
class DataFile:
    """One data file of a version, as a reader checks it: where, how big, and its sha256 if known."""

    file: str
    bytes: int
    sha256: str | None


@dataclass(frozen=True)
class VersionRecord:
    """The commit record of one version, stored as JSON at versions/<version:010d>.json.

    One-file versions (record format 1) name their file in `file`; multi-part versions (record
    format 2) have `file` None and list their parts in `parts` (`bytes` is then the parts' total)."""

    version: int
    kind: str  # "anchor" | "delta"
    base: int | None
    codec: str | None
    file: str | None  # data file path relative to the store root (one-file versions)
    bytes: int  # size of the data file (of all parts)
    nnz: int  # changed elements (numel for anchors)
    numel: int
    checksum: str  # whole-model checksum at this version
    base_checksum: str | None
    created: float
    sha256: str | None = None  # hex digest of the data file (optional: older records have none)
    parts: tuple[PartRecord, ...] = ()  # multi-part versions, in part order

    @property
    def density(self) -> float:
        return self.nnz / self.numel if self.numel else 0.0

    @property
    def files(self) -> list[str]:
        """Every data file of the version (relative to the store root), in part order."""
        return [d.file for d in self.data_files]

    @property
    def sizes(self) -> list[int]:
        return [d.bytes for d in self.data_files]

    @property
    def data_files(self) -> list[DataFile]:
        if self.file is not None:
            return [DataFile(self.file, self.bytes, self.sha256)]
        return [DataFile(p.file, p.bytes, p.sha256) for p in self.parts]

    def to_json(self) -> str:
        doc = asdict(self)
        if doc["sha256"] is None:
            del doc["sha256"]  # exactly what a reader without the field wrote
        if self.parts:
            del doc["file"]
            doc["parts"] = [p.to_dict() for p in self.parts]
            doc = {"format": RECORD_FORMAT, "format_version": RECORD_PARTS_FORMAT_VERSION, **doc}
        else:
            del doc["parts"]  # exactly record format 1
            doc = {"format": RECORD_FORMAT, "format_version": RECORD_FORMAT_VERSION, **doc}
        return json.dumps(doc, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | builtins.bytes, *, where: str = "record") -> VersionRecord:
        try:
            doc = json.loads(text)
            fv = doc.get("format_version")
            if doc.get("format") != RECORD_FORMAT or fv not in (RECORD_FORMAT_VERSION, RECORD_PARTS_FORMAT_VERSION):
                raise ValueError(
                    f"not a {RECORD_FORMAT} v{RECORD_FORMAT_VERSION} or v{RECORD_PARTS_FORMAT_VERSION} document"
                )
            # Unknown keys are ignored so that a later minor addition doesn't hide versions; optional
            # fields (those with a default) may be absent.
            common = {
                f.name: doc[f.name]
                for f in fields(cls)
                if f.name not in ("file", "parts") and (f.name in doc or f.default is MISSING)
            }
            if fv == RECORD_FORMAT_VERSION:
                rec = cls(file=doc["file"], **common)
            else:
                if not isinstance(doc["parts"], list):
                    raise ValueError("parts must be a list")
                rec = cls(file=None, parts=tuple(PartRecord.from_dict(p) for p in doc["parts"]), **common)
            rec._validate()
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise FormatError(f"unreadable commit record {where}: {exc}") from None
        return rec

    def _validate(self) -> None:
        ints = (self.version, self.bytes, self.nnz, self.numel)
        if not all(_is_int(x) for x in ints):
            raise ValueError("version, bytes, nnz and numel must be non-negative integers")
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.kind == "delta" and not (isinstance(self.base, int) and 0 <= self.base < self.version):
            raise ValueError(f"a delta needs a base below its version, got {self.base!r}")
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool):
            raise ValueError("bad created time")
        for key in ("checksum", "base_checksum"):
            value = getattr(self, key)
            if (value is not None or key == "checksum") and not (isinstance(value, str) and _HEX16.match(value)):
                raise ValueError(f"{key} must be 16 lower-case hex digits, not {short(value)}")
        _check_sha256(self.sha256, "sha256")
        if self.file is not None:
            if self.parts:
                raise ValueError("a record names one file or lists parts, not both")
            self._check_file(self.file, None)
            return
        if self.sha256 is not None:
            raise ValueError("a multi-part record has a sha256 per part, not one for the version")
        if not self.parts or len(self.parts) > MAX_PARTS:
            raise ValueError("a multi-part record lists its parts")
        for i, part in enumerate(self.parts):
            if not isinstance(part.file, str) or not _is_int(part.bytes) or not _is_hex(part.checksum):
                raise ValueError(f"bad part {i}: {short(part)}")
            _check_sha256(part.sha256, f"part {i}'s sha256")
            self._check_file(part.file, i)
        if len(set(self.files)) != len(self.parts) or sum(p.bytes for p in self.parts) != self.bytes:
            raise ValueError("parts must be distinct files whose sizes add up to bytes")
        total = 0
        for part in self.parts:
            total = (total + int(part.checksum, 16)) & ((1 << 64) - 1)
        if f"{total:016x}" != self.checksum:
            raise ValueError(f"the parts' checksums add up to {total:016x}, not {self.checksum}")

    def _check_file(self, file: str, part: int | None) -> None:
        folder, _, name = file.partition("/")
        m = _DATA_NAME.match(name)
        index = None if not m or m.group(4) is None else int(m.group(4))
        if folder != DATA_DIR or not m or int(m.group(1)) != self.version or m.group(2) != self.kind or index != part:
            what = f"{self.kind} {self.version}" + ("" if part is None else f" part {part}")
            raise ValueError(f"data file {file!r} does not belong to {what}")


def _normalize(uri: str | os.PathLike) -> str:
    uri = os.fspath(uri)
    if "://" not in uri:
        return os.path.abspath(os.path.expanduser(uri))
    if uri.startswith("file://"):
        return "file://" + os.path.abspath(os.path.expanduser(uri[len("file://") :]))
    return uri.rstrip("/")


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _fsync(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _modified(entry: dict) -> float | None:
    """Last-modified time of an fsspec listing entry (local, s3fs and HfFileSystem spell it differently)."""
    for key in ("uploaded_at", "LastModified", "mtime", "last_modified"):
        value = entry.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


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
_CACHE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM})


def store_error(exc: BaseException, uri: str, what: str) -> DeltaError | None:
    """The DeltaError a failed store operation means (timeout 504, unreachable 503), or None if it is
    none of those. Recognized by class name, so that neither botocore nor aiohttp need be imported."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _TIMEOUT_NAMES or isinstance(exc, TimeoutError):
        return StoreTimeoutError(f"store {uri} did not answer in time ({what}): {type(exc).__name__}: {str(exc)[:200]}")
    if names & _UNAVAILABLE_NAMES or isinstance(exc, ConnectionError):
        return StoreUnavailableError(f"store {uri} is unreachable ({what}): {type(exc).__name__}: {str(exc)[:200]}")
    return None


def _storage_options(uri: str, options: dict, timeout_s: float) -> dict:
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


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class DeltaStore:
    """Versions of one model in a directory, S3 prefix or Hugging Face bucket (any fsspec URI).

    `timeout_s` bounds every remote operation (a download gets `timeout_s + bytes / 5 MB/s`);
    `cache_dir` is where remote version files are downloaded (default: a private temp dir)."""

    def __init__(
        self,
        uri: str,
        storage_options: dict | None = None,
        cache_dir: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.uri = _normalize(uri)
        self.storage_options = dict(storage_options or {})
        self.timeout_s = float(timeout_s)
        options = _storage_options(self.uri, self.storage_options, self.timeout_s)
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = self.root.rstrip("/") or self.root
        # fsspec's asyncio deadline (`timeout=` on every call) exists for async filesystems only.
        self._async = isinstance(self.fs, AsyncFileSystem)
        self._s3 = hasattr(self.fs, "_call_s3")
        if self._s3:
            self.fs.retries = 1  # s3fs's own retry loop around botocore's (an attribute, not an option)
        self._cache_dir = cache_dir
        self._own_cache = False
        self._records: OrderedDict[int, VersionRecord] = OrderedDict()  # LRU of parsed records
        self._valid: set[int] = set()  # versions whose records parsed, as of the last listing
        self._newest_key: str | None = None  # record name of the newest version seen (incremental listing)
        self._full_at = -float("inf")  # time.monotonic() of the last full listing
        self._verified: OrderedDict[str, tuple[int, int, int]] = OrderedDict()  # cache path -> stat it passed at
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeltaStore({self.uri!r})"

    # -- paths -------------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _record_path(self, version: int) -> str:
        return self._path(VERSIONS_DIR, record_name(version))

    # -- remote operations: fresh, bounded, with errors that name the store ---------------------
    def _kw(self, timeout: float | None = None) -> dict:
        return {"timeout": timeout or self.timeout_s} if self._async else {}

    @contextlib.contextmanager
    def _remote(self, what: str) -> Iterator[None]:
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

    def _cat(self, path: str, what: str) -> builtins.bytes:
        """One object's bytes, read afresh (a stale parent listing would answer 'not found' unasked)."""
        if self.is_local:
            with open(path, "rb") as f:
                return f.read()
        with self._remote(what):
            self.fs.invalidate_cache(path)
            if self._s3:
                return self.fs.cat_file(path, max_concurrency=1, **self._kw())  # one GET, no HEAD
            return self.fs.cat_file(path, **self._kw())

    def _ls(self, folder: str) -> list[dict]:
        """Files directly in `folder`, listed afresh (fsspec caches listings of remote stores)."""
        path = self._path(folder)
        with self._remote(f"listing {folder}/"):
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True, **self._kw())
            except FileNotFoundError:
                return []
        return [e for e in entries if e.get("type") == "file"]

    def _exists(self, path: str) -> bool:
        if self.is_local:
            return os.path.exists(path)
        with self._remote(f"looking up {path}"):
            self.fs.invalidate_cache(path)
            return self.fs.exists(path, **self._kw())

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("%s: %s", self.uri, message)

    # -- records -----------------------------------------------------------------------------
    def _remember(self, rec: VersionRecord) -> None:
        with self._lock:
            self._records[rec.version] = rec
            self._records.move_to_end(rec.version)
            while len(self._records) > RECORD_CACHE:
                self._records.popitem(last=False)
            self._valid.add(rec.version)

    def _forget(self, version: int) -> None:
        with self._lock:
            self._records.pop(version, None)
            self._valid.discard(version)

    def _load_record(self, version: int, fresh: bool = False) -> VersionRecord | None:
        """The parsed record (from the cache, or from the store when `fresh` or not cached); None if
        absent or unreadable."""
        if not fresh:
            with self._lock:
                cached = self._records.get(version)
                if cached is not None:
                    self._records.move_to_end(version)
                    return cached
        path = self._record_path(version)
        if not self.is_local:
            # s3fs's cat_file asks _info, which answers from a cached listing of versions/ when there is
            # one: a record committed by another process after that listing would look absent forever.
            self.fs.invalidate_cache(path)
        try:
            text = self._cat(path, f"reading {VERSIONS_DIR}/{record_name(version)}")
        except FileNotFoundError:
            self._forget(version)
            return None
        try:
            rec = VersionRecord.from_json(text, where=path)
            if rec.version != version:
                raise FormatError(f"record {path} describes version {rec.version}")
        except FormatError as exc:
            # Not fatal: a foreign or damaged record must not hide the other versions.
            self._warn_once(path, f"ignoring {exc}")
            self._forget(version)
            return None
        self._remember(rec)
        return rec

    def versions(self) -> list[int]:
        """Committed versions, ascending (a fresh listing each call; a record is parsed once)."""
        found = []
        for entry in self._ls(VERSIONS_DIR):
            name = _basename(entry["name"])
            m = _RECORD_NAME.match(name)
            if not m:
                if not name.startswith(TMP_PREFIX):
                    self._warn_once(name, f"ignoring {VERSIONS_DIR}/{name}: not a record name")
                continue
            v = int(m.group(1))
            if v in self._valid or self._load_record(v) is not None:
                found.append(v)
        found.sort()
        with self._lock:  # forget records that retention removed meanwhile
            for gone in self._valid - set(found):
                self._records.pop(gone, None)
            self._valid = set(found)
            self._newest_key = record_name(found[-1]) if found else None
            self._full_at = time.monotonic()
        return found

    def latest(self) -> int | None:
        """The newest committed version. On S3, between full listings (every FULL_LISTING_S), one
        ListObjectsV2 of the records after the newest seen and one GET confirming it."""
        if self._s3 and self._newest_key is not None and time.monotonic() - self._full_at < FULL_LISTING_S:
            for name in self._list_records_after(self._newest_key):
                m = _RECORD_NAME.match(name)
                if m and self._load_record(int(m.group(1))) is not None:
                    with self._lock:
                        self._newest_key = max(self._newest_key or name, name)
            with self._lock:
                newest = max(self._valid, default=None)
            if newest is not None and self._load_record(newest, fresh=True) is not None:
                return newest
            # The newest record seen is gone: the store was emptied or rewritten. List everything.
        versions = self.versions()
        return versions[-1] if versions else None

    def _list_records_after(self, key: str) -> list[str]:
        """Names in versions/ that sort after `key` (S3 ListObjectsV2 StartAfter, every page)."""
        bucket, _, prefix = self.root.partition("/")
        folder = f"{prefix}/{VERSIONS_DIR}/" if prefix else f"{VERSIONS_DIR}/"
        names: list[str] = []
        kwargs: dict = {"Bucket": bucket, "Prefix": folder, "StartAfter": folder + key}
        with self._remote(f"listing {VERSIONS_DIR}/ after {key}"):
            while True:
                page = self.fs.call_s3("list_objects_v2", **kwargs, **self._kw())
                names += [o["Key"][len(folder) :] for o in page.get("Contents", [])]
                if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                    return names
                kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def resolve(self, version: int | str) -> int:
        """A committed version number from an int, a decimal string or "latest" (read afresh)."""
        if version == "latest":
            latest = self.latest()
            if latest is None:
                raise VersionNotFoundError(f"store {self.uri} holds no version yet")
            return latest
        if isinstance(version, str) and version.isdigit():
            version = int(version)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"a version is a non-negative integer or 'latest', not {version!r}")
        if version > MAX_VERSION or self._load_record(version, fresh=True) is None:
            raise VersionNotFoundError(f"no version {version} in store {self.uri}", version=version)
        return version

    def record(self, version: int, *, fresh: bool = False) -> VersionRecord:
        """A version's commit record; `fresh` reads it from the store even if it was seen before (a
        store wiped and refilled by another run reuses version numbers)."""
        ok = isinstance(version, int) and not isinstance(version, bool) and 0 <= version <= MAX_VERSION
        rec = self._load_record(version, fresh) if ok else None
        if rec is None:
            raise VersionNotFoundError(f"no version {version} in store {self.uri}", version=version)
        return rec

    def records(self) -> list[VersionRecord]:
        return [rec for v in self.versions() if (rec := self._load_record(v)) is not None]

    def _base_of(self, child: VersionRecord, fresh: bool) -> VersionRecord:
        assert child.base is not None  # validated: a delta has a base
        base = self._load_record(child.base, fresh)
        if base is None:
            raise MissingBaseError(
                f"version {child.version} is a delta on version {child.base}, which is not in store {self.uri}",
                version=child.base,
            )
        if child.base_checksum is not None and base.checksum != child.base_checksum:
            raise IntegrityError(
                f"delta {child.version} expects base checksum {child.base_checksum}, "
                f"version {base.version} has {base.checksum}",
                version=child.version,
            )
        return base

    def chain(self, version: int, *, fresh: bool = False) -> list[VersionRecord]:
        """Records to replay to build `version`: its anchor first, `version` last."""
        chain = [self.record(version, fresh=fresh)]
        while chain[-1].kind == "delta":  # bases strictly decrease, so this ends
            chain.append(self._base_of(chain[-1], fresh))
        return chain[::-1]

    def plan(self, held: int | None, target: int, *, fresh: bool = False) -> list[VersionRecord]:
        """What a reader holding `held` applies, in order, to reach `target`: the deltas after `held`
        when `held` is on `target`'s chain below it, else `target`'s whole chain. Reads only what the
        answer depends on (with `fresh`, from the store)."""
        if held is not None and held == target:
            self.record(target, fresh=fresh)  # an unknown target is an error even for a no-op
            return []
        chain = [self.record(target, fresh=fresh)]
        while chain[-1].kind == "delta":
            if held is not None and chain[-1].base == held:
                break  # held's record and what lies below it are not needed
            chain.append(self._base_of(chain[-1], fresh))
        return chain[::-1]

    # -- data files --------------------------------------------------------------------------
    def local_path(self, version: int, *, record: VersionRecord | None = None) -> str:
        """A local file holding a one-file version's data: the file itself, or a verified download (of
        the file `record` names, when given: the record a caller's decision was made on)."""
        rec = record if record is not None else self.record(version)
        if rec.file is None:
            raise ValueError(f"version {version} has {len(rec.parts)} parts: use local_paths() or open()")
        return self._local_file(rec, rec.data_files[0])

    def local_paths(self, version: int, *, record: VersionRecord | None = None) -> list[str]:
        """Local files holding the version's data (one, or one per part in part order), each verified."""
        rec = record if record is not None else self.record(version)
        return [self._local_file(rec, d) for d in rec.data_files]

    def _local_file(self, rec: VersionRecord, data: DataFile) -> str:
        if not self.is_local:
            return self._cached(rec, data)
        path = self._path(data.file)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise self._missing_data(rec, data.file) from None
        self._check_size(rec, data, size)
        return path

    def open(self, version: int, *, record: VersionRecord | None = None, fresh: bool = False) -> VersionLike:
        """The version's data, checked against its record: a `VersionFile` (one file) or a `Version`
        (several parts); both give `header`, `pieces(name)` and `dense(name)`."""
        rec = record if record is not None else self.record(version, fresh=fresh)
        paths = self.local_paths(version, record=rec)
        vf: VersionLike
        if rec.file is not None:
            vf = VersionFile(paths[0], expect_version=version)
        else:
            files = [VersionFile(path, expect_version=version) for path in paths]
            for i, (f, part) in enumerate(zip(files, rec.parts)):
                info = f.header.part
                if info is None or info.index != i or info.count != len(rec.parts) or info.checksum != part.checksum:
                    for g in files:
                        g.close()
                    raise IntegrityError(
                        f"data file {part.file} is not part {i} of {len(rec.parts)} with checksum {part.checksum}",
                        version=version,
                    )
            vf = Version(files, expect_version=version)
        if vf.header.checksum != rec.checksum or vf.header.kind != rec.kind:
            vf.close()
            raise IntegrityError(
                f"data of version {version} holds {vf.header.kind} with checksum {vf.header.checksum}, "
                f"its record says {rec.kind} with {rec.checksum}",
                version=version,
            )
        return vf

    def _check_size(self, rec: VersionRecord, data: DataFile, size: int) -> None:
        if size != data.bytes:
            raise IntegrityError(
                f"data file {data.file} holds {size} bytes, its record says {data.bytes} (truncated or replaced)",
                version=rec.version,
            )

    def _missing_data(self, rec: VersionRecord, file: str) -> Exception:
        if not self._exists(self._record_path(rec.version)):
            self._forget(rec.version)
            return VersionNotFoundError(f"version {rec.version} was removed from store {self.uri}", version=rec.version)
        return IntegrityError(f"record names data file {file}, which is missing", version=rec.version)

    # -- the download cache (remote stores) -----------------------------------------------------
    def _download_dir(self) -> str:
        with self._lock:
            if self._cache_dir is None:
                self._cache_dir = tempfile.mkdtemp(prefix="vllm-delta-cache-")
                self._own_cache = True
                weakref.finalize(self, shutil.rmtree, self._cache_dir, ignore_errors=True)
        if self._own_cache:
            folder = self._cache_dir
        else:
            # One folder per store, so that a cache_dir shared by several stores never mixes them.
            folder = os.path.join(self._cache_dir, hashlib.sha256(self.uri.encode()).hexdigest()[:16])
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot use the download cache {folder}: {exc.strerror or exc}") from None
        return folder

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
        if file_sha256(path) != data.sha256:
            return False
        with self._lock:
            self._verified[path] = stamp
            while len(self._verified) > RECORD_CACHE:
                self._verified.popitem(last=False)
        return True

    def _cached(self, rec: VersionRecord, data: DataFile) -> str:
        """A verified copy of one of the record's files in the cache: the one there, or a fresh download."""
        folder = self._download_dir()
        final = os.path.join(folder, _basename(data.file))
        if self._verified_copy(final, data):
            return final
        if os.path.exists(final):
            log.warning("%s: cached %s does not match its record: fetching it again", self.uri, final)
            with contextlib.suppress(FileNotFoundError):
                os.remove(final)
        # A unique temp name, then a rename: concurrent readers never see a partial download.
        tmp = os.path.join(folder, f"{TMP_PREFIX}{secrets.token_hex(8)}-{_basename(data.file)}")
        try:
            self._cache_write(tmp, lambda: open(tmp, "wb").close())  # a read-only cache fails here, clearly
            src = self._path(data.file)
            try:
                with self._remote(f"downloading {data.file}"):
                    self.fs.invalidate_cache(src)
                    self.fs.get_file(src, tmp, **self._kw(self.timeout_s + data.bytes / DOWNLOAD_MIN_BYTES_PER_S))
            except FileNotFoundError:
                raise self._missing_data(rec, data.file) from None
            except OSError as exc:
                if exc.errno in _CACHE_ERRNOS:
                    raise CacheError(f"cannot write the download cache {folder}: {exc.strerror or exc}") from None
                raise
            self._check_size(rec, data, os.path.getsize(tmp))
            if data.sha256 is not None and file_sha256(tmp) != data.sha256:
                raise IntegrityError(
                    f"data file {data.file} does not have the sha256 its record says (damaged or replaced)",
                    version=rec.version,
                )
            self._cache_write(final, lambda: os.replace(tmp, final))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        if data.sha256 is not None:
            st = os.stat(final)
            with self._lock:
                self._verified[final] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return final

    @staticmethod
    def _cache_write(path: str, write: Callable[[], object]) -> None:
        try:
            write()
        except OSError as exc:
            raise CacheError(
                f"cannot write the download cache at {path}: {exc.strerror or exc} (nothing was applied)"
            ) from None

    # -- writing -----------------------------------------------------------------------------
    def publish(self, header: VersionHeader, local_path: str, *, move: bool = False) -> VersionRecord:
        """Commit a one-file version atomically. `move=True` hands the file over (renamed or deleted)."""
        header.validate()
        v = header.version
        if v > MAX_VERSION:
            raise ValueError(f"version {v} exceeds {MAX_VERSION}")
        if header.part is not None:
            raise ValueError("a part file is uploaded with put_part and committed with commit_parts")
        self._check_file_holds(header, local_path)
        if self._exists(self._record_path(v)):
            raise VersionExistsError(f"version {v} already exists in store {self.uri}", version=v)
        token = secrets.token_hex(8)
        file = f"{DATA_DIR}/{data_name(v, header.kind, token)}"
        rec = VersionRecord(
            version=v,
            kind=header.kind,
            base=header.base,
            codec=header.codec,
            file=file,
            bytes=os.path.getsize(local_path),
            nnz=header.nnz,
            numel=header.numel,
            checksum=header.checksum,
            base_checksum=header.base_checksum,
            created=header.created or time.time(),
        )
        consumed, sha256 = self._put_digested(v, file, local_path, rec.bytes, move, token)
        rec = dataclasses.replace(rec, sha256=sha256)
        try:
            self._commit_record(rec, token)
        except VersionExistsError:
            self._remove_data([file])
            raise
        if move and not consumed:
            os.remove(local_path)
        self._remember(rec)
        return rec

    def put_part(self, header: VersionHeader, local_path: str, *, move: bool = False) -> PartRecord:
        """Upload one part file of a multi-part version under a fresh name; nothing becomes visible.

        Returns once the part is durable (local: renamed into place and fsynced; remote: uploaded and
        its size checked). `commit_parts` makes the version visible; `discard_parts` removes parts
        of a version that will not be committed (else `retain` removes them after LEFTOVER_AGE_S)."""
        header.validate()
        v, part = header.version, header.part
        if part is None:
            raise ValueError("put_part takes a part file (format version 2); one-file versions use publish")
        if v > MAX_VERSION or part.count > MAX_PARTS:
            raise ValueError(f"version {v} or part count {part.count} out of range")
        self._check_file_holds(header, local_path)
        token = secrets.token_hex(8)
        file = f"{DATA_DIR}/{data_name(v, header.kind, token, part.index)}"
        nbytes = os.path.getsize(local_path)
        consumed, sha256 = self._put_digested(v, file, local_path, nbytes, move, token)
        if move and not consumed:
            os.remove(local_path)
        return PartRecord(file=file, bytes=nbytes, checksum=part.checksum, sha256=sha256)

    def commit_parts(
        self,
        *,
        version: int,
        kind: str,
        base: int | None,
        codec: str | None,
        nnz: int,
        numel: int,
        checksum: str,
        base_checksum: str | None,
        parts: list[PartRecord],
        created: float = 0.0,
    ) -> VersionRecord:
        """Make a multi-part version visible: write its record (format 2) listing `parts` in order.

        Every part must be in the store with its recorded size (checked here, one stat each); the
        record is written like a one-file version's (atomic, never replaced: VersionExistsError).
        The parts' checksums must add up to `checksum`. Nothing is deleted on failure: the caller
        decides (`discard_parts`)."""
        rec = VersionRecord(
            version=version,
            kind=kind,
            base=base,
            codec=codec,
            file=None,
            bytes=sum(p.bytes for p in parts),
            nnz=nnz,
            numel=numel,
            checksum=checksum,
            base_checksum=base_checksum,
            created=created or time.time(),
            parts=tuple(parts),
        )
        try:
            rec._validate()
        except (ValueError, TypeError) as exc:
            raise FormatError(f"bad multi-part record: {exc}", version=version) from None
        if version > MAX_VERSION:
            raise ValueError(f"version {version} exceeds {MAX_VERSION}")
        if self._exists(self._record_path(version)):
            raise VersionExistsError(f"version {version} already exists in store {self.uri}", version=version)
        for part in parts:
            path = self._path(part.file)
            try:
                if self.is_local:
                    size = os.path.getsize(path)
                else:
                    with self._remote(f"checking {part.file}"):
                        self.fs.invalidate_cache(path)
                        size = self.fs.info(path, **self._kw())["size"]
            except FileNotFoundError:
                raise IntegrityError(f"part {part.file} is not in the store", version=version) from None
            if size != part.bytes:
                raise IntegrityError(f"part {part.file} holds {size} bytes, not {part.bytes}", version=version)
        if self.is_local:
            _fsync(self._path(DATA_DIR), directory=True)
            os.makedirs(self._path(VERSIONS_DIR), exist_ok=True)
        self._commit_record(rec, secrets.token_hex(8))
        self._remember(rec)
        return rec

    def discard_parts(self, parts: Iterable[PartRecord]) -> None:
        """Remove uploaded parts of a version that is not committed (best effort)."""
        try:
            self._remove_data(p.file for p in parts)
        except (OSError, DeltaError) as exc:
            log.warning("%s: could not remove uncommitted parts (retain removes them later): %s", self.uri, exc)

    def _check_file_holds(self, header: VersionHeader, local_path: str) -> None:
        v = header.version
        with VersionFile(local_path, expect_version=v) as vf:
            stored = vf.header
        if (stored.kind, stored.base, stored.checksum, stored.base_checksum, stored.part) != (
            header.kind,
            header.base,
            header.checksum,
            header.base_checksum,
            header.part,
        ):
            raise IntegrityError(f"{local_path} does not hold the version its header describes", version=v)

    def _put_digested(
        self, version: int, file: str, src: str, nbytes: int, move: bool, token: str
    ) -> tuple[bool, str | None]:
        """`_put_data`, and the file's sha256 for a remote store, hashed on a thread while the file
        uploads (remote readers verify their downloaded copies with it; hashing ~1 GB/s would otherwise
        add to every publish). A local store's readers use the file itself (checked by size, and by
        the staging checksums): no digest, and nothing added to the time to live."""
        if self.is_local:
            return self._put_data(version, file, src, nbytes, move, token), None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-delta-sha256") as pool:
            digest = pool.submit(file_sha256, src)  # hashlib releases the GIL on large reads
            consumed = self._put_data(version, file, src, nbytes, move, token)
            return consumed, digest.result()

    def _put_data(self, version: int, file: str, src: str, nbytes: int, move: bool, token: str) -> bool:
        """Put `src` at `file` (relative to the root), durable. True if `src` was renamed into place."""
        data = self._path(file)
        if not self.is_local:
            # An S3 object (and a bucket file) becomes visible only when its upload completes.
            with self._remote(f"uploading {file}"):
                # The deadline matters most here: a PUT to a frozen server waits forever for its
                # `100 Continue` otherwise (aiohttp arms no timer for it).
                self.fs.put_file(src, data, **self._kw(self.timeout_s + nbytes / DOWNLOAD_MIN_BYTES_PER_S))
                self.fs.invalidate_cache(data)
                size = self.fs.info(data, **self._kw())["size"]
                if size != nbytes:
                    self.fs.rm_file(data, **self._kw())
                    raise IntegrityError(f"store kept {size} of {nbytes} bytes of {file}", version=version)
            return False
        data_dir = self._path(DATA_DIR)
        os.makedirs(data_dir, exist_ok=True)
        os.makedirs(self._path(VERSIONS_DIR), exist_ok=True)
        moved = False
        if move:
            _fsync(src)
            try:
                os.replace(src, data)
                os.chmod(data, _FILE_MODE)
                moved = True
            except OSError as exc:
                if exc.errno != errno.EXDEV:  # another filesystem: copy below
                    raise
        if not moved:
            tmp = os.path.join(data_dir, f"{TMP_PREFIX}{token}.safetensors")
            try:
                shutil.copyfile(src, tmp)
                _fsync(tmp)
                os.replace(tmp, data)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        _fsync(data_dir, directory=True)  # the data's name must be durable before the record's
        return moved

    def _remove_data(self, files: Iterable[str]) -> None:
        for file in files:
            with self._remote(f"removing {file}"), contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._path(file), **self._kw())

    def _commit_record(self, rec: VersionRecord, token: str) -> None:
        if self.is_local:
            self._commit_local_record(rec, token)
        else:
            self._commit_remote_record(rec)

    def _commit_local_record(self, rec: VersionRecord, token: str) -> None:
        versions_dir = self._path(VERSIONS_DIR)
        final = self._record_path(rec.version)
        tmp = os.path.join(versions_dir, f"{TMP_PREFIX}{token}.json")
        with open(tmp, "w") as f:
            f.write(rec.to_json())
            f.flush()
            os.fsync(f.fileno())
        try:
            # link() never replaces an existing name: of two racing publishers, one wins.
            os.link(tmp, final)
        except FileExistsError:
            raise VersionExistsError(
                f"version {rec.version} already exists in store {self.uri}", version=rec.version
            ) from None
        except OSError:  # no hard links on this filesystem: check, then rename
            if os.path.exists(final):
                os.remove(tmp)
                raise VersionExistsError(
                    f"version {rec.version} already exists in store {self.uri}", version=rec.version
                ) from None
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _fsync(versions_dir, directory=True)

    def _commit_remote_record(self, rec: VersionRecord) -> None:
        # Object stores have no no-clobber rename here: check, then one small PUT. Two publishers of
        # one version can still race inside this window; the design has one publisher per store.
        if self._exists(self._record_path(rec.version)):
            raise VersionExistsError(f"version {rec.version} already exists in store {self.uri}", version=rec.version)
        with self._remote(f"writing {VERSIONS_DIR}/{record_name(rec.version)}"):
            self.fs.pipe_file(self._record_path(rec.version), rec.to_json().encode(), **self._kw())

    # -- retention ---------------------------------------------------------------------------
    def retain(self, keep_anchors: int, *, protect: Iterable[int] = ()) -> list[int]:
        """Keep the newest `keep_anchors` anchors and everything from the oldest of them on, plus the
        versions in `protect` and every version a live replica of the ledger reports serving
        (`vllm_delta.ledger`), each with its chain.

        Returns the deleted versions. Versions are deleted newest first, record before data, so
        that every visible record keeps its data and its whole chain at every moment. Leftovers of
        crashed publishes older than LEFTOVER_AGE_S are removed too.
        """
        if keep_anchors < 1:
            raise ValueError("keep_anchors must be at least 1")
        from .ledger import Ledger  # the ledger reads this store: imported here, not at module level

        ledger = Ledger(self)
        ledger.expire()
        protected = set(protect) | ledger.live_versions()
        recs = {r.version: r for r in self.records()}
        anchors = sorted(v for v, r in recs.items() if r.kind == "anchor")
        deleted = []
        if len(anchors) > keep_anchors:
            oldest_kept = anchors[-keep_anchors]
            keep = {v for v in recs if v >= oldest_kept} | (protected & set(recs))
            # A kept delta whose chain reaches below the oldest kept anchor keeps that chain.
            for v in list(keep):
                while (b := recs[v].base) is not None and recs[v].kind == "delta" and b in recs and b not in keep:
                    keep.add(b)
                    v = b
            for v in sorted(set(recs) - keep, reverse=True):
                self._delete(recs[v])
                deleted.append(v)
        self._remove_leftovers()
        return sorted(deleted)

    def _delete(self, rec: VersionRecord) -> None:
        for path in (self._record_path(rec.version), *(self._path(f) for f in rec.files)):
            with self._remote(f"deleting {path}"), contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path, **self._kw())
            if path.endswith(".json"):
                self._forget(rec.version)
        self.prune_cache(keep=(), versions=[rec.version])

    def _remove_leftovers(self) -> None:
        named = {_basename(f) for r in self.records() for f in r.files}
        cutoff = time.time() - LEFTOVER_AGE_S
        for folder in (DATA_DIR, VERSIONS_DIR, ASSETS_DIR):
            for entry in self._ls(folder):
                name = _basename(entry["name"])
                ours = name.startswith(TMP_PREFIX) or (folder == DATA_DIR and _DATA_NAME.match(name))
                if not ours or name in named:
                    continue
                mtime = _modified(entry)
                if mtime is not None and mtime < cutoff:
                    log.info("%s: removing leftover %s/%s", self.uri, folder, name)
                    with self._remote(f"deleting {folder}/{name}"), contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(entry["name"], **self._kw())

    def _cache_files(self) -> list[os.DirEntry]:
        if self.is_local or self._cache_dir is None:
            return []
        try:
            return [e for e in os.scandir(self._download_dir()) if e.is_file(follow_symlinks=False)]
        except (FileNotFoundError, CacheError):
            return []

    def cache_bytes(self) -> int:
        """Bytes this store's download cache holds (0 for local stores)."""
        total = 0
        for e in self._cache_files():
            with contextlib.suppress(FileNotFoundError):
                total += e.stat(follow_symlinks=False).st_size
        return total

    def prune_cache(
        self,
        keep: Iterable[int] = (),
        versions: Iterable[int] | None = None,
        *,
        max_bytes: int | None = None,
        protect: Iterable[int] = (),
    ) -> list[str]:
        """Delete downloaded copies (remote stores) of `versions` (default: all) except `keep`, and temp
        downloads nobody has touched for TMP_STALE_S (a killed process's partial files). Then, with
        `max_bytes`, delete kept copies too, oldest version first, until the cache fits, except those
        of `protect` (a staged update's). Returns the deleted names."""
        keep, protect, only = set(keep), set(protect), None if versions is None else set(versions)
        removed, kept = [], []
        stale = time.time() - TMP_STALE_S
        for e in self._cache_files():
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            m = _DATA_NAME.match(e.name)
            if e.name.startswith(TMP_PREFIX):
                drop = st.st_mtime < stale
            elif m:
                v = int(m.group(1))
                drop = v not in keep and (only is None or v in only)
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
                if v in protect:
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

    # -- assets ------------------------------------------------------------------------------
    def _asset_path(self, name: str) -> str:
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") or p.startswith(TMP_PREFIX) for p in parts) or "\\" in name:
            raise ValueError(f"bad asset name {name!r}")
        return self._path(ASSETS_DIR, *parts)

    def put_asset(self, name: str, data: bytes) -> None:
        """Store a small file (config.json, tokenizer files) atomically, replacing an older one."""
        self._write_small(self._asset_path(name), data)

    def get_asset(self, name: str) -> bytes:
        try:
            return self._read_small(self._asset_path(name))
        except FileNotFoundError:
            raise FileNotFoundError(f"no asset {name!r} in store {self.uri}") from None

    # -- small mutable objects (assets, the replica ledger) ----------------------------------------
    def _write_small(self, path: str, data: bytes) -> None:
        """Write a small object atomically, replacing an older one (readers see old or new, whole)."""
        if not self.is_local:
            with self._remote(f"writing {path}"):
                self.fs.pipe_file(path, bytes(data), **self._kw())  # an object store PUT is atomic
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

    def _read_small(self, path: str) -> bytes:
        """A small object as it is now (listing caches bypassed: it may have changed or just appeared)."""
        return self._cat(path, f"reading {path}")

    def write_object(self, folder: str, name: str, data: bytes) -> None:
        """A small mutable object at `<folder>/<name>` under the store root (e.g. `replicas/<id>.json`)."""
        self._write_small(self._object_path(folder, name), data)

    def read_object(self, folder: str, name: str) -> bytes:
        return self._read_small(self._object_path(folder, name))

    def list_objects(self, folder: str) -> list[str]:
        """Names of the committed objects directly in `folder` (temporary files skipped), listed afresh."""
        self._object_path(folder, "x")
        names = (_basename(e["name"]) for e in self._ls(folder))
        return sorted(n for n in names if not n.startswith(TMP_PREFIX))

    def delete_object(self, folder: str, name: str) -> None:
        with self._remote(f"deleting {folder}/{name}"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._object_path(folder, name), **self._kw())

    def _object_path(self, folder: str, name: str) -> str:
        if folder in (VERSIONS_DIR, DATA_DIR) or not folder.isidentifier():
            raise ValueError(f"bad object folder {folder!r}")
        if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith(TMP_PREFIX):
            raise ValueError(f"bad object name {name!r}")
        return self._path(folder, name)

    def assets(self) -> list[str]:
        folder = self._path(ASSETS_DIR)
        try:
            with self._remote(f"listing {ASSETS_DIR}/"):
                self.fs.invalidate_cache(folder)
                paths = self.fs.find(folder, **self._kw())
        except FileNotFoundError:
            return []
        names = [p[len(folder) + 1 :] for p in paths if p.startswith(folder + "/")]
        return sorted(n for n in names if not _basename(n).startswith(TMP_PREFIX))
