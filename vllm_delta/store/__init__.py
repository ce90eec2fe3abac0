"""The store: versions, their files and everything kept beside them (docs/FORMAT.md).

    DeltaStore (delta_store.py)   reads and writes one store: atomic versions, listings, chains,
                                  the verified download cache, retention, marks
    writes.py                     the writing half of the commit protocol (data first, record last)
    records.py                    the record schema (versions/<v>.json, head.json) and its checks
    fs.py                         fsspec access with deadlines and clear errors
    cache.py                      the verified download cache and its pruning
    polling.py                    how `latest()` polls (S3 StartAfter, head.json)
    retention.py                  which versions retention removes (no I/O)
    marks.py                      bad-version marks (bad/<v>.json)
    replicas.py, ledger.py        what replicas report, and the fleet view built from it

`from vllm_delta.store import DeltaStore` is the public import.
"""

from .delta_store import FULL_LISTING_S, LEFTOVER_AGE_S, TMP_PREFIX, DeltaStore, PartRecord, VersionRecord, store_error

__all__ = [
    "FULL_LISTING_S",
    "LEFTOVER_AGE_S",
    "TMP_PREFIX",
    "DeltaStore",
    "PartRecord",
    "VersionRecord",
    "store_error",
]
