"""How a reader finds a store's newest version without listing every version (docs/FORMAT.md, "Reading").

A follower asks `DeltaStore.latest()` every poll, for the life of a run: its cost must not grow with
the store's history. After a first full listing, a poll is three small GETs on every store kind:

* `head.json` (`records.StoreHead`): the newest version its writer committed;
* the record of the newest version: the head's, checked against the head's checksum (a head from an
  earlier run of a rewritten store fails this), or a newer one this reader already confirmed (the
  head may lag);
* the *forward check*: the next version's record, in case the head lags (a writer that died between
  its record and its head); `FORWARD_PROBES` found in a row: list everything.

A store without a head (written before heads existed, or by an older publisher) is polled as before
heads: on S3 one ListObjectsV2 of the records after the newest seen (StartAfter) and one GET
confirming the newest, elsewhere a full listing. GETs rather than S3's StartAfter listing when
there is a head: a GET costs the same on every server whatever the store's size (rclone's StartAfter
reads the whole folder: 7 ms per poll at 300 versions, 65 ms at 10,000, benchmarks/poll_latest.py),
and AWS bills a LIST like 12.5 GETs.

At least every `FULL_LISTING_S`, and whenever something does not add up (a head the records do not
confirm, a newest version that disappeared), a full listing: the safety net for heads that lag on
non-contiguous numbering, retention and rewritten stores. A full listing lists the record *names*
(S3: one request per 1,000) and reads records from the newest down until one parses: it never reads
every record (the first call of a reader used to, one GET per version on S3).

The head is a hint: the answer is always a version whose record was read in this call, never older
than the head's verified version or than the newest version this reader confirmed that still exists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .records import StoreHead, VersionRecord

FULL_LISTING_S = 60.0  # a full listing at least this often (retention, rewritten stores, lagging heads)
FORWARD_PROBES = 4  # without StartAfter: this many next records found in a row means list everything


class PollSource(Protocol):
    """What the poller reads through (DeltaStore's own calls)."""

    def read_head(self) -> StoreHead | None:
        """The store's head, or None (absent, or unreadable: warned)."""
        ...

    def load_record(self, version: int, fresh: bool) -> VersionRecord | None:
        """A version's record (re-read with `fresh`), or None when there is none."""
        ...

    def newest_listed(self) -> int | None:
        """A full listing of the record names; the newest version whose record parses, or None."""
        ...


@dataclass
class PollCounts:
    """What the polls cost so far (tests and benchmarks read it)."""

    polls: int = 0
    full_listings: int = 0
    head_reads: int = 0
    record_reads: int = 0  # confirmations and forward probes


class LatestPoller:
    """The newest-version state of one reader. `list_after(version)`: the versions whose records sort
    after `version`'s (S3's StartAfter), or None where the store has no such listing."""

    def __init__(
        self,
        source: PollSource,
        list_after: Callable[[int], list[int]] | None,
        *,
        full_listing_s: float = FULL_LISTING_S,
    ):
        self._src = source
        self._list_after = list_after
        self.full_listing_s = full_listing_s
        self._newest: int | None = None  # the newest version confirmed (a record read)
        self._listed_at: float | None = None  # time.monotonic() of the last full listing
        self._lock = threading.Lock()
        self.counts = PollCounts()

    def listed(self, newest: int | None) -> None:
        """A full listing was made (by `latest` or by anyone calling `DeltaStore.versions`)."""
        with self._lock:
            self._newest = newest
            self._listed_at = time.monotonic()
            self.counts.full_listings += 1

    def latest(self) -> int | None:
        self.counts.polls += 1
        with self._lock:
            listed_at, newest = self._listed_at, self._newest
        if listed_at is None or time.monotonic() - listed_at >= self.full_listing_s:
            return self._full()
        self.counts.head_reads += 1
        head = self._src.read_head()
        if head is not None:
            found = self._from_head(head, newest)
        elif self._list_after is not None and newest is not None:
            found = self._after(newest)  # no head (an older writer): S3's StartAfter, as before heads
        else:
            found = None  # no head, no StartAfter: listed on every poll, as before heads
        if found is None:
            return self._full()
        with self._lock:
            self._newest = found
        return found

    def _after(self, newest: int) -> int | None:
        """S3: the records after `newest`, then one GET confirming the newest of them."""
        for v in self._list_after(newest) if self._list_after is not None else ():
            self.counts.record_reads += 1
            if self._src.load_record(v, False) is not None:
                newest = max(newest, v)
        return newest if self._confirms(newest, None) else None

    def _from_head(self, head: StoreHead, newest: int | None) -> int | None:
        """The head's record (or a newer one this reader confirmed), then the next version's record."""
        if newest is None or head.version >= newest:
            if not self._confirms(head.version, head.checksum):
                return None  # a head the records do not confirm: rewritten store, or a broken head
            newest = head.version
        elif not self._confirms(newest, None):
            return None  # the head lags and the newest version this reader saw is gone
        for _ in range(FORWARD_PROBES):
            self.counts.record_reads += 1
            if self._src.load_record(newest + 1, True) is None:
                return newest
            newest += 1
        return None  # the head lags by many versions: list everything

    def _confirms(self, version: int, checksum: str | None) -> bool:
        self.counts.record_reads += 1
        rec = self._src.load_record(version, True)
        return rec is not None and (checksum is None or rec.checksum == checksum)

    def _full(self) -> int | None:
        newest = self._src.newest_listed()
        self.listed(newest)
        return newest


__all__ = ["FORWARD_PROBES", "FULL_LISTING_S", "LatestPoller", "PollCounts", "PollSource"]
