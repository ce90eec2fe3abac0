"""Versioned delta store over fsspec: atomic publish, listing, chains, retention (docs/FORMAT.md).

Layout under the store root (names: `records.py`):

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
listing at least every FULL_LISTING_S.

`DeltaStore` is what reads and writes a store; its parts that change for other reasons live beside
it: the record schema (`records.py`), the filesystem access with its deadlines and errors
(`storefs.py`), the verified download cache (`cache.py`), the retention policy (`retention.py`) and
the replica reports retention protects (`replicas.py`). Writing stays here: it is the other half of
the commit protocol whose reading is here (record last, never replaced), and the two change together.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import replicas
from .cache import DownloadCache, file_sha256
from .errors import (
    DeltaError,
    FormatError,
    IntegrityError,
    MissingBaseError,
    VersionExistsError,
    VersionNotFoundError,
)
from .format import Version, VersionFile, VersionHeader, VersionKind, VersionLike, is_kind
from .records import (
    ASSETS_DIR,
    DATA_DIR,
    MAX_PARTS,
    MAX_VERSION,
    RECORD_NAME_RE,
    TMP_PREFIX,
    VERSIONS_DIR,
    DataFile,
    PartRecord,
    VersionRecord,
    asset_parts,
    check_object_name,
    check_size,
    data_name,
    record_name,
)
from .retention import LEFTOVER_AGE_S, check_keep_anchors, doomed_versions, is_leftover
from .storefs import (
    DEFAULT_TIMEOUT_S,
    StoreFS,
    basename,
    fsync,
    modified,
    normalize_uri,
    store_error,
)

log = logging.getLogger(__name__)

FULL_LISTING_S = 60.0  # latest(): a full listing at least this often (retention, rewritten stores)
RECORD_CACHE = 64  # parsed records kept per store; least recently used go first

# Files moved in from mkstemp are 0600; committed files get the mode a plain create would give them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


class DeltaStore:
    """Versions of one model in a directory, S3 prefix or Hugging Face bucket (any fsspec URI).

    `timeout_s` bounds every remote operation (a download gets `timeout_s + bytes / 5 MB/s`);
    `cache_dir` is where remote version files are downloaded (default: a private temp dir)."""

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.uri = normalize_uri(uri)
        self.storage_options = dict(storage_options or {})
        self.timeout_s = float(timeout_s)
        self.io = StoreFS(self.uri, self.storage_options, self.timeout_s)
        self._cache = DownloadCache(self.uri, cache_dir)
        self._records: OrderedDict[int, VersionRecord] = OrderedDict()  # LRU of parsed records
        self._valid: set[int] = set()  # versions whose records parsed, as of the last listing
        self._newest_key: str | None = None  # record name of the newest version seen (incremental listing)
        self._full_at = -float("inf")  # time.monotonic() of the last full listing
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DeltaStore({self.uri!r})"

    @property
    def fs(self) -> Any:
        """The fsspec filesystem the store lives in."""
        return self.io.fs

    @property
    def root(self) -> str:
        """The store's path in `fs`."""
        return self.io.root

    @property
    def is_local(self) -> bool:
        return self.io.is_local

    # -- paths -------------------------------------------------------------------------------
    def _path(self, *parts: str) -> str:
        return self.io.path(*parts)

    def _record_path(self, version: int) -> str:
        return self._path(VERSIONS_DIR, record_name(version))

    def _ls(self, folder: str) -> list[dict[str, Any]]:
        """Files directly in `folder`, listed afresh (fsspec caches listings of remote stores)."""
        return self.io.ls(folder)

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
            text = self.io.cat(path, f"reading {VERSIONS_DIR}/{record_name(version)}")
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
            name = basename(entry["name"])
            m = RECORD_NAME_RE.match(name)
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
        if self.io.is_s3 and self._newest_key is not None and time.monotonic() - self._full_at < FULL_LISTING_S:
            for name in self.io.list_after(VERSIONS_DIR, self._newest_key):
                m = RECORD_NAME_RE.match(name)
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
        check_size(data, size, version=rec.version)
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

    def _missing_data(self, rec: VersionRecord, file: str) -> Exception:
        if not self.io.exists(self._record_path(rec.version)):
            self._forget(rec.version)
            return VersionNotFoundError(f"version {rec.version} was removed from store {self.uri}", version=rec.version)
        return IntegrityError(f"record names data file {file}, which is missing", version=rec.version)

    # -- the download cache (remote stores) -----------------------------------------------------
    def _cached(self, rec: VersionRecord, data: DataFile) -> str:
        """A verified copy of one of the record's files in the cache: the one there, or a fresh download."""

        def download(dest: str) -> None:
            try:
                self.io.download(self._path(data.file), dest, data.bytes, f"downloading {data.file}")
            except FileNotFoundError:
                raise self._missing_data(rec, data.file) from None

        return self._cache.copy(data, version=rec.version, download=download)

    def _download_dir(self) -> str:
        return self._cache.folder()

    def cache_bytes(self) -> int:
        """Bytes this store's download cache holds (0 for local stores)."""
        return 0 if self.is_local else self._cache.total_bytes()

    def prune_cache(
        self,
        keep: Iterable[int] = (),
        versions: Iterable[int] | None = None,
        *,
        max_bytes: int | None = None,
        protect: Iterable[int] = (),
    ) -> list[str]:
        """Prune the download cache of a remote store (`cache.DownloadCache.prune`: copies of `versions`
        but `keep`, dead temp files, then the oldest beyond `max_bytes` but `protect`); returns the
        deleted names. A local store has no cache: nothing to do."""
        if self.is_local:
            return []
        return self._cache.prune(keep, versions, max_bytes=max_bytes, protect=protect)

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
        if self.io.exists(self._record_path(v)):
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
        kind: VersionKind,  # checked again here: it may come from another rank
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
        if not is_kind(kind):
            raise FormatError(f"bad multi-part record: unknown kind {kind!r}", version=version)
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
            rec.validate()
        except (ValueError, TypeError) as exc:
            raise FormatError(f"bad multi-part record: {exc}", version=version) from None
        if version > MAX_VERSION:
            raise ValueError(f"version {version} exceeds {MAX_VERSION}")
        if self.io.exists(self._record_path(version)):
            raise VersionExistsError(f"version {version} already exists in store {self.uri}", version=version)
        self._check_parts_stored(parts, version)
        if self.is_local:
            fsync(self._path(DATA_DIR), directory=True)
            os.makedirs(self._path(VERSIONS_DIR), exist_ok=True)
        self._commit_record(rec, secrets.token_hex(8))
        self._remember(rec)
        return rec

    def _check_parts_stored(self, parts: Iterable[PartRecord], version: int) -> None:
        """Every part is in the store with its recorded size (one stat each), or IntegrityError."""
        for part in parts:
            try:
                size = self.io.size(self._path(part.file), f"checking {part.file}")
            except FileNotFoundError:
                raise IntegrityError(f"part {part.file} is not in the store", version=version) from None
            if size != part.bytes:
                raise IntegrityError(f"part {part.file} holds {size} bytes, not {part.bytes}", version=version)

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
            size = self.io.upload(src, data, nbytes, f"uploading {file}")
            if size != nbytes:
                self.io.remove(data, f"removing {file}")
                raise IntegrityError(f"store kept {size} of {nbytes} bytes of {file}", version=version)
            return False
        os.makedirs(self._path(VERSIONS_DIR), exist_ok=True)
        tmp_name = f"{TMP_PREFIX}{token}.safetensors"
        return self.io.place(src, data, move=move, tmp_name=tmp_name, mode=_FILE_MODE)

    def _remove_data(self, files: Iterable[str]) -> None:
        for file in files:
            self.io.remove(self._path(file), f"removing {file}")

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
        fsync(versions_dir, directory=True)

    def _commit_remote_record(self, rec: VersionRecord) -> None:
        # Object stores have no no-clobber rename here: check, then one small PUT. Two publishers of
        # one version can still race inside this window; the design has one publisher per store.
        if self.io.exists(self._record_path(rec.version)):
            raise VersionExistsError(f"version {rec.version} already exists in store {self.uri}", version=rec.version)
        with self.io.guard(f"writing {VERSIONS_DIR}/{record_name(rec.version)}"):
            self.fs.pipe_file(self._record_path(rec.version), rec.to_json().encode(), **self.io.deadline())

    # -- retention ---------------------------------------------------------------------------
    def retain(self, keep_anchors: int, *, protect: Iterable[int] = ()) -> list[int]:
        """Keep the newest `keep_anchors` anchors and everything from the oldest of them on, plus the
        versions in `protect` and every version a live replica reports serving (`replicas.py`; expired
        reports are deleted first), each with its chain (`retention.doomed_versions`).

        Returns the deleted versions. Versions are deleted newest first, record before data, so
        that every visible record keeps its data and its whole chain at every moment. Leftovers of
        crashed publishes older than LEFTOVER_AGE_S are removed too.
        """
        check_keep_anchors(keep_anchors)
        now = time.time()
        reports = replicas.read_reports(self)
        replicas.expire_reports(self, reports, now=now)
        protected = set(protect) | replicas.live_versions(reports, now=now)
        recs = {r.version: r for r in self.records()}
        deleted = doomed_versions(recs.values(), keep_anchors, protected=protected)
        for v in deleted:
            self._delete(recs[v])
        self._remove_leftovers()
        return sorted(deleted)

    def _delete(self, rec: VersionRecord) -> None:
        for path in (self._record_path(rec.version), *(self._path(f) for f in rec.files)):
            self.io.remove(path, f"deleting {path}")
            if path.endswith(".json"):
                self._forget(rec.version)
        self.prune_cache(keep=(), versions=[rec.version])

    def _remove_leftovers(self) -> None:
        named = {basename(f) for r in self.records() for f in r.files}
        now = time.time()
        for folder in (DATA_DIR, VERSIONS_DIR, ASSETS_DIR):
            for entry in self._ls(folder):
                name = basename(entry["name"])
                if is_leftover(folder, name, modified(entry), named=named, now=now):
                    log.info("%s: removing leftover %s/%s", self.uri, folder, name)
                    self.io.remove(entry["name"], f"deleting {folder}/{name}")

    # -- assets and other small mutable objects (the replica ledger) ------------------------------
    def put_asset(self, name: str, data: bytes) -> None:
        """Store a small file (config.json, tokenizer files) atomically, replacing an older one."""
        self.io.write_small(self._path(ASSETS_DIR, *asset_parts(name)), data)

    def get_asset(self, name: str) -> bytes:
        path = self._path(ASSETS_DIR, *asset_parts(name))
        try:
            return self.io.cat(path, f"reading {path}")
        except FileNotFoundError:
            raise FileNotFoundError(f"no asset {name!r} in store {self.uri}") from None

    def assets(self) -> list[str]:
        names = self.io.find(ASSETS_DIR)
        return sorted(n for n in names if not basename(n).startswith(TMP_PREFIX))

    def write_object(self, folder: str, name: str, data: bytes) -> None:
        """A small mutable object at `<folder>/<name>` under the store root (e.g. `replicas/<id>.json`),
        written atomically (readers see the old or the new one, whole)."""
        self.io.write_small(self._object_path(folder, name), data)

    def read_object(self, folder: str, name: str) -> bytes:
        """An object as it is now (listing caches bypassed: it may have changed or just appeared)."""
        path = self._object_path(folder, name)
        return self.io.cat(path, f"reading {path}")

    def list_objects(self, folder: str) -> list[str]:
        """Names of the committed objects directly in `folder` (temporary files skipped), listed afresh."""
        check_object_name(folder, "x")
        names = (basename(e["name"]) for e in self._ls(folder))
        return sorted(n for n in names if not n.startswith(TMP_PREFIX))

    def delete_object(self, folder: str, name: str) -> None:
        self.io.remove(self._object_path(folder, name), f"deleting {folder}/{name}")

    def _object_path(self, folder: str, name: str) -> str:
        check_object_name(folder, name)
        return self._path(folder, name)


__all__ = [
    "LEFTOVER_AGE_S",
    "TMP_PREFIX",
    "DeltaStore",
    "PartRecord",
    "VersionRecord",
    "store_error",
]
