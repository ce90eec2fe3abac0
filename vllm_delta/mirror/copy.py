"""Copying from the source store to the destination: one version (verified, record last), the
bad-version marks, and the assets.

A version's files are downloaded once from the source and verified before anything is written to
the destination: against the record's sha256 (every part of a multi-part version; remote stores'
records have them), and always the headers against the record (kind, checksum, each part's index
and checksum). A record without sha256 (a local source store) gets its payload checked on its own
instead (`reconstruct.verify_payload`: an anchor's tensor checksums, a delta's frames decoded). The
destination then adopts the version under the same names (`DeltaStore.adopt`): files first, the
record last, so nothing of a version is visible there before all of it is, whatever kills the copy.
A download that fails verification is fetched once more (a fault on the way); failing again, the
file in the source is corrupt: the version is never copied, and the caller marks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import IntegrityError
from ..reconstruct import verify_payload
from ..store import DeltaStore
from ..store.marks import MARKS_DIR, BadMark, Marks, mark_name
from ..store.records import VersionRecord

log = logging.getLogger(__name__)

FETCH_ATTEMPTS = 2  # a verification failure may be the network's: one more download decides


@dataclass(frozen=True)
class Copied:
    record: VersionRecord  # as the destination committed it (with every file's sha256)


@dataclass(frozen=True)
class Corrupt:
    version: int
    reason: str


CopyOutcome = Copied | Corrupt


class Copier:
    def __init__(self, src: DeltaStore, dst: DeltaStore, *, before_commit: Callable[[], None]):
        """`before_commit()`: called before each version is committed in `dst` (the lease check)."""
        self.src = src
        self.dst = dst
        self._before_commit = before_commit
        self._assets: dict[str, bytes] = {}  # what was copied last, by name

    def version(self, rec: VersionRecord) -> CopyOutcome:
        """Copy one version (VersionNotFoundError if the source deleted it meanwhile)."""
        error: IntegrityError | None = None
        for attempt in range(FETCH_ATTEMPTS):
            try:
                paths = self._fetch(rec)
                break
            except IntegrityError as exc:
                error = exc
                log.warning(
                    "mirror: version %d from %s failed verification (try %d): %s",
                    rec.version,
                    self.src.uri,
                    attempt + 1,
                    exc,
                )
                self.src.cache.prune(versions=[rec.version])
        else:
            return Corrupt(rec.version, f"{type(error).__name__}: {error}")
        try:
            self._before_commit()
            return Copied(self.dst.writer.adopt(rec, paths))
        finally:
            self.src.cache.prune(versions=[rec.version])  # the mirror keeps no copies

    def _fetch(self, rec: VersionRecord) -> list[str]:
        """The version's files as local paths, downloaded once and verified."""
        with self.src.open(rec.version, record=rec) as vf:  # downloads (size, sha256), checks the headers
            if any(d.sha256 is None for d in rec.data_files):
                verify_payload(vf)
        return self.src.local_paths(rec.version, record=rec)  # the verified copies, not fetched again

    def marks(self, src_marks: Marks) -> list[int]:
        """Copy the source's marks (`src_marks`, as just read) the destination lacks, or holds for
        another run's record: the regional followers must skip what the trainer marked. Returns the
        versions copied."""
        have = self.dst.marks()
        copied = []
        for v, mark in sorted(src_marks.items()):
            if v not in have or have[v].checksum != mark.checksum:
                self.dst.objects.write(MARKS_DIR, mark_name(v), mark.to_json().encode())
                copied.append(v)
        return copied

    def mark_missing(self, rec: VersionRecord, reason: str, by: str) -> None:
        """Record in the destination that a version was not copied because it is corrupt in the source:
        a mark of a version it does not hold (it blocks nothing there; `fleet` and operators see it)."""
        if rec.version not in self.dst.marks():
            mark = BadMark(rec.version, rec.checksum, reason[:1000], time.time(), by)
            self.dst.objects.write(MARKS_DIR, mark_name(rec.version), mark.to_json().encode())

    def assets(self) -> list[str]:
        """Copy the source's assets that changed since the last copy (each read once per call)."""
        copied = []
        for name in self.src.objects.assets():
            data = self.src.objects.get_asset(name)
            if self._assets.get(name) != data:
                self.dst.objects.put_asset(name, data)
                self._assets[name] = data
                copied.append(name)
        return copied


__all__ = ["Copied", "Copier", "CopyOutcome", "Corrupt"]
