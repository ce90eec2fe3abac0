"""A version's data files on this host, checked against its record, and opening them as one version.

A local store's files are read where they are (checked by size, and by sha256 where the store checks
digests: a signed store); a remote store's through the verified download cache (cache.py), downloaded
once and verified. `open` gives a `format.VersionFile` (one file) or a `format.Version` (the parts),
checked against the record (each part's index and checksum, the version's kind and checksum). The
store (`DeltaStore.open`, `local_paths`) looks the record up; this module needs only the record.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

from .. import gc_pause
from ..errors import CacheError, IntegrityError, VersionNotFoundError
from ..format import Version, VersionFile, VersionLike
from .cache import DownloadCache
from .fs import StoreFS
from .record_reader import RecordReader
from .records import DataFile, VersionRecord, check_size

log = logging.getLogger("vllm_delta.store")


class VersionFiles:
    """Local, verified copies of versions' data files, and versions opened from them."""

    def __init__(self, io: StoreFS, records: RecordReader, cache: DownloadCache, *, check_digests: bool = False):
        self.io = io
        self.records = records
        self.cache = cache
        self.check_digests = check_digests

    def missing(self, rec: VersionRecord, file: str) -> Exception:
        """What a data file the record names and the store lacks means: the version was removed (its
        record is gone too: forgotten here), or the store is damaged."""
        v = rec.version
        if not self.io.exists(self.records.record_path(v)):
            self.records.forget(v)
            return VersionNotFoundError(f"version {v} was removed from store {self.io.uri}", version=v)
        return IntegrityError(f"record names data file {file}, which is missing", version=v)

    def local_paths(self, rec: VersionRecord) -> list[str]:
        """Local files holding the version's data (one, or one per part in part order), each verified.
        A remote store's parts download side by side (one thread each, at most 16): a version of W
        parts takes about as long as its largest part, not W of them."""
        files = rec.data_files
        if self.io.is_local or len(files) == 1:
            return [self.local_file(rec, d) for d in files]
        with ThreadPoolExecutor(min(16, len(files)), thread_name_prefix="vllm-delta-parts") as pool:
            return list(pool.map(lambda d: self.local_file(rec, d), files))

    def local_file(self, rec: VersionRecord, data: DataFile) -> str:
        """One of the record's files on this host: the store's own (local), or a verified copy."""
        if not self.io.is_local:
            return self._cached(rec, data)
        path = self.io.path(data.file)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise self.missing(rec, data.file) from None
        check_size(data, size, version=rec.version)
        if self.check_digests and data.sha256 is not None and not self.cache.holds(path, data):
            raise IntegrityError(
                f"data file {data.file} does not have the sha256 its record says (damaged or replaced)",
                version=rec.version,
            )
        return path

    def _cached(self, rec: VersionRecord, data: DataFile) -> str:
        """A verified copy of one of the record's files in the cache: the one there, or a fresh download."""

        def download(dest: str) -> None:
            try:
                self.io.download(self.io.path(data.file), dest, data.bytes, f"downloading {data.file}")
            except FileNotFoundError:
                raise self.missing(rec, data.file) from None

        return self.cache.copy(data, version=rec.version, download=download)

    def open(self, rec: VersionRecord) -> VersionLike:
        """The version's data, checked against its record: a `VersionFile` (one file) or a `Version`
        (several parts); both give `header`, `pieces(name)` and `dense(name)`."""
        version = rec.version
        for attempt in range(2):
            paths = self.local_paths(rec)
            try:
                with gc_pause.paused():  # one pause over every part's header and the merge (gc_pause.py)
                    return _open_checked(rec, paths)
            except FileNotFoundError as exc:
                # Gone between its check and its open: a local store's version was deleted (retention),
                # or a cached copy was pruned by another process sharing the cache folder. A copy is
                # fetched again once; an open file is never affected (VersionFile holds it).
                missing = os.path.basename(exc.filename or "")
                file = next((d.file for d in rec.data_files if os.path.basename(d.file) == missing), missing)
                if self.io.is_local:
                    raise self.missing(rec, file) from None
                if attempt:
                    raise CacheError(
                        f"the cached copy of {file} vanished twice before it could be opened: another process "
                        f"keeps pruning the download cache {self.cache.folder()}",
                        version=version,
                    ) from None
                log.warning(
                    "%s: the cached copy of %s vanished before it was opened: fetching it again", self.io.uri, file
                )
        raise AssertionError("unreachable")  # pragma: no cover


def _open_checked(rec: VersionRecord, paths: list[str]) -> VersionLike:
    """The files at `paths` opened as the version `rec` records (IntegrityError if they are not it)."""
    version = rec.version
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


__all__ = ["VersionFiles"]
