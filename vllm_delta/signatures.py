"""Ed25519 signatures of store versions: keys, what is signed, signing and verifying (a leaf).

The cryptography is PyCA `cryptography`'s Ed25519 (RFC 8032); nothing here is our own but the bytes
that are signed. A version's *claim* is what its signature binds:

    claim     = run, version, kind, base, base_checksum, checksum, codec, nnz, numel,
                files: [(file, bytes, sha256, part checksum | null), ...] in part order
    message   = b"vllm-delta version signature 1\\n"
                + JSON(claim, keys sorted, separators "," ":", ASCII)
    signature = Ed25519(private key, message)                     64 bytes
    stored    = {"alg": "ed25519", "key": base64(raw public key, 32 bytes),
                 "value": base64(signature)}                      (a record's `signature`)
    fingerprint(public key) = first 32 hex digits of sha256(raw public key)

So a signature holds for one version of one run only: another number, another base or base checksum,
other checksums or another file (each file's sha256, the bytes a reader verifies its copy against) is
another message, and an old signature replayed on a new record does not verify. The run is the store's
run identity (a random id each record carries, docs/FORMAT.md): a version signed for one run does not
verify as a version of another. The prefix keeps these messages apart from anything else the same key
might sign.

The public key travels with the signature, so anyone can check that a signature is sound and say who
made it (`vllm-delta verify`); trust is a separate question: a server verifies with the keys it was
given (`TrustedKeys`), never with the one a record brings.

Key files are PEM: the private key PKCS #8, unencrypted, written 0600 (`keygen`); the public key
SubjectPublicKeyInfo at PATH.pub. Errors: a key file that is not such a key is a `KeyFileError`
naming the file; a signature that is missing, does not parse, is by an untrusted key or does not verify
is a `SignatureError` (the caller names the version).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import KeyFileError, SignatureError, short

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

log = logging.getLogger(__name__)

ALGORITHM = "ed25519"
MESSAGE_PREFIX = b"vllm-delta version signature 1\n"
PUBLIC_SUFFIX = ".pub"
MAX_KEY_FILE = 64 * 1024  # a PEM key is a few hundred bytes: anything larger is not one

# PyCA `cryptography` is imported where a key or a signature is handled, not with this module: the store
# and the trainer import this module, and a machine that never signs nor checks (a GPU benchmark host)
# needs no more than before.


def _raw(key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class FileDigest:
    """One data file of a version as its signature binds it."""

    file: str  # path relative to the store root
    bytes: int
    sha256: str  # hex digest: what a reader verifies its copy against
    checksum: str | None = None  # a part's checksum (multi-part versions)


@dataclass(frozen=True)
class VersionClaim:
    """What one version's signature binds (the module docstring)."""

    run: str
    version: int
    kind: str
    base: int | None
    base_checksum: str | None
    checksum: str
    codec: str | None
    nnz: int
    numel: int
    files: tuple[FileDigest, ...]

    def message(self) -> bytes:
        doc: dict[str, object] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["files"] = [[f.file, f.bytes, f.sha256, f.checksum] for f in self.files]
        return MESSAGE_PREFIX + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def fingerprint(key: Ed25519PublicKey) -> str:
    """32 hex digits naming a public key (what logs, errors and `vllm-delta verify` show)."""
    return hashlib.sha256(_raw(key)).hexdigest()[:32]


@dataclass(frozen=True)
class Signature:
    """A parsed `signature` of a record: the signer's public key and the 64 signature bytes."""

    key: Ed25519PublicKey
    value: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    def to_plain(self) -> dict[str, str]:
        return {
            "alg": ALGORITHM,
            "key": base64.b64encode(_raw(self.key)).decode(),
            "value": base64.b64encode(self.value).decode(),
        }

    @classmethod
    def parse(cls, plain: Any) -> Signature:
        """A stored signature; SignatureError saying what does not parse."""
        if not isinstance(plain, Mapping):
            raise SignatureError(f"its signature does not parse: an object is expected, not {short(plain)}")
        if plain.get("alg") != ALGORITHM:
            raise SignatureError(f"its signature does not parse: alg {short(plain.get('alg'))}, not {ALGORITHM!r}")
        raw_key = _b64(plain.get("key"), "key", 32)
        value = _b64(plain.get("value"), "value", 64)
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            key = Ed25519PublicKey.from_public_bytes(raw_key)
        except ValueError:
            raise SignatureError("its signature does not parse: key is not an Ed25519 public key") from None
        return cls(key, value)

    def verify(self, claim: VersionClaim) -> None:
        """The signature is this key's over `claim` (SignatureError otherwise). Says nothing of trust."""
        _verify(self.key, self.value, claim, self.fingerprint)


def _b64(value: Any, what: str, size: int) -> bytes:
    if not isinstance(value, str):
        raise SignatureError(f"its signature does not parse: {what} is {short(value)}, not base64 text")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise SignatureError(f"its signature does not parse: {what} {short(value)} is not base64") from None
    if len(raw) != size:
        raise SignatureError(f"its signature does not parse: {what} holds {len(raw)} bytes, not {size}")
    return raw


def _verify(key: Ed25519PublicKey, value: bytes, claim: VersionClaim, who: str) -> None:
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(value, claim.message())
    except InvalidSignature:
        raise SignatureError(
            f"its signature by key {who} does not verify: the record's run, number, base or checksums are not "
            "what was signed (changed after signing, or a signature of another version)"
        ) from None


class SigningKey:
    """A private Ed25519 key loaded from a PEM file (`keygen` writes one)."""

    def __init__(self, key: Ed25519PrivateKey, path: str | None = None):
        self._key = key
        self.path = path
        self.public = key.public_key()
        self.fingerprint = fingerprint(self.public)

    def __repr__(self) -> str:
        return f"SigningKey({self.fingerprint}, path={self.path!r})"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        path = os.fspath(path)
        data = _read_key_file(path)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except TypeError:  # encrypted
            raise KeyFileError(f"{path}: the private key is encrypted; vllm-delta reads unencrypted PEM keys") from None
        except (ValueError, UnsupportedAlgorithm):
            raise KeyFileError(f"{path} is not a PEM private key (vllm-delta keygen writes one)") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} holds a {type(key).__name__.lstrip('_')}, not an Ed25519 private key")
        mode = os.stat(path).st_mode & 0o077
        if mode:
            log.warning("vllm-delta: the private key %s can be read by other users (mode %o): chmod 600 it", path, mode)
        return cls(key, path)

    def sign(self, claim: VersionClaim) -> Signature:
        return Signature(self.public, self._key.sign(claim.message()))


class TrustedKeys:
    """The public keys a server takes versions from, by fingerprint (several: key rotation)."""

    def __init__(self, keys: Iterable[Ed25519PublicKey], paths: Sequence[str] = ()):
        self.keys = {fingerprint(k): k for k in keys}
        self.paths = tuple(paths)
        if not self.keys:
            raise KeyFileError("no trusted key given")

    def __repr__(self) -> str:
        return f"TrustedKeys({', '.join(self.keys)})"

    @classmethod
    def load(cls, paths: Iterable[str | os.PathLike[str]]) -> TrustedKeys:
        names = [os.fspath(p) for p in paths]
        return cls([load_public_key(p) for p in names], names)

    def describe(self) -> str:
        return ", ".join(self.keys)

    def verify(self, signature: Signature, claim: VersionClaim) -> str:
        """The fingerprint of the trusted key that signed `claim`; SignatureError when the signer is not
        trusted or the signature does not verify. The trusted key itself verifies, not the record's."""
        who = signature.fingerprint
        key = self.keys.get(who)
        if key is None or _raw(key) != _raw(signature.key):
            raise SignatureError(f"it is signed by key {who}, which is not trusted here (trusted: {self.describe()})")
        _verify(key, signature.value, claim, who)
        return who


def load_public_key(path: str) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file; KeyFileError naming the file otherwise."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    data = _read_key_file(path)
    if b"PRIVATE KEY" in data:
        raise KeyFileError(
            f"{path} is a private key: trust its public key ({path}{PUBLIC_SUFFIX}), never share this one"
        )
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise KeyFileError(f"{path} is not a PEM public key (vllm-delta keygen writes one at PATH.pub)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__.lstrip('_')}, not an Ed25519 public key")
    return key


def _read_key_file(path: str) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > MAX_KEY_FILE:
            raise KeyFileError(f"{path} holds {size} bytes: not a key file")
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise KeyFileError(f"cannot read the key file {path}: {exc.strerror or exc}") from None


def keygen(path: str | os.PathLike[str]) -> SigningKey:
    """A new key pair: the private key at `path` (0600, created: never overwrites) and its public key at
    `path`.pub. Returns the private key. FileExistsError if either file exists (nothing is written)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = os.fspath(path)
    public_path = path + PUBLIC_SUFFIX
    for p in (path, public_path):
        if os.path.lexists(p):
            raise FileExistsError(f"{p} exists: vllm-delta keygen never overwrites a key")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _create(path, private_pem, 0o600)
    try:
        _create(public_path, public_pem, 0o644)
    except BaseException:
        os.remove(path)
        raise
    return SigningKey(key, path)


def _create(path: str, data: bytes, mode: int) -> None:
    # O_EXCL: never follows or replaces an existing name; the mode is set at creation (no window where
    # the private key is readable by others), then fixed against the umask.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "ALGORITHM",
    "FileDigest",
    "MESSAGE_PREFIX",
    "Signature",
    "SigningKey",
    "TrustedKeys",
    "VersionClaim",
    "fingerprint",
    "keygen",
    "load_public_key",
]
