"""Bad-version marks: `bad/<version:010d>.json`, one small object per version that a trainer or an
operator declared bad, and the one rule every reader applies to them (docs/FORMAT.md, "Bad-version
marks").

A version is *blocked* when a marked version lies on its chain (the version itself, or any base it
needs down to its anchor): followers never apply a blocked version, and the staleness gate does not
wait for replicas to reach one. A mark names the checksum of the record it marks, so that a mark
left by an earlier run of a store that was wiped and refilled (same version numbers, other weights)
blocks nothing. Marks are written once and never changed; `retain` deletes a mark only after the
version it marks is gone (logged).

This module is the schema and the rule, no I/O: `DeltaStore.mark_bad` / `DeltaStore.marks` read and
write the objects; the follower (`vllm/follower.py`), the staleness gate (`trainer/staleness.py`) and
the fleet view (`ledger.py`) apply `blocked_by`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..checksums import is_hex
from ..errors import short
from ..wire import Document, Number
from .records import MAX_VERSION, VersionRecord

MARKS_DIR = "bad"
MARK_FORMAT = "vllm-delta-mark"
MARK_FORMAT_VERSION = 1
MAX_REASON = 1000  # characters of a mark's reason
MARK_NAME_RE = re.compile(r"^(\d{10})\.json$")

Marks = Mapping[int, "BadMark"]  # version -> its mark, as `DeltaStore.marks()` returns them


def mark_name(version: int) -> str:
    return f"{version:010d}.json"


def default_marker() -> str:
    """Who marks, when the caller does not say: user, host and process (free text, for people)."""
    user = os.environ.get("USER") or os.environ.get("USERNAME") or "?"
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class BadMark(Document):
    """One version declared bad (one JSON object under `bad/`)."""

    FORMAT: ClassVar[str] = MARK_FORMAT
    FORMAT_VERSIONS: ClassVar[tuple[int, ...]] = (MARK_FORMAT_VERSION,)
    DESCRIPTION: ClassVar[str] = "bad-version mark"

    version: int
    checksum: str  # the marked record's whole-model checksum: the mark binds to that version of that run
    reason: str
    created: Number  # unix time
    by: str  # who marked it (free text: user@host:pid by default)

    def validate(self) -> None:
        v = self.version
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_VERSION:
            raise ValueError(f"bad version {short(v)}")
        if not is_hex(self.checksum):
            raise ValueError(f"checksum must be 16 lower-case hex digits, not {short(self.checksum)}")
        check_reason(self.reason)
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool):
            raise ValueError("created must be a number")
        if not isinstance(self.by, str):
            raise ValueError("by must be a string")

    def matches(self, record: VersionRecord) -> bool:
        """Whether this mark is about `record` (same version, same run: same checksum)."""
        return record.version == self.version and record.checksum == self.checksum


def check_reason(reason: object) -> None:
    if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
        raise ValueError(f"a mark's reason is a non-empty string of at most {MAX_REASON} characters: {short(reason)}")


def blocked_by(chain: Sequence[VersionRecord], marks: Marks) -> BadMark | None:
    """The first mark on `chain` (records from an anchor up, as `DeltaStore.chain` gives them), or None
    when the chain's last version is reachable. A mark whose checksum differs from the record's is from
    another run of the store: it blocks nothing."""
    for rec in chain:
        mark = marks.get(rec.version)
        if mark is not None and mark.matches(rec):
            return mark
    return None


def reachable_prefix(chain: Sequence[VersionRecord], marks: Marks) -> list[VersionRecord]:
    """The records of `chain` a reader may apply: everything before its first mark (all of it when
    none); a reader can move along the chain up to the version just before a marked one."""
    mark = blocked_by(chain, marks)
    if mark is None:
        return list(chain)
    return [r for r in chain if r.version < mark.version]


def describe(mark: BadMark) -> str:
    return f"version {mark.version} is marked bad ({mark.reason[:200]})"


__all__ = [
    "MARKS_DIR",
    "MARK_FORMAT",
    "MARK_FORMAT_VERSION",
    "MARK_NAME_RE",
    "BadMark",
    "Marks",
    "blocked_by",
    "check_reason",
    "default_marker",
    "describe",
    "mark_name",
    "reachable_prefix",
]
