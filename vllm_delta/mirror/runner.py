"""The mirror: passes that copy a source store's new versions into a destination store.

One pass (`Mirror.run_once`):

1. take (first pass) or renew the destination's lease (lease.py);
2. copy the source's bad-version marks the destination lacks (before any version: a version the
   trainer marked must not reach a regional follower unmarked);
3. the source's newest version (`latest()`: a few small reads, polling.py); the versions after the
   destination's newest, found by reading their records one by one (a gap of more than `PROBE_MAX`
   numbers: one listing instead); on the first pass into an empty destination, from the source's
   newest anchor (or every version, `everything`);
4. each, oldest first: skipped when its base is not in the destination (corrupt, or older than the
   mirror's start) or when its chain passes through a marked version, else copied (copy.py: verified,
   record last). A corrupt one is never copied: it is logged and marked bad, in the destination (a
   mark of a version it does not hold: shown, blocks nothing) and, with `mark_source`, in the source,
   so the trainer's gate stops waiting for it and its next version is an anchor; the mirror moves on
   at that anchor, like a follower;
5. after an anchor, the destination's own retention (`keep_anchors`);
6. the assets (first pass, and after each anchor) and the ledger (forward.py).

`follow` runs passes every `poll_s` until stopped. A store that is down or slow (5xx, timeouts) is
retried with backoff (`poll_s`, doubling up to `backoff_max_s`); a killed mirror leaves nothing of a
version visible in the destination (records last) and the next run redoes that version. Errors that
retrying cannot fix stop it: the lease held by another mirror (MirrorLeaseError), a destination that
refuses writes (StoreAccessError), a destination that holds another run's version of a number
(VersionExistsError).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..errors import DeltaError, StoreAccessError, VersionExistsError, VersionNotFoundError, http_status
from ..store import DeltaStore
from ..store.marks import Marks, blocked_by, describe
from ..store.records import VersionRecord
from .copy import Copied, Copier, Corrupt
from .forward import LedgerForwarder
from .lease import Lease
from .options import MirrorOptions

log = logging.getLogger(__name__)

PROBE_MAX = 256  # versions to look for one by one; a larger gap in the numbering: one listing


@dataclass
class MirrorPass:
    """What one pass did."""

    newest: int | None = None  # the source's newest version
    copied: list[int] = field(default_factory=list)
    corrupt: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)  # version -> why it was not copied
    marks: list[int] = field(default_factory=list)  # marks copied to the destination
    forwarded: int = 0  # replica reports forwarded to the source


def default_owner() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Mirror:
    """Copies `src` into `dst` (DeltaStores, or URIs with their storage options)."""

    def __init__(self, src: DeltaStore, dst: DeltaStore, options: MirrorOptions | None = None):
        self.src = src
        self.dst = dst
        self.options = options or MirrorOptions()
        self.owner = self.options.owner or default_owner()
        self.lease = Lease(dst, self.owner, src=src.uri, region=self.options.region, ttl_s=self.options.lease_ttl_s)
        self.copier = Copier(src, dst, before_commit=self._before_commit)
        self.forwarder = LedgerForwarder(src, dst, self.options.region)
        self._leased = False
        self._renewed = 0.0
        self._done: int | None = None  # the destination's newest version (None: not read yet)
        self._first = True
        self.passes = 0

    # -- one pass ------------------------------------------------------------------------------------
    def run_once(self) -> MirrorPass:
        out = MirrorPass()
        if not self._leased:
            self.lease.acquire()
            self._leased, self._renewed = True, time.monotonic()
        else:
            self._renew()
        marks = self.src.marks()
        out.marks = self.copier.marks(marks)
        out.newest = newest = self.src.latest()
        if self._done is None:
            self._done = self._resume_point()
        anchors = 0
        for rec in self._pending(newest):
            copied = self._one(rec, marks, out)
            anchors += copied is not None and copied.kind == "anchor"
        if self._first or anchors:
            self.copier.assets()
        if anchors and self.options.keep_anchors:
            self.dst.retain(self.options.keep_anchors)
        if self.options.forward_ledger:
            out.forwarded = self.forwarder.forward()
        self._first = False
        self.passes += 1
        return out

    def _resume_point(self) -> int | None:
        """The destination's newest version, checked to be the source's (same checksum): a destination
        filled from another source, or from an earlier run of a rewritten one, is refused."""
        done = self.dst.latest()
        if done is None:
            return None
        try:
            theirs = self.src.record(done, fresh=True)
        except VersionNotFoundError:
            return done  # retention removed it from the source; newer versions are compared as they come
        ours = self.dst.record(done)
        if theirs.checksum != ours.checksum:
            raise VersionExistsError(
                f"the destination {self.dst.uri} holds version {done} with checksum {ours.checksum}, the source "
                f"{self.src.uri} has {theirs.checksum}: another source, or a rewritten one (mirror into a new store)",
                version=done,
            )
        return done

    def _pending(self, newest: int | None) -> list[VersionRecord]:
        """The source's records after the destination's newest version, oldest first."""
        done = self._done
        if newest is None or (done is not None and done >= newest):
            if newest is not None and done is not None and done > newest and self._first:
                log.warning(
                    "mirror: %s holds version %d, newer than the source's newest %d (was the source rewritten?)",
                    self.dst.uri,
                    done,
                    newest,
                )
            return []
        if done is not None:
            lo = done + 1
        elif self.options.everything:
            lo = 0
        else:
            # The anchor of the newest usable version (what a new follower needs; below a marked newest
            # anchor, the one before it), else the newest version's: its versions are then skipped, saying why.
            usable = self.src.latest_usable()
            lo = self.src.chain(newest if usable is None else usable)[0].version
        numbers = range(lo, newest + 1) if newest - lo < PROBE_MAX else [v for v in self.src.versions() if v >= lo]
        out = []
        for v in numbers:
            try:
                out.append(self.src.record(v, fresh=True))
            except VersionNotFoundError:
                continue  # a gap in the numbering, or retention
        return out

    def _one(self, rec: VersionRecord, marks: Marks, out: MirrorPass) -> VersionRecord | None:
        """Copy one version (or say why not); the destination's record when it was copied."""
        v = rec.version
        why = self._why_not(rec, marks)
        if why is not None:
            out.skipped[v] = why
            log.warning("mirror: not copying version %d: %s", v, why)
            self._done = v
            return None
        try:
            outcome = self.copier.version(rec)
        except VersionNotFoundError:
            out.skipped[v] = "deleted from the source while it was copied"
            return None
        self._done = v
        if isinstance(outcome, Corrupt):
            out.corrupt.append(v)
            self._mark_corrupt(rec, outcome)
            return None
        assert isinstance(outcome, Copied)
        out.copied.append(v)
        log.info("mirror: version %d (%s, %d bytes) copied to %s", v, rec.kind, rec.bytes, self.dst.uri)
        return outcome.record

    def _why_not(self, rec: VersionRecord, marks: Marks) -> str | None:
        if rec.kind == "delta" and rec.base is not None:
            try:
                base = self.dst.record(rec.base)
            except VersionNotFoundError:
                return f"its base {rec.base} is not in the destination (corrupt in the source, or before this mirror)"
            if rec.base_checksum is not None and base.checksum != rec.base_checksum:
                return f"its base {rec.base} in the destination has checksum {base.checksum}, not {rec.base_checksum}"
        mark = blocked_by(self.src.chain(rec.version), marks) if marks else None
        return f"its chain is blocked: {describe(mark)}" if mark is not None else None

    def _mark_corrupt(self, rec: VersionRecord, outcome: Corrupt) -> None:
        reason = f"corrupt in the source {self.src.uri}: {outcome.reason}"
        by = f"mirror {self.owner} (region {self.options.region})"
        log.error("mirror: version %d is %s; not copied, marked bad", rec.version, reason)
        self.copier.mark_missing(rec, reason, by)
        if not self.options.mark_source:
            return
        try:
            self.src.mark_bad(rec.version, reason[:1000], by=by)
        except StoreAccessError as exc:
            log.warning(
                "mirror: cannot mark version %d bad in the source (%s): its trainer waits for it", rec.version, exc
            )

    def _before_commit(self) -> None:
        """Before each record the mirror writes: the lease is still its own (renewed when due)."""
        self._renew()

    def _renew(self) -> None:
        if time.monotonic() - self._renewed >= self.options.lease_ttl_s / 3:
            self.lease.renew()
            self._renewed = time.monotonic()
        else:
            self.lease.check()

    # -- following -----------------------------------------------------------------------------------
    def follow(self, stop: threading.Event | None = None) -> None:
        """Run passes every `poll_s` until `stop` is set; store faults are retried with backoff."""
        stop = stop or threading.Event()
        opts = self.options
        backoff = opts.poll_s
        try:
            while not stop.is_set():
                try:
                    self.run_once()
                    wait, backoff = opts.poll_s, opts.poll_s
                except DeltaError as exc:
                    if not _transient(exc):
                        raise
                    log.warning("mirror: %s; retrying in %.1f s", exc, backoff)
                    wait, backoff = backoff, min(backoff * 2, opts.backoff_max_s)
                except (ConnectionError, TimeoutError) as exc:
                    log.warning("mirror: %s: %s; retrying in %.1f s", type(exc).__name__, exc, backoff)
                    wait, backoff = backoff, min(backoff * 2, opts.backoff_max_s)
                stop.wait(wait)
        finally:
            self.close()

    def close(self) -> None:
        """Give the lease back (a clean stop)."""
        if self._leased:
            self.lease.release()
            self._leased = False


def _transient(exc: DeltaError) -> bool:
    """A fault retrying can fix: the store down or slow, the local cache full (5xx)."""
    return http_status(exc) >= 500


__all__ = ["Mirror", "MirrorPass", "PROBE_MAX", "default_owner"]
