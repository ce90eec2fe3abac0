"""Signed records: the claim a record's signature binds, sealing a record as it is committed, and
checking a record's signature (the cryptography and the signed bytes: signatures.py).

A record's claim is its run, number, kind, base and base checksum, checksum, codec, nnz, numel and every
data file with its size, sha256 and (parts) checksum (`claim_of`). A signed record therefore carries a
sha256 for every file, on local stores too, and its `run`: the store's run identity, a random id the
first Publisher of a store draws and later Publishers of the store continue (`RUN_RE` in records.py).

No I/O here: the writer seals (writes.py), the server checks (vllm/shared/trust.py), `vllm-delta
verify` reports (`signature_state`).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Literal

from ..errors import SignatureError
from ..signatures import FileDigest, Signature, SigningKey, TrustedKeys, VersionClaim
from .records import VersionRecord


def new_run_id() -> str:
    """A fresh run identity: 32 random hex digits."""
    return secrets.token_hex(16)


def claim_of(rec: VersionRecord) -> VersionClaim:
    """What `rec`'s signature binds. SignatureError when the record cannot be signed or checked: no run,
    or a data file without a sha256 (a signature binds every file's digest)."""
    if rec.run is None:
        raise SignatureError("the record carries no run identity, which a signature binds")
    files = []
    checksums = [p.checksum for p in rec.parts] if rec.parts else [None]
    for data, checksum in zip(rec.data_files, checksums):
        if data.sha256 is None:
            raise SignatureError(f"data file {data.file} has no sha256 in the record, which a signature binds")
        files.append(FileDigest(data.file, data.bytes, data.sha256, checksum))
    # every field of the claim but its files is the record's field of the same name
    same = {f.name: getattr(rec, f.name) for f in dataclasses.fields(VersionClaim) if f.name != "files"}
    return VersionClaim(**same, files=tuple(files))


@dataclass(frozen=True)
class RecordSigner:
    """What a Publisher stamps on every record it commits: the store's run identity, and its signature
    when it holds a key (`VersionWriter.signer`)."""

    run: str
    key: SigningKey | None = None

    @property
    def needs_digests(self) -> bool:
        """Every data file needs a sha256 in the record (the signature binds them), on local stores too."""
        return self.key is not None

    def seal(self, rec: VersionRecord) -> VersionRecord:
        """`rec` with the run, and signed when there is a key (its files' sha256 filled in already)."""
        rec = dataclasses.replace(rec, run=self.run, signature=None)
        if self.key is None:
            return rec
        return dataclasses.replace(rec, signature=self.key.sign(claim_of(rec)).to_plain())


def signature_of(rec: VersionRecord) -> Signature | None:
    """The record's signature, parsed (None: unsigned); SignatureError naming the version otherwise."""
    if rec.signature is None:
        return None
    try:
        return Signature.parse(rec.signature)
    except SignatureError as exc:
        raise SignatureError(f"signature check failed: {exc}", version=rec.version) from None


def check_signed(rec: VersionRecord, trusted: TrustedKeys) -> str:
    """The fingerprint of the trusted key that signed `rec` over its own claim; SignatureError naming the
    version and what is wrong otherwise (unsigned, unparsable, untrusted signer, a signature over
    anything else)."""
    signature = signature_of(rec)
    if signature is None:
        raise SignatureError(
            f"signature check failed: it is not signed, and this server takes only versions signed by a "
            f"trusted key ({trusted.describe()})",
            version=rec.version,
        )
    try:
        return trusted.verify(signature, claim_of(rec))
    except SignatureError as exc:
        raise SignatureError(f"signature check failed: {exc}", version=rec.version) from None


SignatureStatus = Literal["unsigned", "bad", "signed", "untrusted"]


@dataclass(frozen=True)
class SignatureState:
    """What `vllm-delta verify` says of one version."""

    version: int
    status: SignatureStatus  # "signed": sound (and trusted, when keys were given)
    key: str | None  # the signer's fingerprint, when the signature parses
    run: str | None
    reason: str | None  # why "bad" or "untrusted"

    @property
    def ok(self) -> bool:
        return self.status == "signed"


def signature_state(rec: VersionRecord, trusted: TrustedKeys | None = None) -> SignatureState:
    """Whether `rec`'s signature is sound (verified with the key it names) and, given `trusted`, by a
    trusted key."""

    def state(status: SignatureStatus, key: str | None = None, reason: str | None = None) -> SignatureState:
        return SignatureState(rec.version, status, key, rec.run, reason)

    try:
        signature = signature_of(rec)
    except SignatureError as exc:
        return state("bad", reason=str(exc))
    if signature is None:
        return state("unsigned")
    try:
        signature.verify(claim_of(rec))
    except SignatureError as exc:
        return state("bad", signature.fingerprint, str(exc))
    if trusted is not None and signature.fingerprint not in trusted.keys:
        return state("untrusted", signature.fingerprint, f"key {signature.fingerprint} is not among the trusted keys")
    return state("signed", signature.fingerprint)


__all__ = [
    "RecordSigner",
    "SignatureState",
    "check_signed",
    "claim_of",
    "new_run_id",
    "signature_of",
    "signature_state",
]
