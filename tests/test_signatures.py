"""The signing leaf (vllm_delta/signatures.py): key files, what a signature binds, and every bad input a
clear error naming the file. No store here (tests/store/test_signed_store.py)."""

from __future__ import annotations

import base64
import dataclasses
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from vllm_delta.errors import KeyFileError, SignatureError
from vllm_delta.signatures import (
    MESSAGE_PREFIX,
    FileDigest,
    Signature,
    SigningKey,
    TrustedKeys,
    VersionClaim,
    keygen,
    load_public_key,
)

CLAIM = VersionClaim(
    run="0123456789abcdef0123456789abcdef",
    version=7,
    kind="delta",
    base=6,
    base_checksum="00000000000000aa",
    checksum="00000000000000bb",
    codec="chunked",
    nnz=12,
    numel=1000,
    files=(FileDigest("data/0000000007.delta.0011223344556677.safetensors", 345, "c" * 64),),
)


@pytest.fixture
def key(tmp_path) -> SigningKey:
    return keygen(tmp_path / "trainer.key")


def test_keygen_writes_a_private_key_0600_and_its_public_key(tmp_path):
    path = tmp_path / "trainer.key"
    key = keygen(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f"{path}.pub").st_mode) == 0o644
    assert open(path).read().startswith("-----BEGIN PRIVATE KEY-----")
    assert open(f"{path}.pub").read().startswith("-----BEGIN PUBLIC KEY-----")
    again = SigningKey.load(path)
    assert again.fingerprint == key.fingerprint and len(key.fingerprint) == 32
    trusted = TrustedKeys.load([f"{path}.pub"])
    assert list(trusted.keys) == [key.fingerprint]


def test_keygen_never_overwrites(tmp_path, key):
    before = open(key.path, "rb").read()
    with pytest.raises(FileExistsError, match="never overwrites"):
        keygen(key.path)
    os.remove(f"{key.path}.pub")
    with pytest.raises(FileExistsError):  # the private key alone is enough to refuse
        keygen(key.path)
    assert open(key.path, "rb").read() == before and not os.path.exists(f"{key.path}.pub")


def test_a_signature_verifies_over_its_claim_only(key):
    sig = key.sign(CLAIM)
    trusted = TrustedKeys([key.public])
    assert trusted.verify(sig, CLAIM) == key.fingerprint
    sig.verify(CLAIM)
    # Every bound field: another value is another message, and the signature does not hold for it.
    others = {
        "run": "another-run",
        "version": 8,
        "kind": "anchor",
        "base": 5,
        "base_checksum": "00000000000000ab",
        "checksum": "00000000000000bc",
        "codec": "raw",
        "nnz": 13,
        "numel": 1001,
        "files": (dataclasses.replace(CLAIM.files[0], sha256="d" * 64),),
    }
    for field, value in others.items():
        other = dataclasses.replace(CLAIM, **{field: value})
        assert other.message() != CLAIM.message()
        with pytest.raises(SignatureError, match=f"by key {key.fingerprint} does not verify"):
            trusted.verify(sig, other)
    moved = dataclasses.replace(CLAIM, files=(dataclasses.replace(CLAIM.files[0], bytes=346),))
    with pytest.raises(SignatureError, match="does not verify"):
        sig.verify(moved)


def test_the_message_is_canonical_and_domain_separated():
    msg = CLAIM.message()
    assert msg.startswith(MESSAGE_PREFIX)
    assert msg == dataclasses.replace(CLAIM).message()
    assert b" " not in msg[len(MESSAGE_PREFIX) :]  # compact, sorted keys: one byte string per claim


def test_a_signature_round_trips_through_its_stored_form(key):
    sig = key.sign(CLAIM)
    plain = sig.to_plain()
    assert plain["alg"] == "ed25519" and len(base64.b64decode(plain["value"])) == 64
    again = Signature.parse(plain)
    assert again.value == sig.value and again.fingerprint == key.fingerprint
    again.verify(CLAIM)


def test_another_key_is_not_trusted_even_when_it_verifies(key, tmp_path):
    other = keygen(tmp_path / "other.key")
    sig = other.sign(CLAIM)
    sig.verify(CLAIM)  # sound ...
    with pytest.raises(SignatureError, match=f"signed by key {other.fingerprint}, which is not trusted"):
        TrustedKeys([key.public]).verify(sig, CLAIM)  # ... but not by a trusted key
    # A signature naming a trusted key's fingerprint verifies with the trusted key, never the record's.
    forged = Signature(other.public, key.sign(CLAIM).value)
    with pytest.raises(SignatureError):
        TrustedKeys([key.public]).verify(forged, CLAIM)
    # Several trusted keys (rotation): either one's signatures are taken.
    both = TrustedKeys([key.public, other.public])
    assert both.verify(sig, CLAIM) == other.fingerprint
    assert both.verify(key.sign(CLAIM), CLAIM) == key.fingerprint


@pytest.mark.parametrize(
    "plain, what",
    [
        ("not an object", "an object is expected"),
        ({"alg": "rsa", "key": "", "value": ""}, "alg 'rsa'"),
        ({"alg": "ed25519", "key": 12, "value": "x"}, "key is 12, not base64 text"),
        ({"alg": "ed25519", "key": "%%%", "value": "x"}, "key '%%%' is not base64"),
        ({"alg": "ed25519", "key": base64.b64encode(b"short").decode(), "value": ""}, "key holds 5 bytes, not 32"),
    ],
)
def test_a_signature_that_does_not_parse_says_what(plain, what):
    with pytest.raises(SignatureError, match="does not parse") as info:
        Signature.parse(plain)
    assert what in str(info.value)


def test_a_truncated_signature_value_does_not_parse(key):
    plain = key.sign(CLAIM).to_plain()
    plain["value"] = base64.b64encode(base64.b64decode(plain["value"])[:63]).decode()
    with pytest.raises(SignatureError, match="value holds 63 bytes, not 64"):
        Signature.parse(plain)


def test_key_files_that_are_not_keys_are_refused_naming_the_file(tmp_path, key):
    garbage = tmp_path / "garbage.pub"
    garbage.write_text("hello\n")
    with pytest.raises(KeyFileError, match=f"{garbage} is not a PEM public key"):
        TrustedKeys.load([str(garbage)])
    with pytest.raises(KeyFileError, match=f"{garbage} is not a PEM private key"):
        SigningKey.load(garbage)
    with pytest.raises(KeyFileError, match=f"{key.path} is a private key: trust its public key"):
        load_public_key(str(key.path))
    with pytest.raises(KeyFileError, match="is not a PEM private key"):
        SigningKey.load(f"{key.path}.pub")
    missing = tmp_path / "missing.pub"
    with pytest.raises(KeyFileError, match=f"cannot read the key file {missing}"):
        TrustedKeys.load([str(missing)])
    huge = tmp_path / "huge.pub"
    huge.write_bytes(b"x" * (1 << 20))
    with pytest.raises(KeyFileError, match=f"{huge} holds 1048576 bytes: not a key file"):
        load_public_key(str(huge))
    with pytest.raises(KeyFileError, match="no trusted key"):
        TrustedKeys([])


def test_keys_of_another_algorithm_are_refused(tmp_path):
    ecdsa = ec.generate_private_key(ec.SECP256R1())
    priv, pub = tmp_path / "ec.key", tmp_path / "ec.pub"
    priv.write_bytes(
        ecdsa.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    pub.write_bytes(
        ecdsa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(KeyFileError, match="not an Ed25519 private key"):
        SigningKey.load(priv)
    with pytest.raises(KeyFileError, match="not an Ed25519 public key"):
        load_public_key(str(pub))


def test_an_encrypted_private_key_is_refused(tmp_path, key):
    raw = serialization.load_pem_private_key(open(key.path, "rb").read(), password=None)
    enc = tmp_path / "enc.key"
    enc.write_bytes(
        raw.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    with pytest.raises(KeyFileError, match=f"{enc}: the private key is encrypted"):
        SigningKey.load(enc)
