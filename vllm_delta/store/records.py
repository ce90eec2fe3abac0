"""Commit records: the schema of `versions/<version:010d>.json`, its validation, and the store's names.

A version is visible iff its record is (docs/FORMAT.md, "Store layout"). This module knows what a
record says and which names a store uses (folders, record and data file names); it does no I/O:
`record_reader.py` reads records, `writes.py` writes them, `cache.py` verifies downloaded copies of
the files a record names, `retention.py` decides which records go. A record's JSON comes from its
fields through wire.py's codec (`wire.Document`). A record change (a field, a format version) is made
here and in docs/FORMAT.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..checksums import is_hex, sum_of_parts
from ..errors import IntegrityError, short
from ..format import VersionKind, is_kind
from ..wire import Document, Number, omit_none, omit_when

RECORD_FORMAT = "vllm-delta-record"
RECORD_FORMAT_VERSION = 1  # one-file versions
RECORD_PARTS_FORMAT_VERSION = 2  # multi-part versions
VERSIONS_DIR = "versions"
DATA_DIR = "data"
ASSETS_DIR = "assets"
HEAD_NAME = "head.json"  # the newest committed version, a hint readers verify (StoreHead)
HEAD_FORMAT = "vllm-delta-head"
HEAD_FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"  # never a committed name: readers skip it, retain removes old ones
MAX_VERSION = 10**10 - 1  # ten digits keep names sorted as numbers
MAX_PARTS = 10**5  # five digits of part index in a part file's name

RECORD_NAME_RE = re.compile(r"^(\d{10})\.json$")
# groups: version, kind, token, part index (None for a one-file version)
DATA_NAME_RE = re.compile(r"^(\d{10})\.(anchor|delta)\.([0-9a-f]{16})(?:\.part(\d{5}))?\.safetensors$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
RUN_RE = re.compile(r"^[0-9A-Za-z._-]{1,64}$")  # a store's run identity


def record_name(version: int) -> str:
    return f"{version:010d}.json"


def data_name(version: int, kind: VersionKind, token: str, part: int | None = None) -> str:
    suffix = "" if part is None else f".part{part:05d}"
    return f"{version:010d}.{kind}.{token}{suffix}.safetensors"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_sha256(value: object, what: str) -> None:
    if value is not None and not (isinstance(value, str) and _SHA256.match(value)):
        raise ValueError(f"{what} must be 64 lower-case hex digits, not {short(value)}")


@dataclass(frozen=True)
class PartRecord:
    """One part of a multi-part version, as its record lists it."""

    file: str  # data file path relative to the store root
    bytes: int  # its size
    checksum: str  # Σ_t key(t) · (partial sum of t over the part's elements): the parts add up to the whole
    sha256: str | None = omit_none()  # hex digest of the part file


@dataclass(frozen=True)
class DataFile:
    """One data file of a version, as a reader checks it: where, how big, and its sha256 if known."""

    file: str
    bytes: int
    sha256: str | None


@dataclass(frozen=True, kw_only=True)
class VersionRecord(Document):
    """The commit record of one version, stored as JSON at versions/<version:010d>.json.

    One-file versions (record format 1) name their file in `file`; multi-part versions (record
    format 2) have `file` None and list their parts in `parts` (`bytes` is then the parts' total).
    Keys with a default may be absent (records written before them); unknown keys are ignored."""

    FORMAT: ClassVar[str] = RECORD_FORMAT
    FORMAT_VERSIONS: ClassVar[tuple[int, ...]] = (RECORD_FORMAT_VERSION, RECORD_PARTS_FORMAT_VERSION)
    DESCRIPTION: ClassVar[str] = "commit record"

    version: int
    kind: VersionKind
    base: int | None
    codec: str | None
    # data file path relative to the store root (one-file versions; absent from format 2)
    file: str | None = omit_none()
    bytes: int  # size of the data file (of all parts)
    nnz: int  # changed elements (numel for anchors)
    numel: int
    checksum: str  # whole-model checksum at this version
    base_checksum: str | None
    created: Number
    sha256: str | None = omit_none()  # hex digest of the data file (optional: older records have none)
    # multi-part versions, in part order (absent from format 1)
    parts: tuple[PartRecord, ...] = omit_when(lambda rec: not rec.parts, default=())
    # the store's run identity (optional: records written before it have none; store/signed.py)
    run: str | None = omit_none()
    # {"alg", "key", "value"}: the publisher's Ed25519 signature of the version (signatures.py). Kept as
    # written and parsed only when checked, so that a damaged signature never hides the version from
    # readers that do not check signatures, and a server that does names what is wrong.
    signature: Any = omit_none()

    @property
    def density(self) -> float:
        return self.nnz / self.numel if self.numel else 0.0

    @property
    def files(self) -> list[str]:
        """Every data file of the version (relative to the store root), in part order."""
        return [d.file for d in self.data_files]

    @property
    def sizes(self) -> list[int]:
        return [d.bytes for d in self.data_files]

    @property
    def data_files(self) -> list[DataFile]:
        if self.file is not None:
            return [DataFile(self.file, self.bytes, self.sha256)]
        return [DataFile(p.file, p.bytes, p.sha256) for p in self.parts]

    def document_version(self) -> int:
        return RECORD_PARTS_FORMAT_VERSION if self.parts else RECORD_FORMAT_VERSION

    @classmethod
    def check_wire(cls, doc: Any) -> None:
        """What each record format requires beyond its fields' types."""
        if not isinstance(doc, Mapping):
            return  # the codec says what is wrong
        if doc.get("format_version") == RECORD_FORMAT_VERSION and "file" not in doc:
            raise ValueError("a record of format 1 names its file")
        if doc.get("format_version") == RECORD_PARTS_FORMAT_VERSION and not isinstance(doc.get("parts"), list):
            raise ValueError("parts must be a list")

    def validate(self) -> None:
        ints = (self.version, self.bytes, self.nnz, self.numel)
        if not all(_is_int(x) for x in ints):
            raise ValueError("version, bytes, nnz and numel must be non-negative integers")
        if not is_kind(self.kind):
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.kind == "delta" and not (isinstance(self.base, int) and 0 <= self.base < self.version):
            raise ValueError(f"a delta needs a base below its version, got {self.base!r}")
        if not isinstance(self.created, (int, float)) or isinstance(self.created, bool):
            raise ValueError("bad created time")
        for key in ("checksum", "base_checksum"):
            value = getattr(self, key)
            if (value is not None or key == "checksum") and not is_hex(value):
                raise ValueError(f"{key} must be 16 lower-case hex digits, not {short(value)}")
        _check_sha256(self.sha256, "sha256")
        if self.run is not None and not (isinstance(self.run, str) and RUN_RE.match(self.run)):
            raise ValueError(f"run must be 1-64 letters, digits, '.', '_' or '-', not {short(self.run)}")
        if self.file is not None:
            if self.parts:
                raise ValueError("a record names one file or lists parts, not both")
            self._check_file(self.file, None)
            return
        if self.sha256 is not None:
            raise ValueError("a multi-part record has a sha256 per part, not one for the version")
        if not self.parts or len(self.parts) > MAX_PARTS:
            raise ValueError("a multi-part record lists its parts")
        for i, part in enumerate(self.parts):
            if not isinstance(part.file, str) or not _is_int(part.bytes) or not is_hex(part.checksum):
                raise ValueError(f"bad part {i}: {short(part)}")
            _check_sha256(part.sha256, f"part {i}'s sha256")
            self._check_file(part.file, i)
        if len(set(self.files)) != len(self.parts) or sum(p.bytes for p in self.parts) != self.bytes:
            raise ValueError("parts must be distinct files whose sizes add up to bytes")
        total = sum_of_parts(p.checksum for p in self.parts)
        if total != self.checksum:
            raise ValueError(f"the parts' checksums add up to {total}, not {self.checksum}")

    def _check_file(self, file: str, part: int | None) -> None:
        folder, _, name = file.partition("/")
        m = DATA_NAME_RE.match(name)
        index = None if not m or m.group(4) is None else int(m.group(4))
        if folder != DATA_DIR or not m or int(m.group(1)) != self.version or m.group(2) != self.kind or index != part:
            what = f"{self.kind} {self.version}" + ("" if part is None else f" part {part}")
            raise ValueError(f"data file {file!r} does not belong to {what}")


@dataclass(frozen=True)
class StoreHead(Document):
    """`head.json`: the newest committed version as its writer last saw it, rewritten after each commit.

    A hint, never the truth: the records are. Readers check it against the record it names (same
    checksum) and look past it (the forward check), so a head that lags (a writer that died between
    its record and its head, an older publisher that writes none) or that belongs to an earlier run
    of the store costs a listing, never a wrong answer (docs/FORMAT.md, "Reading")."""

    FORMAT: ClassVar[str] = HEAD_FORMAT
    FORMAT_VERSIONS: ClassVar[tuple[int, ...]] = (HEAD_FORMAT_VERSION,)
    DESCRIPTION: ClassVar[str] = "store head"

    version: int
    checksum: str  # of the record it names
    written: Number  # unix time

    def validate(self) -> None:
        if not _is_int(self.version) or self.version > MAX_VERSION or not is_hex(self.checksum):
            raise ValueError(f"bad version or checksum: {short(self.version)}, {short(self.checksum)}")


def asset_parts(name: str) -> list[str]:
    """The path parts of an asset name under `assets/` (ValueError for a name that could leave it)."""
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") or p.startswith(TMP_PREFIX) for p in parts) or "\\" in name:
        raise ValueError(f"bad asset name {name!r}")
    return parts


def check_object_name(folder: str, name: str) -> None:
    """A small mutable object's folder and name (`write_object`): never the versions' or data's folder."""
    if folder in (VERSIONS_DIR, DATA_DIR) or not folder.isidentifier():
        raise ValueError(f"bad object folder {folder!r}")
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith(TMP_PREFIX):
        raise ValueError(f"bad object name {name!r}")


def check_size(data: DataFile, size: int, *, version: int) -> None:
    """A local copy of a data file (the store's own file, or a download) has the size its record says."""
    if size != data.bytes:
        raise IntegrityError(
            f"data file {data.file} holds {size} bytes, its record says {data.bytes} (truncated or replaced)",
            version=version,
        )


__all__ = [
    "ASSETS_DIR",
    "DATA_DIR",
    "DATA_NAME_RE",
    "HEAD_FORMAT",
    "HEAD_FORMAT_VERSION",
    "HEAD_NAME",
    "MAX_PARTS",
    "MAX_VERSION",
    "RECORD_FORMAT",
    "RECORD_FORMAT_VERSION",
    "RECORD_NAME_RE",
    "RECORD_PARTS_FORMAT_VERSION",
    "RUN_RE",
    "TMP_PREFIX",
    "VERSIONS_DIR",
    "DataFile",
    "PartRecord",
    "StoreHead",
    "VersionRecord",
    "asset_parts",
    "check_object_name",
    "check_size",
    "data_name",
    "record_name",
]
