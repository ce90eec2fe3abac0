"""Versioned delta store over fsspec: listing, chains, opening versions, retention (docs/FORMAT.md).

Layout under the store root (names: `records.py`):

    versions/<version:010d>.json                                  commit record of one version (VersionRecord)
    data/<version:010d>.<kind>.<token>.safetensors                the version file (format/), or
    data/<version:010d>.<kind>.<token>.part<index:05d>.safetensors  one part of a multi-part version
    assets/<name>                                                 config.json, tokenizer files, ...

A version is visible iff its record is, and the record is written only after all its data files are
complete (writes.py); whatever a crashed publish leaves behind is invisible and `retain` removes it.
Reading (docs/FORMAT.md, "Reading"): a reader's view is never older than one call. Listings and reads of
records and assets bypass fsspec's listing caches; decisions that depend on a record re-read it
(`fresh=True`); `latest()` never lists every version between full listings (`polling.py`).

`DeltaStore` owns one of each collaborator and callers use them where they live: `io` (fs.py: filesystem
access, deadlines, errors), `record_reader` (record_reader.py: parsed records, listings, the head),
`writer` (writes.py: the commit protocol: `commit_file`, `put_part`, `commit_parts`, `adopt`,
`discard_parts`), `cache` (cache.py: the verified download cache and its `prune`), `files` (files.py:
a version's data files on this host, opened as one version), `objects` (objects.py: assets and small
objects), `mark_folder` (mark_folder.py: bad-version marks). What stays here needs several of them:
records and chains, opening a version by number, marks, and retention.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from ..errors import IntegrityError, MissingBaseError, VersionNotFoundError
from ..format import VersionLike
from . import replicas
from .cache import DownloadCache, cache_entries
from .files import VersionFiles
from .fs import DEFAULT_TIMEOUT_S, StoreFS, basename, modified, normalize_uri
from .mark_folder import MarkFolder
from .marks import MARKS_DIR, BadMark, check_reason, reachable_prefix
from .objects import StoreObjects
from .record_reader import RecordReader
from .records import ASSETS_DIR, DATA_DIR, MAX_VERSION, VERSIONS_DIR, StoreHead, VersionRecord
from .retention import check_keep_anchors, doomed_versions, is_leftover
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
        # fixed once the store is open: its fsspec filesystem, its path there, whether that is this host's
        self.fs: Any = self.io.fs
        self.root: str = self.io.root
        self.is_local: bool = self.io.is_local
        self.cache = DownloadCache(self.uri, cache_dir)  # a local store's stays empty (its files are read in place)
        self.record_reader = RecordReader(self.io, capacity=RECORD_CACHE)
        self.writer = VersionWriter(self.io, self.record_reader)
        self.files = VersionFiles(self.io, self.record_reader, self.cache, check_digests=check_digests)
        self.objects = StoreObjects(self.io)
        self.mark_folder = MarkFolder(self.io)

    def __repr__(self) -> str:
        return f"DeltaStore({self.uri!r})"

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
        return self.record_reader.poller.latest()  # how it polls: polling.py (its `counts`: the cost)

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

    # -- a version's data files (files.py) -------------------------------------------------------
    def local_path(self, version: int, *, record: VersionRecord | None = None) -> str:
        """A local file holding a one-file version's data: the file itself, or a verified download (of
        the file `record` names, when given: the record a caller's decision was made on)."""
        rec = record if record is not None else self.record(version)
        if rec.file is None:
            raise ValueError(f"version {version} has {len(rec.parts)} parts: use local_paths() or open()")
        return self.files.local_file(rec, rec.data_files[0])

    def local_paths(self, version: int, *, record: VersionRecord | None = None) -> list[str]:
        """Local files holding the version's data (one, or one per part in part order), each verified."""
        return self.files.local_paths(record if record is not None else self.record(version))

    def open(self, version: int, *, record: VersionRecord | None = None, fresh: bool = False) -> VersionLike:
        """The version's data, checked against its record (`record`, or the store's, read afresh with
        `fresh`): a `VersionFile` (one file) or a `Version` (several parts)."""
        return self.files.open(record if record is not None else self.record(version, fresh=fresh))

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
        reports = replicas.read_reports(self.objects)
        replicas.expire_reports(self.objects, reports, now=now)
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
        self.cache.prune(keep=(), versions=[rec.version])

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
