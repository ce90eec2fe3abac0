"""What one reader knows of a store's versions: the records it parsed, the listings of `versions/`,
`head.json`, and how `latest()` polls (docs/FORMAT.md, "Reading").

`RecordReader` is the part of a `DeltaStore` that reads records. It keeps the records it parsed (the
least recently used go first beyond `capacity`; a record is written once, so a parsed one stays true
until retention or a rewritten store removes it: decisions re-read with `fresh=True`), lists the
record names afresh on every call, and owns the `LatestPoller` (polling.py), for which it is the
`PollSource`. The writing half (writes.py) hands it every record it commits (`remember`) and reads
the head through it. A record that does not parse is skipped with a warning: it never hides the
other versions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..errors import FormatError
from .fs import StoreFS, basename
from .polling import LatestPoller
from .records import HEAD_NAME, RECORD_NAME_RE, TMP_PREFIX, VERSIONS_DIR, StoreHead, VersionRecord, record_name


class RecordReader:
    """The records of one store as this process has read them (thread-safe)."""

    def __init__(self, io: StoreFS, *, capacity: int):
        self.io = io
        self.capacity = capacity  # parsed records kept
        self._records: OrderedDict[int, VersionRecord] = OrderedDict()  # LRU of parsed records
        self._valid: set[int] = set()  # versions whose records parsed, as of the last listing
        self._lock = threading.Lock()
        self.poller = LatestPoller(self, self.versions_after if io.is_s3 else None)

    def record_path(self, version: int) -> str:
        return self.io.path(VERSIONS_DIR, record_name(version))

    def remember(self, rec: VersionRecord) -> None:
        """A record this process parsed or committed."""
        with self._lock:
            self._records[rec.version] = rec
            self._records.move_to_end(rec.version)
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
            self._valid.add(rec.version)

    def forget(self, version: int) -> None:
        """A version that is gone (deleted by retention, or found missing)."""
        with self._lock:
            self._records.pop(version, None)
            self._valid.discard(version)

    def load_record(self, version: int, fresh: bool = False) -> VersionRecord | None:
        """The parsed record (from memory, or from the store when `fresh` or not known); None if absent
        or unreadable."""
        if not fresh:
            with self._lock:
                cached = self._records.get(version)
                if cached is not None:
                    self._records.move_to_end(version)
                    return cached
        path = self.record_path(version)
        if not self.io.is_local:
            # s3fs's cat_file asks _info, which answers from a cached listing of versions/ when there is
            # one: a record committed by another process after that listing would look absent forever.
            self.io.fs.invalidate_cache(path)
        try:
            text = self.io.cat(path, f"reading {VERSIONS_DIR}/{record_name(version)}")
        except FileNotFoundError:
            self.forget(version)
            return None
        try:
            rec = VersionRecord.from_json(text, where=path)
            if rec.version != version:
                raise FormatError(f"record {path} describes version {rec.version}")
        except FormatError as exc:
            # Not fatal: a foreign or damaged record must not hide the other versions.
            self.io.warn_once(path, f"ignoring {exc}")
            self.forget(version)
            return None
        self.remember(rec)
        return rec

    def list_versions(self) -> list[int]:
        """Committed versions, ascending (a fresh listing each call; a record is parsed once)."""
        found = []
        for entry in self.io.ls(VERSIONS_DIR):
            name = basename(entry["name"])
            m = RECORD_NAME_RE.match(name)
            if not m:
                if not name.startswith(TMP_PREFIX):
                    self.io.warn_once(name, f"ignoring {VERSIONS_DIR}/{name}: not a record name")
                continue
            v = int(m.group(1))
            if v in self._valid or self.load_record(v) is not None:
                found.append(v)
        found.sort()
        with self._lock:  # forget records that retention removed meanwhile
            for gone in self._valid - set(found):
                self._records.pop(gone, None)
            self._valid = set(found)
        self.poller.listed(found[-1] if found else None)
        return found

    def newest_listed(self) -> int | None:
        """The newest version whose record parses, from a listing of the record names (no record is
        read but the newest ones: `list_versions()` reads every record it has not parsed yet)."""
        names = self.io.names(VERSIONS_DIR)
        numbers = sorted((int(m.group(1)) for n in names if (m := RECORD_NAME_RE.match(n))), reverse=True)
        for v in numbers:
            if self.load_record(v) is not None:
                return v
        return None

    def versions_after(self, version: int) -> list[int]:
        """S3: the versions whose records sort after `version`'s (one ListObjectsV2 with StartAfter)."""
        names = self.io.list_after(VERSIONS_DIR, record_name(version))
        return [int(m.group(1)) for name in names if (m := RECORD_NAME_RE.match(name))]

    def read_head(self) -> StoreHead | None:
        """`head.json` as the store has it now (None: no head, or an unreadable one, warned once)."""
        try:
            data = self.io.cat(self.io.path(HEAD_NAME), f"reading {HEAD_NAME}")
        except FileNotFoundError:
            return None
        try:
            return StoreHead.from_json(data, where=HEAD_NAME)
        except FormatError as exc:
            self.io.warn_once(HEAD_NAME, f"ignoring {exc}")
            return None


__all__ = ["RecordReader"]
