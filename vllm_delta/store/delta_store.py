"""Versioned delta store over fsspec: atomic publish, listing, chains, retention (docs/FORMAT.md).

Layout under the store root (names: `records.py`):

    versions/<version:010d>.json                                  commit record of one version (VersionRecord)
    data/<version:010d>.<kind>.<token>.safetensors                the version file (format/), or
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
it (`fresh=True`); `latest()` never lists every version between full listings (`polling.py`: S3's
StartAfter, elsewhere `head.json`, which every commit rewrites).

`DeltaStore` is what reads and writes a store: the API every caller uses, over collaborators it owns,
each the home of one concern: `io` (fs.py: filesystem access with its deadlines and errors),
`record_reader` (record_reader.py: parsed records, listings, the head, how `latest()` polls),
`writer` (writes.py: the writing half of the commit protocol, data files first, the record last,
never replaced; `publish`, `put_part`, `commit_parts`, `adopt` and `discard_parts` forward to it),
`mark_folder` (mark_folder.py: bad-version marks) and the verified download cache (cache.py).
Schemas and policies without I/O live beside them: records.py, marks.py, replicas.py, retention.py.
What stays here is what needs several of them: chains and plans, opening a version's files, and
retention.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import gc_pause
from ..errors import CacheError, IntegrityError, MissingBaseError, VersionNotFoundError
from ..format import Version, VersionFile, VersionHeader, VersionKind, VersionLike
from . import replicas
from .cache import DownloadCache, cache_entries
from .fs import (
    DEFAULT_TIMEOUT_S,
    StoreFS,
    basename,
    modified,
    normalize_uri,
    store_error,
)
from .mark_folder import MarkFolder
from .marks import MARKS_DIR, BadMark, check_reason, reachable_prefix
from .polling import FULL_LISTING_S, LatestPoller
from .record_reader import RecordReader
from .records import (
    ASSETS_DIR,
    DATA_DIR,
    MAX_VERSION,
    TMP_PREFIX,
    VERSIONS_DIR,
    DataFile,
    PartRecord,
    StoreHead,
    VersionRecord,
    asset_parts,
    check_object_name,
    check_size,
)
from .retention import LEFTOVER_AGE_S, check_keep_anchors, doomed_versions, is_leftover
from .undo import UndoPath, undo_path
from .writes import VersionWriter

log = logging.getLogger(__name__)

RECORD_CACHE = cache_entries()  # parsed records kept per store; least recently used go first


class DeltaStore:
    """Versions of one model in a directory, S3 prefix or Hugging Face bucket (any fsspec URI).

    `timeout_s` bounds every remote operation (a download gets `timeout_s + bytes / 5 MB/s`);
    `cache_dir` is where remote version files are downloaded (default: a private temp dir);
    `check_digests`: a local store's own files are checked against their record's sha256 too (a server
    that takes signed versions only: the signature binds the digests, docs/SECURITY.md)."""

    def __init__(
        self,
        uri: str,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        check_digests: bool = False,
    ):
        self.uri = normalize_uri(uri)
        self.check_digests = check_digests
        self.storage_options = dict(storage_options or {})
        self.timeout_s = float(timeout_s)
        self.io = StoreFS(self.uri, self.storage_options, self.timeout_s)
        self._cache = DownloadCache(self.uri, cache_dir)
        self.record_reader = RecordReader(self.io, capacity=RECORD_CACHE)
        self.writer = VersionWriter(self.io, self.record_reader)
        self.mark_folder = MarkFolder(self.io)

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

    @property
    def poller(self) -> LatestPoller:
        """How `latest()` polls (polling.py; its `counts` say what the polls cost)."""
        return self.record_reader.poller

    def _path(self, *parts: str) -> str:
        return self.io.path(*parts)

    # -- versions and records (record_reader.py) -------------------------------------------------
    def versions(self) -> list[int]:
        """Committed versions, ascending (a fresh listing each call; a record is parsed once)."""
        return self.record_reader.list_versions()

    def latest(self) -> int | None:
        """The newest committed version, read afresh. Between full listings (at least every
        FULL_LISTING_S) a few small reads whatever the store's history (`polling.py`): on S3 the
        records after the newest one seen (StartAfter) and one GET confirming it; elsewhere
        `head.json`, the record it names and the next version's record."""
        return self.poller.latest()

    def latest_usable(self) -> int | None:
        """The newest version a reader may serve: the newest whose chain passes through no version marked
        bad (marks.py); below a marked anchor, the newest usable version before it. None: none is."""
        version = self.latest()
        marks = self.marks() if version is not None else {}
        while version is not None:
            chain = self.chain(version)
            usable = reachable_prefix(chain, marks)
            if usable:
                return usable[-1].version
            below = chain[0].version - 1  # the anchor itself is marked: look before it
            try:
                version = None if below < 0 else self.record(below).version
            except VersionNotFoundError:  # a gap (retention, a crashed publish): the newest one before it
                version = max((v for v in self.versions() if v <= below), default=None)
        return None

    def head(self) -> StoreHead | None:
        """`head.json` as the store has it now (None: no head, or an unreadable one, warned once)."""
        return self.record_reader.read_head()

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
        if version > MAX_VERSION or self.record_reader.load_record(version, fresh=True) is None:
            raise VersionNotFoundError(f"no version {version} in store {self.uri}", version=version)
        return version

    def record(self, version: int, *, fresh: bool = False) -> VersionRecord:
        """A version's commit record; `fresh` reads it from the store even if it was seen before (a
        store wiped and refilled by another run reuses version numbers)."""
        ok = isinstance(version, int) and not isinstance(version, bool) and 0 <= version <= MAX_VERSION
        rec = self.record_reader.load_record(version, fresh) if ok else None
        if rec is None:
            raise VersionNotFoundError(f"no version {version} in store {self.uri}", version=version)
        return rec

    def records(self) -> list[VersionRecord]:
        return [rec for v in self.versions() if (rec := self.record_reader.load_record(v)) is not None]

    def _base_of(self, child: VersionRecord, fresh: bool) -> VersionRecord:
        assert child.base is not None  # validated: a delta has a base
        base = self.record_reader.load_record(child.base, fresh)
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

    def undo_path(self, held: int, held_checksum: str | None, target: int, *, fresh: bool = True) -> UndoPath:
        """What a reader serving `held` (with `held_checksum`) undoes, newest first, to go back to the older
        `target` on its chain (undo.py); NotSuccessorError saying why there is no such path. Each data file
        it needs is looked up in the store (a remote store: one request each)."""

        def missing(rec: VersionRecord) -> str | None:
            return next((f for f in rec.files if not self.io.exists(self._path(f))), None)

        return undo_path(held, held_checksum, target, lambda v: self.record(v, fresh=fresh), missing)

    # -- writing (writes.py: the store's VersionWriter) -------------------------------------------
    def publish(self, header: VersionHeader, local_path: str, *, move: bool = False) -> VersionRecord:
        """Commit a one-file version atomically (`VersionWriter.publish`)."""
        return self.writer.publish(header, local_path, move=move)

    def put_part(self, header: VersionHeader, local_path: str, *, move: bool = False) -> PartRecord:
        """Upload one part of a multi-part version; nothing becomes visible (`VersionWriter.put_part`)."""
        return self.writer.put_part(header, local_path, move=move)

    def commit_parts(
        self,
        *,
        version: int,
        kind: VersionKind,
        base: int | None,
        codec: str | None,
        nnz: int,
        numel: int,
        checksum: str,
        base_checksum: str | None,
        parts: list[PartRecord],
        created: float = 0.0,
    ) -> VersionRecord:
        """Make a multi-part version visible: its record, last (`VersionWriter.commit_parts`)."""
        return self.writer.commit_parts(
            version=version,
            kind=kind,
            base=base,
            codec=codec,
            nnz=nnz,
            numel=numel,
            checksum=checksum,
            base_checksum=base_checksum,
            parts=parts,
            created=created,
        )

    def adopt(self, rec: VersionRecord, paths: list[str]) -> VersionRecord:
        """Commit a version copied from another store under its names (`VersionWriter.adopt`)."""
        return self.writer.adopt(rec, paths)

    def discard_parts(self, parts: Iterable[PartRecord]) -> None:
        """Remove uploaded parts of a version that is not committed, best effort (`VersionWriter.discard_parts`)."""
        self.writer.discard_parts(parts)

    # -- data files --------------------------------------------------------------------------
    def local_path(self, version: int, *, record: VersionRecord | None = None) -> str:
        """A local file holding a one-file version's data: the file itself, or a verified download (of
        the file `record` names, when given: the record a caller's decision was made on)."""
        rec = record if record is not None else self.record(version)
        if rec.file is None:
            raise ValueError(f"version {version} has {len(rec.parts)} parts: use local_paths() or open()")
        return self._local_file(rec, rec.data_files[0])

    def local_paths(self, version: int, *, record: VersionRecord | None = None) -> list[str]:
        """Local files holding the version's data (one, or one per part in part order), each verified.
        A remote store's parts download side by side (one thread each, at most 16): a version of W
        parts takes about as long as its largest part, not W of them."""
        rec = record if record is not None else self.record(version)
        files = rec.data_files
        if self.is_local or len(files) == 1:
            return [self._local_file(rec, d) for d in files]
        with ThreadPoolExecutor(min(16, len(files)), thread_name_prefix="vllm-delta-parts") as pool:
            return list(pool.map(lambda d: self._local_file(rec, d), files))

    def _local_file(self, rec: VersionRecord, data: DataFile) -> str:
        if not self.is_local:
            return self._cached(rec, data)
        path = self._path(data.file)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise self._missing_data(rec, data.file) from None
        check_size(data, size, version=rec.version)
        if self.check_digests and data.sha256 is not None and not self._cache.holds(path, data):
            raise IntegrityError(
                f"data file {data.file} does not have the sha256 its record says (damaged or replaced)",
                version=rec.version,
            )
        return path

    def open(self, version: int, *, record: VersionRecord | None = None, fresh: bool = False) -> VersionLike:
        """The version's data, checked against its record: a `VersionFile` (one file) or a `Version`
        (several parts); both give `header`, `pieces(name)` and `dense(name)`."""
        rec = record if record is not None else self.record(version, fresh=fresh)
        for attempt in range(2):
            paths = self.local_paths(version, record=rec)
            try:
                with gc_pause.paused():  # one pause over every part's header and the merge (gc_pause.py)
                    return self._open_files(version, rec, paths)
            except FileNotFoundError as exc:
                # Gone between its check and its open: a local store's version was deleted (retention),
                # or a cached copy was pruned by another process sharing the cache folder. A copy is
                # fetched again once; an open file is never affected (VersionFile holds it).
                missing = os.path.basename(exc.filename or "")
                file = next((d.file for d in rec.data_files if os.path.basename(d.file) == missing), missing)
                if self.is_local:
                    raise self._missing_data(rec, file) from None
                if attempt:
                    raise CacheError(
                        f"the cached copy of {file} vanished twice before it could be opened: another process "
                        f"keeps pruning the download cache {self._cache.folder()}",
                        version=version,
                    ) from None
                log.warning(
                    "%s: the cached copy of %s vanished before it was opened: fetching it again", self.uri, file
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _open_files(self, version: int, rec: VersionRecord, paths: list[str]) -> VersionLike:
        vf: VersionLike
        if rec.file is not None:
            vf = VersionFile(paths[0], expect_version=version)
        else:
            files: list[VersionFile] = []
            try:
                for path in paths:
                    files.append(VersionFile(path, expect_version=version))
            except BaseException:
                for g in files:
                    g.close()
                raise
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
        if not self.io.exists(self.record_reader.record_path(rec.version)):
            self.record_reader.forget(rec.version)
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
        newer_than: int | None = None,
    ) -> list[str]:
        """Prune the download cache of a remote store (`cache.DownloadCache.prune`: copies of `versions`
        but `keep` and those above `newer_than`, dead temp files, then the oldest beyond `max_bytes` but
        `protect`); returns the deleted names. A local store has no cache: nothing to do."""
        if self.is_local:
            return []
        return self._cache.prune(keep, versions, max_bytes=max_bytes, protect=protect, newer_than=newer_than)

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
        marked = self.marks()
        for v in deleted:
            self._delete(recs[v])
            if v in marked:  # never before its version is gone: a mark must not vanish while it matters
                log.info("%s: removing the bad-version mark of deleted version %d", self.uri, v)
                self.mark_folder.delete(v)
        self._remove_leftovers()
        return sorted(deleted)

    def _delete(self, rec: VersionRecord) -> None:
        for path in (self.record_reader.record_path(rec.version), *(self._path(f) for f in rec.files)):
            self.io.remove(path, f"deleting {path}")
            if path.endswith(".json"):
                self.record_reader.forget(rec.version)
        self.prune_cache(keep=(), versions=[rec.version])

    def _remove_leftovers(self) -> None:
        named = {basename(f) for r in self.records() for f in r.files}
        now = time.time()
        for folder in (DATA_DIR, VERSIONS_DIR, ASSETS_DIR, MARKS_DIR):
            for entry in self.io.ls(folder):
                name = basename(entry["name"])
                if is_leftover(folder, name, modified(entry), named=named, now=now):
                    log.info("%s: removing leftover %s/%s", self.uri, folder, name)
                    self.io.remove(entry["name"], f"deleting {folder}/{name}")

    # -- bad-version marks (marks.py, mark_folder.py) -----------------------------------------------
    def mark_bad(self, version: int, reason: str, *, by: str | None = None) -> BadMark:
        """Mark a committed version bad (`bad/<version>.json`): followers never apply it, nor any version
        whose chain passes through it, and the staleness gate stops waiting for replicas to reach them.

        Written once: a version already marked keeps its first mark (returned as is). Raises
        VersionNotFoundError for a version the store does not hold (now), StoreAccessError when the
        store cannot be written; either way nothing is written."""
        check_reason(reason)
        if by is not None and not isinstance(by, str):
            raise ValueError(f"by must be a string, not {by!r:.60}")
        return self.mark_folder.mark(self.record(version, fresh=True), reason, by)

    def marks(self) -> dict[int, BadMark]:
        """Every readable mark, by version: one listing of `bad/` (its size is the number of marks, not
        of versions) and a read of each mark not seen before. Garbage is skipped with a warning."""
        return self.mark_folder.read_all()

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
        names = (basename(e["name"]) for e in self.io.ls(folder))
        return sorted(n for n in names if not n.startswith(TMP_PREFIX))

    def delete_object(self, folder: str, name: str) -> None:
        self.io.remove(self._object_path(folder, name), f"deleting {folder}/{name}")

    def _object_path(self, folder: str, name: str) -> str:
        check_object_name(folder, name)
        return self._path(folder, name)


__all__ = [
    "FULL_LISTING_S",
    "LEFTOVER_AGE_S",
    "TMP_PREFIX",
    "DeltaStore",
    "PartRecord",
    "VersionRecord",
    "store_error",
]
