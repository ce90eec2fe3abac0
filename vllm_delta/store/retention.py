"""Retention: which versions and which leftover files a store may delete (docs/FORMAT.md, "Retention").

Policy only, no I/O: `DeltaStore.retain` lists, asks here, and deletes. The versions that live
replicas serve come in as an argument (`protected`), read by the caller from the replica reports
(`replicas.py`), so this module knows nothing of servers.
"""

from __future__ import annotations

from collections.abc import Iterable

from .records import DATA_DIR, DATA_NAME_RE, TMP_PREFIX, VersionRecord

LEFTOVER_AGE_S = 3600.0  # a publish older than this is dead, not slow


def check_keep_anchors(keep_anchors: int) -> None:
    if keep_anchors < 1:
        raise ValueError("keep_anchors must be at least 1")


def doomed_versions(records: Iterable[VersionRecord], keep_anchors: int, *, protected: Iterable[int]) -> list[int]:
    """The versions to delete, newest first (the order that keeps every visible record's chain whole).

    Kept: the newest `keep_anchors` anchors and everything from the oldest of them on, the versions
    in `protected`, and the chain of every kept version (a kept delta whose chain reaches below the
    oldest kept anchor keeps that chain)."""
    check_keep_anchors(keep_anchors)
    recs = {r.version: r for r in records}
    anchors = sorted(v for v, r in recs.items() if r.kind == "anchor")
    if len(anchors) <= keep_anchors:
        return []
    oldest_kept = anchors[-keep_anchors]
    keep = {v for v in recs if v >= oldest_kept} | (set(protected) & set(recs))
    for v in list(keep):
        while (b := recs[v].base) is not None and recs[v].kind == "delta" and b in recs and b not in keep:
            keep.add(b)
            v = b
    return sorted(set(recs) - keep, reverse=True)


def is_leftover(folder: str, name: str, modified: float | None, *, named: set[str], now: float) -> bool:
    """Whether a file in a store folder is what a crashed publish left behind: one of our temporary
    names, or a data file no record names, last modified more than LEFTOVER_AGE_S ago (a file whose
    time the store does not tell is kept). Foreign files are never leftovers."""
    ours = name.startswith(TMP_PREFIX) or (folder == DATA_DIR and DATA_NAME_RE.match(name) is not None)
    if not ours or name in named:
        return False
    return modified is not None and modified < now - LEFTOVER_AGE_S


__all__ = ["LEFTOVER_AGE_S", "check_keep_anchors", "doomed_versions", "is_leftover"]
