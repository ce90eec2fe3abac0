"""Versioned delta store over fsspec: atomic publish, listing, chains, retention (docs/FORMAT.md).

Layout under the store root:

    versions/<version:010d>.json                         commit record of one version (VersionRecord)
    data/<version:010d>.<kind>.<token>.safetensors       the version file (format.py)
    assets/<name>                                        config.json, tokenizer files, ...

A version is visible iff its record is, and the record is written only after its data file is
complete. Data file names carry a random token, so a stale or crashed writer never overwrites
committed data; whatever a crashed publish leaves behind is invisible and `retain` removes it later.
"""

from __future__ import annotations

import builtins  # VersionRecord has a field named `bytes`
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
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from datetime import datetime

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import FormatError, IntegrityError, MissingBaseError, VersionExistsError, VersionNotFoundError
from .format import KINDS, VersionFile, VersionHeader

log = logging.getLogger(__name__)

RECORD_FORMAT = "vllm-delta-record"
RECORD_FORMAT_VERSION = 1
VERSIONS_DIR = "versions"
DATA_DIR = "data"
ASSETS_DIR = "assets"
TMP_PREFIX = ".tmp-"  # never a committed name: readers skip it, retain removes old ones
LEFTOVER_AGE_S = 3600.0  # a publish older than this is dead, not slow
MAX_VERSION = 10**10 - 1  # ten digits keep names sorted as numbers

# Files moved in from mkstemp are 0600; committed files get the mode a plain create would give them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK

_RECORD_NAME = re.compile(r"^(\d{10})\.json$")
_DATA_NAME = re.compile(r"^(\d{10})\.(anchor|delta)\.([0-9a-f]{16})\.safetensors$")


def record_name(version: int) -> str:
    return f"{version:010d}.json"


def data_name(version: int, kind: str, token: str) -> str:
    return f"{version:010d}.{kind}.{token}.safetensors"


@dataclass(frozen=True)
class VersionRecord:
    """The commit record of one version, stored as JSON at versions/<version:010d>.json."""

    version: int
    kind: str  # "anchor" | "delta"
    base: int | None
    codec: str | None
    file: str  # data file path relative to the store root
    bytes: int  # size of the data file
    nnz: int  # changed elements (numel for anchors)
    numel: int
    checksum: str  # whole-model checksum at this version
    base_checksum: str | None
    created: float

    @property
    def density(self) -> float:
        return self.nnz / self.numel if self.numel else 0.0

    def to_json(self) -> str:
        doc = {"format": RECORD_FORMAT, "format_version": RECORD_FORMAT_VERSION, **asdict(self)}
        return json.dumps(doc, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | builtins.bytes, *, where: str = "record") -> VersionRecord:
        try:
            doc = json.loads(text)
            if doc.get("format") != RECORD_FORMAT or doc.get("format_version") != RECORD_FORMAT_VERSION:
                raise ValueError(f"not a {RECORD_FORMAT} v{RECORD_FORMAT_VERSION} document")
            # Unknown keys are ignored so that a later minor addition doesn't hide versions.
            rec = cls(**{f.name: doc[f.name] for f in fields(cls)})
            rec._validate()
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise FormatError(f"unreadable commit record {where}: {exc}") from None
        return rec

    def _validate(self) -> None:
        ints = (self.version, self.bytes, self.nnz, self.numel)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints):
            raise ValueError("version, bytes, nnz and numel must be non-negative integers")
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.kind == "delta" and not (isinstance(self.base, int) and 0 <= self.base < self.version):
            raise ValueError(f"a delta needs a base below its version, got {self.base!r}")
        folder, _, name = self.file.partition("/")
        m = _DATA_NAME.match(name)
        if folder != DATA_DIR or not m or int(m.group(1)) != self.version or m.group(2) != self.kind:
            raise ValueError(f"data file {self.file!r} does not belong to {self.kind} {self.version}")
        if not isinstance(self.checksum, str) or not isinstance(self.created, (int, float)):
            raise ValueError("bad checksum or created time")


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


class DeltaStore:
    """Versions of one model in a directory, S3 prefix or Hugging Face bucket (any fsspec URI)."""

    def __init__(self, uri: str, storage_options: dict | None = None, cache_dir: str | None = None):
        self.uri = _normalize(uri)
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **self.storage_options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = self.root.rstrip("/") or self.root
        self._cache_dir = cache_dir
        self._own_cache = False
        self._records: dict[int, VersionRecord] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeltaStore({self.uri!r})"

    # -- paths -------------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _record_path(self, version: int) -> str:
        return self._path(VERSIONS_DIR, record_name(version))

    def _ls(self, folder: str) -> list[dict]:
        """Files directly in `folder`, listed afresh (fsspec caches listings of remote stores)."""
        path = self._path(folder)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return [e for e in entries if e.get("type") == "file"]

    def _exists(self, path: str) -> bool:
        if self.is_local:
            return os.path.exists(path)
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("%s: %s", self.uri, message)

    # -- reading -----------------------------------------------------------------------------
    def _load_record(self, version: int) -> VersionRecord | None:
        """The parsed record, from the cache or the store; None if absent or unreadable."""
        cached = self._records.get(version)
        if cached is not None:
            return cached
        path = self._record_path(version)
        if not self.is_local:
            # s3fs's cat_file asks _info, which answers from a cached listing of versions/ when there is
            # one: a record committed by another process after that listing would look absent forever.
            self.fs.invalidate_cache(path)
        try:
            text = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            rec = VersionRecord.from_json(text, where=path)
            if rec.version != version:
                raise FormatError(f"record {path} describes version {rec.version}")
        except FormatError as exc:
            # Not fatal: a foreign or damaged record must not hide the other versions.
            self._warn_once(path, f"ignoring {exc}")
            return None
        with self._lock:
            self._records[version] = rec
        return rec

    def versions(self) -> list[int]:
        """Committed versions, ascending (a fresh listing each call)."""
        found = []
        for entry in self._ls(VERSIONS_DIR):
            name = _basename(entry["name"])
            m = _RECORD_NAME.match(name)
            if not m:
                if not name.startswith(TMP_PREFIX):
                    self._warn_once(name, f"ignoring {VERSIONS_DIR}/{name}: not a record name")
                continue
            if self._load_record(int(m.group(1))) is not None:
                found.append(int(m.group(1)))
        with self._lock:  # forget records that retention removed meanwhile
            for gone in set(self._records) - set(found):
                del self._records[gone]
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def resolve(self, version: int | str) -> int:
        """A committed version number from an int, a decimal string or "latest"."""
        if version == "latest":
            latest = self.latest()
            if latest is None:
                raise VersionNotFoundError(f"store {self.uri} holds no version yet")
            return latest
        if isinstance(version, str) and version.isdigit():
            version = int(version)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"a version is a non-negative integer or 'latest', not {version!r}")
        if version not in self.versions():
            raise VersionNotFoundError(f"no version {version} in store {self.uri}", version=version)
        return version

    def record(self, version: int) -> VersionRecord:
        rec = self._load_record(version) if isinstance(version, int) and version >= 0 else None
        if rec is None:
            raise VersionNotFoundError(f"no version {version} in store {self.uri}", version=version)
        return rec

    def records(self) -> list[VersionRecord]:
        return [rec for v in self.versions() if (rec := self._load_record(v)) is not None]

    def chain(self, version: int) -> list[VersionRecord]:
        """Records to replay to build `version`: its anchor first, `version` last."""
        chain = [self.record(version)]
        while chain[-1].kind == "delta":  # bases strictly decrease, so this ends
            child = chain[-1]
            assert child.base is not None  # validated: a delta has a base
            base = self._load_record(child.base)
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
            chain.append(base)
        return chain[::-1]

    def plan(self, held: int | None, target: int) -> list[VersionRecord]:
        """What a reader holding `held` applies, in order, to reach `target`."""
        if held is not None and held == target:
            self.record(target)  # an unknown target is an error even for a no-op
            return []
        chain = self.chain(target)
        if held is not None and held < target:
            for i, rec in enumerate(chain):
                if rec.version == held:
                    return chain[i + 1 :]
        return chain

    def local_path(self, version: int) -> str:
        """A local file holding the version's data: the file itself, or a checked download."""
        rec = self.record(version)
        if self.is_local:
            path = self._path(rec.file)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise self._missing_data(rec) from None
            self._check_size(rec, size)
            return path
        folder = self._download_dir()
        final = os.path.join(folder, _basename(rec.file))
        if os.path.exists(final) and os.path.getsize(final) == rec.bytes:
            return final
        # A unique temp name, then a rename: concurrent readers never see a partial download.
        tmp = os.path.join(folder, f"{TMP_PREFIX}{secrets.token_hex(8)}-{_basename(rec.file)}")
        try:
            self.fs.invalidate_cache(self._path(rec.file))  # as in _load_record: never a stale listing
            self.fs.get_file(self._path(rec.file), tmp)
            self._check_size(rec, os.path.getsize(tmp))
            os.replace(tmp, final)
        except FileNotFoundError:
            raise self._missing_data(rec) from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return final

    def open(self, version: int) -> VersionFile:
        vf = VersionFile(self.local_path(version), expect_version=version)
        rec = self.record(version)
        if vf.header.checksum != rec.checksum or vf.header.kind != rec.kind:
            raise IntegrityError(
                f"data file {rec.file} holds {vf.header.kind} with checksum {vf.header.checksum}, "
                f"its record says {rec.kind} with {rec.checksum}",
                version=version,
            )
        return vf

    def _check_size(self, rec: VersionRecord, size: int) -> None:
        if size != rec.bytes:
            raise IntegrityError(
                f"data file {rec.file} holds {size} bytes, its record says {rec.bytes} (truncated or replaced)",
                version=rec.version,
            )

    def _missing_data(self, rec: VersionRecord) -> Exception:
        if not self._exists(self._record_path(rec.version)):
            with self._lock:
                self._records.pop(rec.version, None)
            return VersionNotFoundError(f"version {rec.version} was removed from store {self.uri}", version=rec.version)
        return IntegrityError(f"record names data file {rec.file}, which is missing", version=rec.version)

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
        os.makedirs(folder, exist_ok=True)
        return folder

    # -- writing -----------------------------------------------------------------------------
    def publish(self, header: VersionHeader, local_path: str, *, move: bool = False) -> VersionRecord:
        """Commit a version file atomically. `move=True` hands the file over (renamed or deleted)."""
        header.validate()
        v = header.version
        if v > MAX_VERSION:
            raise ValueError(f"version {v} exceeds {MAX_VERSION}")
        with VersionFile(local_path, expect_version=v) as vf:
            stored = vf.header
        if (stored.kind, stored.base, stored.checksum, stored.base_checksum) != (
            header.kind,
            header.base,
            header.checksum,
            header.base_checksum,
        ):
            raise IntegrityError(f"{local_path} does not hold the version its header describes", version=v)
        if self._exists(self._record_path(v)):
            raise VersionExistsError(f"version {v} already exists in store {self.uri}", version=v)
        token = secrets.token_hex(8)
        rec = VersionRecord(
            version=v,
            kind=header.kind,
            base=header.base,
            codec=header.codec,
            file=f"{DATA_DIR}/{data_name(v, header.kind, token)}",
            bytes=os.path.getsize(local_path),
            nnz=header.nnz,
            numel=header.numel,
            checksum=header.checksum,
            base_checksum=header.base_checksum,
            created=header.created or time.time(),
        )
        if self.is_local:
            self._publish_local(rec, local_path, move, token)
        else:
            self._publish_remote(rec, local_path, move)
        with self._lock:
            self._records[v] = rec
        return rec

    def _publish_local(self, rec: VersionRecord, src: str, move: bool, token: str) -> None:
        data_dir, versions_dir = self._path(DATA_DIR), self._path(VERSIONS_DIR)
        os.makedirs(data_dir, exist_ok=True)
        os.makedirs(versions_dir, exist_ok=True)
        data = self._path(rec.file)
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
        try:
            self._commit_local_record(rec, token)
        except VersionExistsError:
            os.remove(data)
            raise
        if move and not moved:
            os.remove(src)

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

    def _publish_remote(self, rec: VersionRecord, src: str, move: bool) -> None:
        # An S3 object (and a bucket file) becomes visible only when its upload completes.
        data = self._path(rec.file)
        self.fs.put_file(src, data)
        self.fs.invalidate_cache(data)
        size = self.fs.info(data)["size"]
        if size != rec.bytes:
            self.fs.rm_file(data)
            raise IntegrityError(f"store kept {size} of {rec.bytes} bytes of {rec.file}", version=rec.version)
        try:
            self._commit_remote_record(rec)
        except VersionExistsError:
            self.fs.rm_file(data)
            raise
        if move:
            os.remove(src)

    def _commit_remote_record(self, rec: VersionRecord) -> None:
        # Object stores have no no-clobber rename here: check, then one small PUT. Two publishers of
        # one version can still race inside this window; the design has one publisher per store.
        if self._exists(self._record_path(rec.version)):
            raise VersionExistsError(f"version {rec.version} already exists in store {self.uri}", version=rec.version)
        self.fs.pipe_file(self._record_path(rec.version), rec.to_json().encode())

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
        for path in (self._record_path(rec.version), self._path(rec.file)):
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            if path.endswith(".json"):
                with self._lock:
                    self._records.pop(rec.version, None)
        self.prune_cache(keep=(), versions=[rec.version])

    def _remove_leftovers(self) -> None:
        named = {_basename(r.file) for r in self.records()}
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
                    try:
                        self.fs.rm_file(entry["name"])
                    except FileNotFoundError:
                        pass

    def prune_cache(self, keep: Iterable[int] = (), versions: Iterable[int] | None = None) -> list[str]:
        """Delete downloaded copies (remote stores) of `versions` (default: all) except `keep`."""
        if self.is_local or self._cache_dir is None:
            return []
        folder = self._download_dir()
        keep, only = set(keep), None if versions is None else set(versions)
        removed = []
        for name in os.listdir(folder):
            m = _DATA_NAME.match(name)
            if m and int(m.group(1)) not in keep and (only is None or int(m.group(1)) in only):
                os.remove(os.path.join(folder, name))
                removed.append(name)
        return removed

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
            self.fs.pipe_file(path, bytes(data))  # an object store PUT is atomic
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
        if not self.is_local:
            self.fs.invalidate_cache(path)
        return bytes(self.fs.cat_file(path))

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
        try:
            self.fs.rm_file(self._object_path(folder, name))
        except FileNotFoundError:
            pass

    def _object_path(self, folder: str, name: str) -> str:
        if folder in (VERSIONS_DIR, DATA_DIR) or not folder.isidentifier():
            raise ValueError(f"bad object folder {folder!r}")
        if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith(TMP_PREFIX):
            raise ValueError(f"bad object name {name!r}")
        return self._path(folder, name)

    def assets(self) -> list[str]:
        folder = self._path(ASSETS_DIR)
        self.fs.invalidate_cache(folder)
        try:
            paths = self.fs.find(folder)
        except FileNotFoundError:
            return []
        names = [p[len(folder) + 1 :] for p in paths if p.startswith(folder + "/")]
        return sorted(n for n in names if not _basename(n).startswith(TMP_PREFIX))
