"""The store: versions, their files and everything kept beside them (docs/FORMAT.md).

    delta_store.py    DeltaStore     the store's API: listing, records, chains, opening a version,
                                     marks, retention; it owns one of each collaborator below, and
                                     callers use each where it lives (it does not forward)
    fs.py             StoreFS        fsspec access with deadlines, clear errors, warnings given once
    record_reader.py  RecordReader   the records this process parsed, listings, the head, `latest()`
    writes.py         VersionWriter  the writing half of the commit protocol: data first, the record
                                     last, then the head (`DeltaStore.writer`: commit_file, put_part,
                                     commit_parts, adopt, discard_parts)
    files.py          VersionFiles   a version's data files on this host, verified, opened as one
                                     version (`DeltaStore.files`)
    objects.py        StoreObjects   assets and small mutable objects (`DeltaStore.objects`)
    mark_folder.py    MarkFolder     reading and writing bad-version marks (bad/<v>.json)
    cache.py          DownloadCache  the verified download cache of remote stores and its pruning
                                     (`DeltaStore.cache`)
    records.py                       the record schema (versions/<v>.json, head.json), names, checks
    marks.py                         the mark schema and the rule readers apply (no I/O)
    polling.py                       how `latest()` polls (S3 StartAfter, head.json)
    retention.py                     which versions retention removes (no I/O)
    undo.py                          the backward path from a version to an older one on its chain
    replicas.py, ledger.py           what replicas report, and the fleet view built from it

The documents (records, head, marks, replica reports) are `wire.Document`s: their JSON comes from
their fields through wire.py's codec. `from vllm_delta.store import DeltaStore` is the public import.
"""

from .delta_store import DeltaStore
from .fs import store_error
from .polling import FULL_LISTING_S
from .records import TMP_PREFIX, PartRecord, VersionRecord
from .retention import LEFTOVER_AGE_S

__all__ = [
    "FULL_LISTING_S",
    "LEFTOVER_AGE_S",
    "TMP_PREFIX",
    "DeltaStore",
    "PartRecord",
    "VersionRecord",
    "store_error",
]
