"""Writing a version into a store: data files first, the record last (docs/FORMAT.md, "Writing").

`VersionWriter` is the writing half of a `DeltaStore`: the store owns one (`DeltaStore.writer`) and
whoever writes versions calls it there (the Publisher's uploader, a mirror, tests). It changes for its
own reasons (how data lands durably on each store kind, the no-clobber commit of a record, the head
that follows each commit) and needs of the store only its filesystem access (`fs.StoreFS`) and its
record reader (`record_reader.RecordReader`: the writer hands it every record it commits, and reads
the head and existing records through it).

A version is visible iff its record is, and the record is written only after all its data files are
complete; data file names carry a random token, so a stale or crashed writer never overwrites
committed data. A one-file version is committed by `commit_file`; a multi-part one by `put_part` on
every rank, then `commit_parts` once; a copy from another store by `adopt`. After each commit,
`head.json` names the version (best effort: readers find it without the head).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ..errors import DeltaError, FormatError, IntegrityError, VersionExistsError
from ..format import VersionFile, VersionHeader, VersionKind, header_text, is_kind
from .cache import file_sha256
from .fs import StoreFS, fsync
from .record_reader import RecordReader
from .records import (
    DATA_DIR,
    HEAD_NAME,
    MAX_PARTS,
    MAX_VERSION,
    TMP_PREFIX,
    VERSIONS_DIR,
    PartRecord,
    StoreHead,
    VersionRecord,
    check_size,
    data_name,
    record_name,
)
from .signed import RecordSigner

log = logging.getLogger("vllm_delta.store")

# Files moved in from mkstemp are 0600; committed files get the mode a plain create would give them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


class VersionWriter:
    """Commits versions into one store (one publisher per store: docs/FORMAT.md, "Publishing")."""

    def __init__(self, io: StoreFS, records: RecordReader):
        self.io = io
        self.records = records
        # Set by the Publisher that writes this store (signed.py): every record `commit_file` and
        # `commit_parts` commit carries its run, and its signature when it holds a key. `adopt` copies
        # records as they are (a mirror keeps the source's run and signatures).
        self.signer: RecordSigner | None = None

    def _path(self, *parts: str) -> str:
        return self.io.path(*parts)

    def _record_path(self, version: int) -> str:
        return self.records.record_path(version)

    def commit_file(self, header: VersionHeader, local_path: str, *, move: bool = False) -> VersionRecord:
        """Commit a one-file version atomically. `move=True` hands the file over (renamed or deleted)."""
        header.validate()
        v = header.version
        if v > MAX_VERSION:
            raise ValueError(f"version {v} exceeds {MAX_VERSION}")
        if header.part is not None:
            raise ValueError("a part file is uploaded with put_part and committed with commit_parts")
        self._check_file_holds(header, local_path)
        if self.io.exists(self._record_path(v)):
            raise VersionExistsError(f"version {v} already exists in store {self.io.uri}", version=v)
        token = secrets.token_hex(8)
        file = f"{DATA_DIR}/{data_name(v, header.kind, token)}"
        rec = VersionRecord(
            version=v,
            kind=header.kind,
            base=header.base,
            codec=header.codec,
            file=file,
            bytes=os.path.getsize(local_path),
            nnz=header.nnz,
            numel=header.numel,
            checksum=header.checksum,
            base_checksum=header.base_checksum,
            created=header.created or time.time(),
        )
        digest = not self.io.is_local or (self.signer is not None and self.signer.needs_digests)
        consumed, sha256 = self._put_digested(v, file, local_path, rec.bytes, move, token, digest=digest)
        rec = self._sealed(dataclasses.replace(rec, sha256=sha256))
        try:
            self._commit_record(rec, token)
        except VersionExistsError:
            self._remove_data([file])
            raise
        if move and not consumed:
            os.remove(local_path)
        self.records.remember(rec)
        self._advance_head(rec)
        return rec

    def put_part(self, header: VersionHeader, local_path: str, *, move: bool = False) -> PartRecord:
        """Upload one part file of a multi-part version under a fresh name; nothing becomes visible.

        Returns once the part is durable (local: renamed into place and fsynced; remote: uploaded and
        its size checked). `commit_parts` makes the version visible; `discard_parts` removes parts
        of a version that will not be committed (else `retain` removes them after LEFTOVER_AGE_S)."""
        header.validate()
        v, part = header.version, header.part
        if part is None:
            raise ValueError("put_part takes a part file (format version 2); one-file versions use commit_file")
        if v > MAX_VERSION or part.count > MAX_PARTS:
            raise ValueError(f"version {v} or part count {part.count} out of range")
        self._check_file_holds(header, local_path)
        token = secrets.token_hex(8)
        file = f"{DATA_DIR}/{data_name(v, header.kind, token, part.index)}"
        nbytes = os.path.getsize(local_path)
        consumed, sha256 = self._put_digested(v, file, local_path, nbytes, move, token, digest=not self.io.is_local)
        if move and not consumed:
            os.remove(local_path)
        return PartRecord(file=file, bytes=nbytes, checksum=part.checksum, sha256=sha256)

    def commit_parts(
        self,
        *,
        version: int,
        kind: VersionKind,  # checked again here: it may come from another rank
        base: int | None,
        codec: str | None,
        nnz: int,
        numel: int,
        checksum: str,
        base_checksum: str | None,
        parts: list[PartRecord],
        created: float = 0.0,
    ) -> VersionRecord:
        """Make a multi-part version visible: write its record (format 2) listing `parts` in order.

        Every part must be in the store with its recorded size (checked here, one stat each); the
        record is written like a one-file version's (atomic, never replaced: VersionExistsError).
        The parts' checksums must add up to `checksum`. Nothing is deleted on failure: the caller
        decides (`discard_parts`)."""
        if not is_kind(kind):
            raise FormatError(f"bad multi-part record: unknown kind {kind!r}", version=version)
        rec = VersionRecord(
            version=version,
            kind=kind,
            base=base,
            codec=codec,
            file=None,
            bytes=sum(p.bytes for p in parts),
            nnz=nnz,
            numel=numel,
            checksum=checksum,
            base_checksum=base_checksum,
            created=created or time.time(),
            parts=tuple(parts),
        )
        try:
            rec.validate()
        except (ValueError, TypeError) as exc:
            raise FormatError(f"bad multi-part record: {exc}", version=version) from None
        if version > MAX_VERSION:
            raise ValueError(f"version {version} exceeds {MAX_VERSION}")
        if self.io.exists(self._record_path(version)):
            raise VersionExistsError(f"version {version} already exists in store {self.io.uri}", version=version)
        self._check_parts_stored(parts, version)
        if self.io.is_local:
            fsync(self._path(DATA_DIR), directory=True)
            os.makedirs(self._path(VERSIONS_DIR), exist_ok=True)
        if self.signer is not None and self.signer.needs_digests:
            rec = dataclasses.replace(rec, parts=self._digested_parts(rec.parts))
        rec = self._sealed(rec)
        self._commit_record(rec, secrets.token_hex(8))
        self.records.remember(rec)
        self._advance_head(rec)
        return rec

    def adopt(self, rec: VersionRecord, paths: list[str]) -> VersionRecord:
        """Commit a version copied from another store (a mirror), under the names its record gives.

        `paths`: local files holding `rec.data_files`, in order, already verified by the caller against
        the source (its sha256, or its headers). Each is put under its recorded name and checked
        (size), then the record is written, last, as in `commit_file`: nothing of the version is visible
        before every file is in place. The record written carries every file's sha256 (computed here
        where the source's record had none). A version already committed here with the same checksum
        and files is returned as it is (a copy resumed after a crash); another one with that number
        raises VersionExistsError."""
        rec.validate()
        if len(paths) != len(rec.data_files):
            raise ValueError(f"version {rec.version} has {len(rec.data_files)} files, {len(paths)} given")
        existing = self.records.load_record(rec.version, fresh=True)
        if existing is not None:
            if existing.checksum == rec.checksum and existing.files == rec.files:
                return existing
            raise VersionExistsError(
                f"version {rec.version} already exists in store {self.io.uri} with other data "
                f"(checksum {existing.checksum}, the copy's {rec.checksum})",
                version=rec.version,
            )
        digests = []
        for data, path in zip(rec.data_files, paths):
            check_size(data, os.path.getsize(path), version=rec.version)
            digests.append(data.sha256 or file_sha256(path))
            self._put_data(rec.version, data.file, path, data.bytes, False, secrets.token_hex(8))
        if rec.parts:
            rec = dataclasses.replace(
                rec, parts=tuple(dataclasses.replace(p, sha256=d) for p, d in zip(rec.parts, digests))
            )
        else:
            rec = dataclasses.replace(rec, sha256=digests[0])
        self._commit_record(rec, secrets.token_hex(8))
        self.records.remember(rec)
        self._advance_head(rec)
        return rec

    def _sealed(self, rec: VersionRecord) -> VersionRecord:
        return rec if self.signer is None else self.signer.seal(rec)

    def _digested_parts(self, parts: tuple[PartRecord, ...]) -> tuple[PartRecord, ...]:
        """Every part with its sha256: those of a local store (whose ranks put them without one) hashed
        here, as stored, side by side (hashlib releases the GIL), before the record that binds them."""
        todo = [p for p in parts if p.sha256 is None]
        if not todo:
            return parts
        with ThreadPoolExecutor(min(8, len(todo)), thread_name_prefix="vllm-delta-sha256") as pool:
            digests = dict(zip((p.file for p in todo), pool.map(lambda p: file_sha256(self._path(p.file)), todo)))
        return tuple(p if p.sha256 is not None else dataclasses.replace(p, sha256=digests[p.file]) for p in parts)

    def _check_parts_stored(self, parts: Iterable[PartRecord], version: int) -> None:
        """Every part is in the store with its recorded size (one stat each), or IntegrityError."""
        for part in parts:
            try:
                size = self.io.size(self._path(part.file), f"checking {part.file}")
            except FileNotFoundError:
                raise IntegrityError(f"part {part.file} is not in the store", version=version) from None
            if size != part.bytes:
                raise IntegrityError(f"part {part.file} holds {size} bytes, not {part.bytes}", version=version)

    def discard_parts(self, parts: Iterable[PartRecord]) -> None:
        """Remove uploaded parts of a version that is not committed (best effort)."""
        try:
            self._remove_data(p.file for p in parts)
        except (OSError, DeltaError) as exc:
            log.warning("%s: could not remove uncommitted parts (retain removes them later): %s", self.io.uri, exc)

    def _check_file_holds(self, header: VersionHeader, local_path: str) -> None:
        """`local_path` holds the version `header` describes. A delta whose file holds exactly this
        header's text is not parsed again (its payload is checked by its readers; an MoE's header is
        ~2 MB of JSON); anything else, and an anchor (whose payload shapes are checked here), is
        opened and compared field by field, with that check's errors."""
        if header.kind != "anchor" and header_text(local_path) == header.to_json():
            return
        v = header.version
        with VersionFile(local_path, expect_version=v) as vf:
            stored = vf.header
        if (stored.kind, stored.base, stored.checksum, stored.base_checksum, stored.part) != (
            header.kind,
            header.base,
            header.checksum,
            header.base_checksum,
            header.part,
        ):
            raise IntegrityError(f"{local_path} does not hold the version its header describes", version=v)

    def _put_digested(
        self, version: int, file: str, src: str, nbytes: int, move: bool, token: str, *, digest: bool
    ) -> tuple[bool, str | None]:
        """`_put_data`, and with `digest` the file's sha256, hashed on a thread while the file uploads
        (remote readers verify their downloaded copies with it; hashing ~1 GB/s would otherwise add to
        every publish). A local store's readers use the file itself (checked by size, and by the staging
        checksums): no digest unless a signature binds it, and nothing added to the time to live."""
        if not digest:
            return self._put_data(version, file, src, nbytes, move, token), None
        if self.io.is_local:  # `move` may rename `src` away: hash the stored file
            consumed = self._put_data(version, file, src, nbytes, move, token)
            return consumed, file_sha256(self._path(file))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-delta-sha256") as pool:
            hashed = pool.submit(file_sha256, src)  # hashlib releases the GIL on large reads
            consumed = self._put_data(version, file, src, nbytes, move, token)
            return consumed, hashed.result()

    def _put_data(self, version: int, file: str, src: str, nbytes: int, move: bool, token: str) -> bool:
        """Put `src` at `file` (relative to the root), durable. True if `src` was renamed into place."""
        data = self._path(file)
        if not self.io.is_local:
            # An S3 object (and a bucket file) becomes visible only when its upload completes.
            size = self.io.upload(src, data, nbytes, f"uploading {file}")
            if size != nbytes:
                self.io.remove(data, f"removing {file}")
                raise IntegrityError(f"store kept {size} of {nbytes} bytes of {file}", version=version)
            return False
        os.makedirs(self._path(VERSIONS_DIR), exist_ok=True)
        tmp_name = f"{TMP_PREFIX}{token}.safetensors"
        return self.io.place(src, data, move=move, tmp_name=tmp_name, mode=_FILE_MODE)

    def _remove_data(self, files: Iterable[str]) -> None:
        for file in files:
            self.io.remove(self._path(file), f"removing {file}")

    def _advance_head(self, rec: VersionRecord) -> None:
        """After a commit: `head.json` names `rec`, unless it names a newer version that still exists
        (a head never moves back while its version is there). Best effort: the version is visible
        already, and readers find it without the head (the forward check, the next full listing)."""
        try:
            head = self.records.read_head()
            if (
                head is not None
                and head.version > rec.version
                and self.records.load_record(head.version, True) is not None
            ):
                return
            self.io.write_small(
                self._path(HEAD_NAME), StoreHead(rec.version, rec.checksum, time.time()).to_json().encode()
            )
        except (OSError, DeltaError) as exc:
            log.warning("%s: could not update %s after version %d: %s", self.io.uri, HEAD_NAME, rec.version, exc)

    def _commit_record(self, rec: VersionRecord, token: str) -> None:
        if self.io.is_local:
            self._commit_local_record(rec, token)
        else:
            self._commit_remote_record(rec)

    def _commit_local_record(self, rec: VersionRecord, token: str) -> None:
        versions_dir = self._path(VERSIONS_DIR)
        final = self._record_path(rec.version)
        tmp = os.path.join(versions_dir, f"{TMP_PREFIX}{token}.json")
        with open(tmp, "w") as f:
            f.write(rec.to_json())
            f.flush()
            os.fsync(f.fileno())
        try:
            # link() never replaces an existing name: of two racing publishers, one wins.
            os.link(tmp, final)
        except FileExistsError:
            raise VersionExistsError(
                f"version {rec.version} already exists in store {self.io.uri}", version=rec.version
            ) from None
        except OSError:  # no hard links on this filesystem: check, then rename
            if os.path.exists(final):
                os.remove(tmp)
                raise VersionExistsError(
                    f"version {rec.version} already exists in store {self.io.uri}", version=rec.version
                ) from None
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fsync(versions_dir, directory=True)

    def _commit_remote_record(self, rec: VersionRecord) -> None:
        # Object stores have no no-clobber rename here: check, then one small PUT. Two publishers of
        # one version can still race inside this window; the design has one publisher per store.
        v = rec.version
        if self.io.exists(self._record_path(v)):
            raise VersionExistsError(f"version {v} already exists in store {self.io.uri}", version=v)
        with self.io.guard(f"writing {VERSIONS_DIR}/{record_name(rec.version)}"):
            self.io.fs.pipe_file(self._record_path(rec.version), rec.to_json().encode(), **self.io.deadline())


__all__ = ["VersionWriter"]
