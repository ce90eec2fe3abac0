"""Signed versions in real stores (a directory and the real S3 test server): a signing Publisher, the
records' signatures and run identity, `vllm-delta keygen` and `verify`, what a server's trust check
refuses (vllm/shared/trust.py, plan.py) with nothing staged, damaged records, old stores, the mirror.
Sharded signing: tests/trainer/test_sharded.py; on real vLLM servers: tests/vllm/test_fleet.py and
tests/vllm/test_vllm_engine.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import uuid

import pytest
import torch

from vllm_delta import DeltaStore, Publisher, replay
from vllm_delta.cli import main as cli
from vllm_delta.errors import IntegrityError, KeyFileError, SignatureError, http_status
from vllm_delta.mirror import MirrorOptions, mirror
from vllm_delta.signatures import SigningKey, TrustedKeys, keygen
from vllm_delta.store import VersionRecord
from vllm_delta.store.signed import RecordSigner, check_signed, signature_state
from vllm_delta.trainer import PublisherOptions, StoreOptions
from vllm_delta.vllm.shared.plan import plan_update
from vllm_delta.vllm.shared.trust import TrustPolicy, check_start

OLD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "store_fcd5eec")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, SigningKey]:
    root = tmp_path_factory.mktemp("keys")
    return {name: keygen(root / f"{name}.key") for name in ("trainer", "other")}


def trusted(*keys: SigningKey) -> TrustedKeys:
    return TrustedKeys.load([f"{k.path}.pub" for k in keys])


def open_store(kind: str, tmp_path, s3_server=None) -> DeltaStore:
    name = f"run-{uuid.uuid4().hex[:8]}"
    if kind == "local":
        return DeltaStore(str(tmp_path / name))
    return DeltaStore(s3_server.uri(name), s3_server.storage_options, cache_dir=str(tmp_path / f"cache-{name}"))


def publish(store: DeltaStore, versions, *, key=None, anchor_every: int = 3, seed: int = 0) -> dict[int, str]:
    """Versions of two small tensors (an anchor every `anchor_every`); their checksums."""
    gen = torch.Generator().manual_seed(seed)
    w = {"a": torch.randn(64, 48, generator=gen).bfloat16(), "b": torch.randn(96, generator=gen).bfloat16()}
    out = {}
    opts = PublisherOptions(store=StoreOptions(storage_options=store.storage_options or None))
    with Publisher(store.uri, anchor_every=anchor_every, options=opts, signing_key=key) as pub:
        for v in versions:
            for t in w.values():
                t.view(-1)[(v * 7 + seed) % t.numel() :: 11] += 0.25
            out[v] = pub.publish(w, version=v).checksum
    return out


def flip_tail_bytes(path: str, n: int) -> None:
    """Damage the last `n` bytes of a file in place (same size)."""
    with open(path, "r+b") as f:
        f.seek(-n, os.SEEK_END)
        tail = f.read(n)
        f.seek(-n, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))


def rewrite(store: DeltaStore, rec: VersionRecord) -> None:
    """Replace a committed record in place, as someone with write access to the bucket could."""
    store.io.write_small(store.record_reader.record_path(rec.version), rec.to_json().encode())
    store.record_reader.forget(rec.version)


def verify_cli(store: DeltaStore, capsys, *args: str) -> tuple[int, list[dict]]:
    argv = ["verify", store.uri, "--json", *args]
    if store.storage_options:
        argv += ["--storage-options", json.dumps(store.storage_options)]
    capsys.readouterr()
    code = cli(argv)
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_signing_publisher_signs_every_version(kind, tmp_path, s3_server, keys, capsys):
    store = open_store(kind, tmp_path, s3_server)
    sums = publish(store, range(5), key=keys["trainer"].path)
    recs = store.records()
    assert [r.kind for r in recs] == ["anchor", "delta", "delta", "anchor", "delta"]
    runs = {r.run for r in recs}
    assert len(runs) == 1 and None not in runs  # one run, the store's
    for rec in recs:
        assert rec.checksum == sums[rec.version]
        assert all(d.sha256 for d in rec.data_files)  # on a local store too: the signature binds them
        assert check_signed(rec, trusted(keys["trainer"])) == keys["trainer"].fingerprint
        with pytest.raises(SignatureError, match=f"signed by key {keys['trainer'].fingerprint}, which is not trusted"):
            check_signed(rec, trusted(keys["other"]))
    # What a server with the trainer's key takes: the whole chain, in one plan.
    plan = plan_update(store, None, None, 4, allow_reanchor=True, trust=TrustPolicy(trusted(keys["trainer"])))
    assert plan.versions == [3, 4]
    code, rows = verify_cli(store, capsys)
    assert code == 0 and [(r["version"], r["status"], r["key"]) for r in rows] == [
        (v, "signed", keys["trainer"].fingerprint) for v in range(5)
    ]
    code, rows = verify_cli(store, capsys, "--trusted-key", f"{keys['other'].path}.pub", "--version", "2")
    assert code == 1 and rows[0]["status"] == "untrusted" and rows[0]["version"] == 2
    code, _ = verify_cli(store, capsys, "--trusted-key", f"{keys['trainer'].path}.pub")
    assert code == 0


def test_a_publisher_without_a_key_writes_unsigned_versions(tmp_path, keys, capsys):
    store = open_store("local", tmp_path)
    publish(store, range(2))
    for rec in store.records():
        assert rec.signature is None and rec.run is not None and rec.sha256 is None  # as before, plus the run
        state = signature_state(rec)
        assert (state.status, state.key, state.ok) == ("unsigned", None, False)
        with pytest.raises(SignatureError, match=r"signature check failed: it is not signed.*\(version \d\)"):
            check_signed(rec, trusted(keys["trainer"]))
    code, rows = verify_cli(store, capsys)
    assert code == 1 and {r["status"] for r in rows} == {"unsigned"}
    capsys.readouterr()
    assert cli(["verify", store.uri]) == 1
    assert "0 of 2 version(s) signed" in capsys.readouterr().out


def test_the_run_is_the_stores_own(tmp_path, keys):
    """A Publisher continues the run of the store's newest record (a trainer restarted on its store), with
    another key too (rotation); another store has another run."""
    store = open_store("local", tmp_path)
    publish(store, range(2), key=keys["trainer"].path)
    publish(store, range(2, 4), key=keys["other"].path, seed=1)
    runs = {r.run for r in store.records()}
    assert len(runs) == 1
    signers = [signature_state(r).key for r in store.records()]
    assert signers == [keys["trainer"].fingerprint] * 2 + [keys["other"].fingerprint] * 2
    rotated = TrustPolicy(trusted(keys["trainer"], keys["other"]))
    assert rotated.check(store.chain(3)) == runs.pop()
    other = open_store("local", tmp_path)
    publish(other, range(1), key=keys["trainer"].path)
    assert other.record(0).run != store.record(0).run


def test_a_key_file_that_is_not_a_key_fails_the_publisher_naming_it(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    store = open_store("local", tmp_path)
    with pytest.raises(KeyFileError, match=f"{bad} is not a PEM private key"):
        Publisher(store.uri, signing_key=bad)
    assert store.versions() == []


def test_damaged_and_replayed_signatures_are_refused_naming_the_version(tmp_path, keys, capsys):
    store = open_store("local", tmp_path)
    publish(store, range(4), key=keys["trainer"].path)
    policy = trusted(keys["trainer"])
    one, two = store.record(1), store.record(2)
    # Signed over other checksums: a record whose checksum (or a file's digest) was changed after signing.
    rewrite(store, dataclasses.replace(two, checksum="0123456789abcdef"))
    with pytest.raises(SignatureError, match=r"does not verify.*\(version 2\)"):
        check_signed(store.record(2, fresh=True), policy)
    # A signature of another version replayed on this one.
    rewrite(store, dataclasses.replace(two, signature=one.signature))
    with pytest.raises(SignatureError, match=r"does not verify.*\(version 2\)"):
        check_signed(store.record(2, fresh=True), policy)
    # A signature that does not parse: the record still reads (readers without keys are not affected).
    rewrite(store, dataclasses.replace(two, signature={"alg": "ed25519", "key": "AAAA", "value": 7}))
    assert store.versions() == [0, 1, 2, 3]
    with pytest.raises(SignatureError, match=r"does not parse: key holds 3 bytes.*\(version 2\)"):
        check_signed(store.record(2, fresh=True), policy)
    code, rows = verify_cli(store, capsys)
    assert code == 1 and [r["status"] for r in rows] == ["signed", "signed", "bad", "signed"]
    assert "does not parse" in rows[2]["reason"]
    # The version signed for another run (the same key, another store): refused by a server serving this run.
    rewrite(store, two)
    foreign = RecordSigner("another-run", keys["trainer"]).seal(store.record(3))
    rewrite(store, foreign)
    server = TrustPolicy(policy)
    server.learn(store, 2, two.checksum)
    assert server.run == one.run
    with pytest.raises(SignatureError, match=r"signed for run another-run, and this server serves run .*\(version 3\)"):
        plan_update(store, 2, two.checksum, 3, trust=server)


def test_a_plan_is_checked_before_anything_else(tmp_path, keys):
    """An unsigned version (a publisher without a key), one signed by another key: the plan refuses it,
    403, naming the signature; what is trusted plans as before; a start-up's whole chain is checked."""
    store = open_store("local", tmp_path)
    sums = publish(store, range(3), key=keys["trainer"].path)
    publish(store, [3], seed=2)  # unsigned, continuing the run
    publish(store, [4], key=keys["other"].path, seed=3)  # a new Publisher: an anchor, signed by another key
    server = TrustPolicy(trusted(keys["trainer"]))
    assert plan_update(store, 1, sums[1], 2, trust=server).versions == [2]
    with pytest.raises(SignatureError, match=r"it is not signed.*\(version 3\)") as unsigned:
        plan_update(store, 2, sums[2], 3, trust=server)
    assert http_status(unsigned.value) == 403
    with pytest.raises(SignatureError, match=rf"signed by key {keys['other'].fingerprint}, which is not trusted"):
        plan_update(store, 2, sums[2], 4, trust=server)
    assert plan_update(store, 2, sums[2], 3).versions == [3]  # without trusted keys: as today
    check_start(trusted(keys["trainer"]), store.chain(2), "store S")
    with pytest.raises(SignatureError, match=r"does not start at version 3 of store S: .*not signed.*\(version 3\)"):
        check_start(trusted(keys["trainer"]), store.chain(3), "store S")


def test_the_trust_policy_pins_one_run(keys, tmp_path):
    a, b = open_store("local", tmp_path), open_store("local", tmp_path)
    publish(a, range(2), key=keys["trainer"].path)
    publish(b, range(2), key=keys["trainer"].path)
    policy = TrustPolicy(trusted(keys["trainer"]))
    assert policy.run is None
    assert policy.check([a.record(1)]) == a.record(1).run == policy.run  # the first plan pins it
    with pytest.raises(SignatureError, match=r"signed for run .*\(version 0\)"):
        policy.check([b.record(0)])  # the same key, another store's run
    mixed = TrustPolicy(trusted(keys["trainer"]))
    with pytest.raises(SignatureError, match="signed for run"):
        mixed.check([a.record(0), b.record(1)])
    assert mixed.run is None  # nothing pinned by a refused plan


def test_a_local_file_replaced_under_its_signed_record_is_refused(tmp_path, keys):
    store = open_store("local", tmp_path)
    publish(store, range(3), key=keys["trainer"].path)
    rec = store.record(2)
    flip_tail_bytes(os.path.join(store.uri, rec.file), n=8)
    checked = DeltaStore(store.uri, check_digests=True)  # what a server with trusted keys opens
    with pytest.raises(IntegrityError, match=rf"data file {rec.file} does not have the sha256"):
        checked.open(2)
    assert checked.open(1).header.version == 1


def test_old_stores_read_and_a_signing_publisher_goes_on_top(tmp_path, keys, capsys):
    root = tmp_path / "old"
    shutil.copytree(OLD, root)
    store = DeltaStore(str(root))
    assert {signature_state(r).status for r in store.records()} == {"unsigned"}
    assert all(r.run is None for r in store.records())
    _, tensors = replay(store, 4)
    with Publisher(store, signing_key=keys["trainer"].path) as pub:
        info = pub.publish(tensors, version=5)
    rec = store.record(5)
    assert info.kind == "anchor" and rec.run is not None
    assert check_signed(rec, trusted(keys["trainer"])) == keys["trainer"].fingerprint
    code, rows = verify_cli(store, capsys)
    assert code == 1 and [r["status"] for r in rows] == ["unsigned"] * 5 + ["signed"]


def test_keygen_cli(tmp_path, capsys):
    path = tmp_path / "k"
    assert cli(["keygen", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"fingerprint {SigningKey.load(path).fingerprint}" in out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.exists(f"{path}.pub")
    assert cli(["keygen", str(path)]) == 1
    assert "never overwrites" in capsys.readouterr().err
    assert cli(["verify", str(tmp_path / "nostore"), "--trusted-key", str(path)]) == 1
    assert f"{path} is a private key" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_the_mirror_copies_signatures(kind, tmp_path, s3_server, keys, capsys):
    src = open_store(kind, tmp_path, s3_server)
    publish(src, range(4), key=keys["trainer"].path)
    dst = open_store("local", tmp_path)
    out = mirror(src, dst, options=MirrorOptions(everything=True))
    assert out is not None and out.copied
    assert dst.versions() == src.versions()
    for v in dst.versions():
        a, b = src.record(v), dst.record(v)
        assert (b.run, b.signature) == (a.run, a.signature)
        assert check_signed(b, trusted(keys["trainer"])) == keys["trainer"].fingerprint
    code, _ = verify_cli(dst, capsys, "--trusted-key", f"{keys['trainer'].path}.pub")
    assert code == 0
