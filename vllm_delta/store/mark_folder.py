"""The `bad/` folder of one store: writing a bad-version mark once, reading every mark (docs/FORMAT.md,
"Bad-version marks").

The schema and the rule readers apply live in marks.py (no I/O); this is the part of a `DeltaStore`
that reads and writes the objects. A listing of `bad/` costs what the number of marks costs, not the
number of versions, and each mark is read once per process (remembered by its size and modification
time). A mark that does not parse is skipped with a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import FormatError, StoreAccessError
from .fs import StoreFS, basename, modified
from .marks import MARK_NAME_RE, MARKS_DIR, BadMark, default_marker, mark_name
from .records import TMP_PREFIX, VersionRecord

log = logging.getLogger("vllm_delta.store")


class MarkFolder:
    """The marks of one store as this process has read them (thread-safe)."""

    def __init__(self, io: StoreFS):
        self.io = io
        self._seen: dict[int, tuple[tuple[Any, Any], BadMark]] = {}  # version -> (size, mtime), mark
        self._lock = threading.Lock()

    def mark(self, rec: VersionRecord, reason: str, by: str | None) -> BadMark:
        """Mark the version of `rec` (its record as the store has it now) bad, unless a mark of that
        record is there already (returned as is). StoreAccessError when the store refuses the write."""
        existing = self.read(rec.version)
        if existing is not None and existing.matches(rec):
            return existing
        mark = BadMark(rec.version, rec.checksum, reason, time.time(), by or default_marker())
        try:
            self.io.write_small(self.io.path(MARKS_DIR, mark_name(rec.version)), mark.to_json().encode())
        except PermissionError as exc:
            raise StoreAccessError(
                f"cannot mark version {rec.version} bad: store {self.io.uri} refuses writes ({exc})",
                version=rec.version,
            ) from None
        log.warning("%s: version %d marked bad by %s: %s", self.io.uri, rec.version, mark.by, reason)
        return mark

    def read_all(self) -> dict[int, BadMark]:
        """Every readable mark, by version: one listing of `bad/` and a read of each mark not seen before."""
        out: dict[int, BadMark] = {}
        for entry in self.io.ls(MARKS_DIR):
            name = basename(entry["name"])
            m = MARK_NAME_RE.match(name)
            if not m:
                if not name.startswith(TMP_PREFIX):
                    self.io.warn_once(f"{MARKS_DIR}/{name}", f"ignoring {MARKS_DIR}/{name}: not a mark name")
                continue
            version, stamp = int(m.group(1)), (entry.get("size"), modified(entry))
            with self._lock:
                seen = self._seen.get(version)
            if seen is not None and seen[0] == stamp:
                out[version] = seen[1]
                continue
            mark = self.read(version)
            if mark is not None:
                out[version] = mark
                with self._lock:
                    self._seen[version] = (stamp, mark)
        return out

    def read(self, version: int) -> BadMark | None:
        """The mark of `version` as the store has it now (None: none, or unreadable: warned once)."""
        where = f"{MARKS_DIR}/{mark_name(version)}"
        try:
            mark = BadMark.from_json(
                self.io.cat(self.io.path(MARKS_DIR, mark_name(version)), f"reading {where}"), where=where
            )
            if mark.version != version:
                raise FormatError(f"{where} marks version {mark.version}")
        except FileNotFoundError:
            return None
        except FormatError as exc:
            self.io.warn_once(where, f"ignoring {exc}")
            return None
        return mark

    def delete(self, version: int) -> None:
        self.io.remove(self.io.path(MARKS_DIR, mark_name(version)), f"deleting {MARKS_DIR}/{mark_name(version)}")


__all__ = ["MarkFolder"]
