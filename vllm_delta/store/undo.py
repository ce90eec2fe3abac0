"""Backward updates: the path from a served version down to an older version on its chain.

Every stored difference is d = new - old (mod 2^bits) (docs/FORMAT.md), so a delta's file is also its
inverse: old = new - d. A reader at version S goes back to an older N by undoing the deltas S, S-1, ...
down to N+1, newest first, with no anchor replayed: O(changes), like a forward update. The path exists
only where every step can be undone (`undo_path` says why not otherwise):

    each version from S down to N+1  a delta (an anchor holds weights, not differences), coded as
                                     differences (not `raw`, which stores new values), on the next one
                                     down (N must be on S's chain), with its data files in the store
    N                                in the store with its data files (its header: what N's weights are)
    S                                in the store with the checksum the reader serves (same run)

Rules only: the records and the data files' presence come from the caller (`DeltaStore.undo_path`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import codec as codecs
from ..errors import CodecError, NotSuccessorError, VersionNotFoundError
from .records import VersionRecord


@dataclass(frozen=True)
class UndoPath:
    """The deltas to undo, newest first (the served version's first), and the target's record."""

    undone: list[VersionRecord]
    target: VersionRecord


Missing = Callable[[VersionRecord], "str | None"]  # the first data file of a record that is gone, or None
NoPath = Callable[[str], NotSuccessorError]  # the error saying why there is no path


def undo_path(
    held: int, held_checksum: str | None, target: int, record: Callable[[int], VersionRecord], missing: Missing
) -> UndoPath:
    """The path from `held` (served with `held_checksum`, when known) back to the older `target`, or
    NotSuccessorError (409) saying why there is none. `record(v)` reads a record (VersionNotFoundError when
    the store does not hold it); `missing(rec)` names a data file of `rec` that is gone."""
    if target >= held:
        raise ValueError(f"version {target} is not older than {held}")

    def no_path(why: str) -> NotSuccessorError:
        return NotSuccessorError(
            f"version {target} is older than the served version {held}, with no backward path: {why}"
        )

    rec = _record(record, held, no_path, f"the served version {held} is no longer in the store")
    if held_checksum is not None and rec.checksum != held_checksum:
        raise no_path(
            f"the store's version {held} has checksum {rec.checksum}, the server's {held_checksum} "
            "(was the store rewritten?)",
        )
    undone: list[VersionRecord] = []
    while rec.version > target:
        _check_step(rec, target, missing, no_path)
        assert rec.base is not None  # a delta (checked above)
        base = _record(record, rec.base, no_path, f"version {rec.base}, the base of version {rec.version}, is gone")
        if rec.base_checksum is not None and base.checksum != rec.base_checksum:
            raise no_path(
                f"delta {rec.version} expects base checksum {rec.base_checksum}, version {base.version} has "
                f"{base.checksum} (was the store rewritten?)",
            )
        undone.append(rec)
        rec = base
    gone = missing(rec)
    if gone is not None:
        raise no_path(f"its data file {gone} is gone (its header records the weights to go back to)")
    return UndoPath(undone, rec)


def _check_step(rec: VersionRecord, target: int, missing: Missing, no_path: NoPath) -> None:
    """That version `rec` can be undone on the way down to `target`."""
    if rec.kind != "delta":
        raise no_path(f"version {rec.version} is an anchor: it holds weights, not differences to undo")
    try:
        diffs = codecs.get_codec(rec.codec or "", {"version": rec.version}).needs_base
    except CodecError as exc:
        raise no_path(f"version {rec.version}: {exc}") from None
    if not diffs:
        raise no_path(f"version {rec.version} is coded with {rec.codec!r}, which stores new values, not differences")
    assert rec.base is not None
    if rec.base < target:
        raise no_path(
            f"it is not on the served version's chain (version {rec.version} is a delta on version {rec.base})",
        )
    gone = missing(rec)
    if gone is not None:
        raise no_path(f"data file {gone} of version {rec.version} is gone")


def _record(record: Callable[[int], VersionRecord], version: int, no_path: NoPath, why: str) -> VersionRecord:
    try:
        return record(version)
    except VersionNotFoundError:
        raise no_path(why) from None


__all__ = ["UndoPath", "undo_path"]
