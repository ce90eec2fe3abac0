"""Sharded publishing on real process groups (gloo, CPU, one process per rank; no mocks).

Every sharded run is compared with a single-process Publisher fed the same (gathered) weights: the
versions must be bit-identical (kinds, bases, every per-tensor and whole checksum, nnz, the
materialized tensors), and every reader (replay, materialize, inspect, the apply engine's staging)
must read the multi-part versions exactly like the one-file ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import sharded_workers as W
import torch
from safetensors.torch import load_file

from vllm_delta import Publisher, replay
from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.checksums import combine, to_hex, verify_partials
from vllm_delta.cli import main as cli
from vllm_delta.errors import SignatureError
from vllm_delta.format import Version, VersionFile
from vllm_delta.reconstruct import materialize
from vllm_delta.signatures import TrustedKeys, keygen
from vllm_delta.store import LEFTOVER_AGE_S, DeltaStore
from vllm_delta.store.cache import file_sha256
from vllm_delta.store.signed import check_signed
from vllm_delta.testing.apply_fixtures import Qwen3Spec, qwen3_layout
from vllm_delta.testing.sharded import run_ranks

pytestmark = pytest.mark.slow


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same_versions(sharded: DeltaStore, single: DeltaStore, world: int) -> None:
    """Bit-identical versions: records, headers, replayed tensors."""
    assert sharded.versions() == single.versions() and sharded.versions()
    for v in single.versions():
        a, b = sharded.record(v), single.record(v)
        assert (a.kind, a.base, a.codec, a.nnz, a.numel, a.checksum, a.base_checksum) == (
            b.kind,
            b.base,
            b.codec,
            b.nnz,
            b.numel,
            b.checksum,
            b.base_checksum,
        ), v
        assert a.file is None and len(a.parts) == world and b.file is not None
        with sharded.open(v) as va, single.open(v) as vb:
            assert isinstance(va, Version) and isinstance(vb, VersionFile)
            assert list(va.header.tensors) == list(vb.header.tensors)
            for name, e in vb.header.tensors.items():
                f = va.header.tensors[name]
                assert (f.shape, f.dtype, f.checksum, f.nnz) == (e.shape, e.dtype, e.checksum, e.nnz), (v, name)
        _, ta = replay(sharded, v)
        _, tb = replay(single, v)
        assert list(ta) == list(tb)
        for name in tb:
            assert torch.equal(bits(ta[name]), bits(tb[name])), (v, name)


def assert_materialize_equal(sharded: DeltaStore, single: DeltaStore, version: int, tmp_path) -> None:
    a = materialize(sharded, version, str(tmp_path / f"sharded-{version}"), progress=False)
    b = materialize(single, version, str(tmp_path / f"single-{version}"), progress=False)
    ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for name in tb:
        assert torch.equal(bits(ta[name]), bits(tb[name])), name


def engine_follows(store: DeltaStore, layout) -> list[str]:
    """An apply engine (vLLM's fused qkv / gate_up layout) loads version 0, then stages and commits
    every later version; returns its live checksum after each."""
    targets = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in zip(layout.targets, _target_shapes(layout))}
    engine = ApplyEngine(targets, layout, "cpu")
    live = []
    held = None
    for v in store.versions():
        plan = store.plan(held, v)
        files = [store.open(rec.version) for rec in plan]
        before = engine.live_sums()
        staged = engine.stage(files)
        verify_partials(before, [staged.partials], files[-1].header)
        engine.patch(staged)
        live.append(to_hex(combine(engine.live_sums().items())))
        held = v
    engine.close()
    return live


def _target_shapes(layout):
    return [TARGETS[n] for n in layout.targets]


TARGETS: dict[str, tuple[int, ...]] = {}


def qwen3_engine_layout(spec):
    targets, layout = qwen3_layout(
        Qwen3Spec(
            "t",
            spec.hidden_size,
            spec.num_layers,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            spec.vocab_size,
            spec.tie_word_embeddings,
        )
    )
    TARGETS.update(targets)
    return layout


# -- FSDP2 ------------------------------------------------------------------------------------------


def test_fsdp2_two_ranks_bit_identical_to_one_process(tmp_path, s3_server):
    s3 = {"uri": s3_server.uri("sharded-fsdp"), "options": s3_server.storage_options}
    infos = run_ranks(W.fsdp_train_and_publish, 2, (str(tmp_path), W.SPEC, 5, 3, "compact", 1e-5, s3))
    assert infos[0] == infos[1]
    assert [k for _, k, _, _, _ in infos[0]] == ["anchor", "delta", "delta", "anchor", "delta", "delta"]
    assert all(0 < nnz < 0.5 * 600_000 for _, k, _, _, nnz in infos[0] if k == "delta")
    sharded, single = DeltaStore(str(tmp_path / "sharded")), DeltaStore(str(tmp_path / "single"))
    assert_same_versions(sharded, single, world=2)
    # the same run through S3 (the real test server): the same versions
    remote = DeltaStore(s3["uri"], s3["options"], cache_dir=str(tmp_path / "cache"))
    assert_same_versions(remote, single, world=2)
    # readers: materialize reassembles a sharded anchor (0) and replays sharded deltas (5)
    assert_materialize_equal(sharded, single, 0, tmp_path)
    assert_materialize_equal(sharded, single, 5, tmp_path)
    # the apply engine stages multi-part versions (anchor, deltas, a newer anchor) like one-file ones
    layout = qwen3_engine_layout(W.SPEC)
    assert engine_follows(sharded, layout) == engine_follows(single, layout) == [c for _, _, _, c, _ in infos[0]]


def test_inspect_shows_parts(tmp_path, capsys):
    run_ranks(W.fsdp_train_and_publish, 2, (str(tmp_path), W.SPEC, 1, 3, "compact", 1e-5))
    uri = str(tmp_path / "sharded")
    assert cli(["inspect", uri, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["kind"], r["n_parts"]) for r in rows] == [(0, "anchor", 2), (1, "delta", 2)]
    assert rows[1]["file"] is None and [
        p["file"].endswith(f".part{i:05d}.safetensors") for i, p in enumerate(rows[1]["parts"])
    ] == [True, True]
    assert sum(p["bytes"] for p in rows[1]["parts"]) == rows[1]["bytes"]
    assert cli(["inspect", uri, "--version", "1"]) == 0
    out = capsys.readouterr().out
    assert "parts of version 1:" in out and ".part00001.safetensors" in out


def test_fsdp2_three_ranks_uneven_shards(tmp_path):
    # dim 0 of 500, 96, 160 and 64 rows: none divides by 3; raw codec
    infos = run_ranks(W.fsdp_train_and_publish, 3, (str(tmp_path), W.SPEC_UNEVEN, 3, 2, "raw", 1e-5))
    assert infos[0] == infos[1] == infos[2]
    sharded, single = DeltaStore(str(tmp_path / "sharded")), DeltaStore(str(tmp_path / "single"))
    assert_same_versions(sharded, single, world=3)
    with sharded.open(2) as vf:  # an anchor: every tensor in three row ranges
        rows = [p.header.part.rows["model.embed_tokens.weight"] for p in vf.parts]
        assert rows == [[0, 167], [167, 334], [334, 500]]


# -- plain DTensors, hand-sharded tensors, replicated tensors ----------------------------------------


def test_dtensors_hand_sharded_and_replicated_three_ranks(tmp_path):
    owned = run_ranks(W.mapping_publish, 3, (str(tmp_path),))
    # uneven and empty shards; replicated tensors owned once, spread over the ranks
    assert [o["a.weight"] for o in owned] == [[0, 3], [3, 6], [6, 7]]
    assert [o.get("b.weight") for o in owned] == [[0, 1], [1, 2], None]
    assert [o.get("hand.weight") for o in owned] == [[0, 4], None, [4, 9]]
    for name in ("norm.weight", "plain.bias", "scale"):
        assert sum(name in o for o in owned) == 1, name
    sharded, single = DeltaStore(str(tmp_path / "sharded")), DeltaStore(str(tmp_path / "single"))
    assert_same_versions(sharded, single, world=3)
    assert_materialize_equal(sharded, single, 4, tmp_path)


def test_every_wait_of_a_sharded_publish_is_a_named_phase(tmp_path):
    """The training thread's waits for the other ranks (agree, sums) and the upload thread's (the queue,
    the commit's wait for the other ranks' parts; rank 0's record written and marks read) are timed
    under their own names (issue 35: every millisecond of step end -> live in a named phase)."""
    timed = run_ranks(W.timed_publish, 3, (str(tmp_path),))
    for rank, t in enumerate(timed):
        assert t["kind"] == "delta"
        assert {"agree", "agree_wait", "detect", "sums", "sums_wait", "job", "queue"} <= set(t["publish"]), rank
        assert {"queued", "pack", "put_part", "commit", "commit_wait"} <= set(t["upload"]), rank
    assert {"record", "after_commit"} <= set(timed[0]["upload"])  # rank 0 writes the record, reads the marks
    assert "record" not in timed[1]["upload"]


def test_fsdp2_witness_sees_shards_and_plain_buffers_move():
    # sources._addresses reads DTensors' local shards and the plain tensors beside them (a buffer)
    for reused, counts in run_ranks(W.fsdp_witness, 2, ()):
        assert reused == [True, True, False, False]
        assert counts == (2, 3)


def test_part_rows_follow_a_new_split_after_a_reused_one(tmp_path):
    # A part's row ranges are built once per resolution of the model (Ownership.part_rows), not per
    # publish: a reused resolution keeps them, a new one (another split) replaces them.
    hits = run_ranks(W.reshard_publish, 2, (str(tmp_path),))
    assert hits == [1, 1]  # version 1 reused version 0's resolution; version 2 resolved again
    store = DeltaStore(str(tmp_path / "reshard"))
    for v, want in ((1, [[0, 4], [4, 9]]), (2, [[0, 6], [6, 9]])):
        with store.open(v) as vf:
            assert [p.header.part.rows.get("hand.weight") for p in vf.parts] == want, v


def test_a_mark_releases_a_gated_sharded_publisher_into_an_anchor(tmp_path):
    results = run_ranks(W.gated_mark, 2, (str(tmp_path),))
    assert [(r["kind"], r["base"]) for r in results] == [("anchor", None)] * 2, results
    assert results[0]["waited"] >= 0.4  # it did wait, until the mark
    rec = DeltaStore(str(tmp_path / "gated")).record(3)
    assert rec.kind == "anchor" and len(rec.parts) == 2


def test_rank_0_signs_the_record_that_binds_every_part(tmp_path):
    """A sharded publisher with a signing key on a local store: rank 0 hashes every part as stored and signs
    the record that lists them (the other ranks never read the key); the signature binds each part's file,
    size, checksum and sha256, so a part swapped for another is refused by a server with the key."""
    key = keygen(tmp_path / "trainer.key")
    results = run_ranks(W.signed_publish, 2, (str(tmp_path), str(key.path)))
    assert results[0] == results[1]
    store = DeltaStore(str(tmp_path / "signed"))
    trusted = TrustedKeys.load([f"{key.path}.pub"])
    assert len({store.record(v).run for v in range(4)}) == 1
    for v in range(4):
        rec = store.record(v)
        assert rec.checksum == results[0][v] and len(rec.parts) == 2
        for part in rec.parts:
            assert part.sha256 == file_sha256(os.path.join(store.uri, part.file))
        assert check_signed(rec, trusted) == key.fingerprint
    swapped = dataclasses.replace(
        store.record(2),
        parts=(store.record(2).parts[0], dataclasses.replace(store.record(2).parts[1], sha256="0" * 64)),
    )
    with pytest.raises(SignatureError, match=r"does not verify.*\(version 2\)"):
        check_signed(swapped, trusted)


def test_rank_0_leaves_only_after_every_rank_read_the_last_decision(tmp_path):
    """Rank 1 reads each commit decision a second after rank 0 wrote it: rank 0's Publisher closes first,
    and waits at its close until rank 1 says it read every answer (before, it deleted the last decision
    and took the store down with its process: rank 1 failed a version that was committed)."""
    results = run_ranks(W.late_reader, 2, (str(tmp_path),), timeout=120)
    assert results[0] == results[1]
    assert DeltaStore(str(tmp_path / "store")).versions() == [0, 1, 2]


def test_disagreements_and_upload_failures_three_ranks(tmp_path):
    seen = run_ranks(W.disagreements, 3, (str(tmp_path),))
    assert seen[0] == seen[1] == seen[2]  # the same message on every rank
    results = run_ranks(W.upload_failure, 3, (str(tmp_path),))
    assert all(r["kinds"] == ["anchor", "delta", "anchor", "anchor"] for r in results)
    # the parts of the failed versions were removed; only committed parts remain
    store = DeltaStore(str(tmp_path / "failure"))
    committed = sorted(os.path.basename(f) for rec in store.records() for f in rec.files)
    assert results[0]["files"] == committed and len(committed) == 4 * 3


def test_rank_killed_mid_publish(tmp_path):
    die_at = 2
    results = run_ranks(W.killed_rank, 3, (str(tmp_path), die_at), may_die=(2,))
    assert results[2] is None and all(r["waited_s"] < 60 for r in results[:2])
    uri = str(tmp_path / "killed")
    store = DeltaStore(uri)
    assert store.versions() == [0, 1]
    leftovers = [n for n in os.listdir(os.path.join(uri, "data")) if n.startswith(f"{die_at:010d}.")]
    assert leftovers  # the killed rank's part (at least) is there, invisible
    # a restarted job publishes the same version number: a fresh anchor that no leftover is mistaken for
    want = {n: t for n, t in W._full(die_at).items() if n in ("a.weight", "hand.weight", "plain.bias", "scale")}
    with Publisher(uri, anchor_every=100) as pub:
        info = pub.publish(want, version=die_at)
        assert info.kind == "anchor"
    assert store.versions() == [0, 1, die_at]
    assert not set(leftovers) & {os.path.basename(f) for f in store.record(die_at).files}
    _, tensors = replay(store, die_at)
    assert all(torch.equal(bits(tensors[n]), bits(want[n].to(torch.bfloat16))) for n in want)
    # retention removes the dead publish's parts once they are old
    old = time.time() - LEFTOVER_AGE_S - 60
    for name in leftovers:
        os.utime(os.path.join(uri, "data", name), (old, old))
    store.retain(10)
    assert not set(leftovers) & set(os.listdir(os.path.join(uri, "data")))
    assert store.versions() == [0, 1, die_at]
