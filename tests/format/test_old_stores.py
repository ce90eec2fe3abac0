"""A store written before the chunked codec (commit fcd5eec: format-1 compact deltas from a Publisher,
a format-2 multi-part compact delta) reads and serves unchanged, and new versions go on top of it.
The store in tests/data/store_fcd5eec was written by that commit's code (tests/data/make_old_store.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import vllm_delta
from vllm_delta import Publisher, replay
from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.apply.layout import Layout
from vllm_delta.checksums import combine, to_hex
from vllm_delta.format import COLUMNS_FORMAT_VERSION, STREAMS_FORMAT_VERSION
from vllm_delta.reconstruct import open_chain
from vllm_delta.store import DeltaStore

OLD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "store_fcd5eec")


@pytest.fixture
def old_store(tmp_path) -> tuple[DeltaStore, dict]:
    """A private copy of the old store (some tests write to it) and what its writer recorded."""
    root = tmp_path / "store"
    shutil.copytree(OLD, root)
    with open(root / "expected.json") as f:
        expected = json.load(f)
    return DeltaStore(str(root)), expected


def _bits(tensors: dict) -> dict:
    return {n: t.view(torch.int16) for n, t in tensors.items()}


def test_every_old_version_replays_bit_exact(old_store):
    store, expected = old_store
    assert store.versions() == [0, 1, 2, 3, 4]
    assert store.record(4).parts is not None  # the multi-part version
    for v in range(5):
        got_v, tensors = replay(store, v)
        assert got_v == v
        assert vllm_delta.checksum(tensors) == expected["checksums"][str(v)], v
        with store.open(v) as vf:
            assert vf.header.format_version < STREAMS_FORMAT_VERSION
            assert vf.header.kind == "anchor" or vf.header.codec == "compact"
    want = load_file(os.path.join(OLD, "expected_v4.safetensors"))
    _, tensors = replay(store, 4)
    got, ref = _bits(tensors), _bits(want)
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.mark.parametrize("hops", ["one update", "one by one"])
def test_old_versions_stage_and_commit_bit_exact(old_store, hops):
    """The apply engine (what a server runs) catches up from the anchor to version 4 over the old
    deltas, in one update or version by version, and ends on the writer's weights."""
    store, expected = old_store
    files = open_chain(store, 4)
    anchor = files[0]
    targets = {n: anchor.dense(n).clone() for n in anchor.header.tensors}
    engine = ApplyEngine(targets, Layout.identity({n: tuple(t.shape) for n, t in targets.items()}), "cpu")
    steps = [files[1:]] if hops == "one update" else [[f] for f in files[1:]]
    for group in steps:
        staged = engine.stage(group)
        engine.patch(staged)
        assert to_hex(combine(engine.live_sums().items())) == expected["checksums"][str(staged.version)]
    want = _bits(load_file(os.path.join(OLD, "expected_v4.safetensors")))
    assert all(torch.equal(targets[n].view(torch.int16), want[n]) for n in want)
    engine.close()


def test_new_versions_go_on_top_of_an_old_store(old_store):
    """A Publisher of this release continues an old store: its first version is an anchor, its deltas
    are chunked (format 4), and a reader replays the mixed store."""
    store, _ = old_store
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.training import bf16_image, build_master_model, train_steps

    spec = TinyModelSpec(
        arch="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        vocab_size=256,
    )
    model = build_master_model(spec, seed=9)
    with Publisher(store, anchor_every=100) as pub:
        first = pub.publish(model)
        for _ in train_steps(model, 2, lr=1e-4, seed=9):
            last = pub.publish(model)
    assert (first.version, first.kind, last.version, last.kind) == (5, "anchor", 7, "delta")
    with store.open(7) as vf:
        assert vf.header.codec == "chunked" and vf.header.format_version == COLUMNS_FORMAT_VERSION
    _, tensors = replay(store, 7)
    assert vllm_delta.checksum(tensors) == vllm_delta.checksum(bf16_image(model))
    _, old = replay(store, 3)  # the old chain still reads
    assert vllm_delta.checksum(old) == store.record(3).checksum


@pytest.mark.parametrize("columns", [True, False], ids=["format-4", "format-3"])
def test_a_publisher_writes_format_3_for_readers_before_format_4(tmp_path, columns):
    """`UploadOptions(header_columns=False)`: chunked deltas with format-3 headers (a dict per tensor,
    what readers from before format 4 decode with the generic codec), the same weights either way."""
    from vllm_delta import wire
    from vllm_delta.format import VersionFile, VersionHeader
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
    from vllm_delta.trainer.options import PublisherOptions, UploadOptions

    spec = TinyModelSpec(arch="qwen3", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=32, vocab_size=256)  # fmt: skip
    model = build_master_model(spec, seed=3)
    store = DeltaStore(str(tmp_path / "store"))
    options = PublisherOptions(upload=UploadOptions(header_columns=columns))
    with Publisher(store, options=options) as pub:
        pub.publish(model)
        for _ in train_steps(model, 2, lr=1e-4, seed=3):
            last = pub.publish(model)
    (path,) = store.local_paths(last.version)
    with VersionFile(path) as vf:
        text = vf._f.metadata()["header"]
        assert vf.header.codec == "chunked"
        assert vf.header.format_version == (COLUMNS_FORMAT_VERSION if columns else STREAMS_FORMAT_VERSION)
    if not columns:  # what a format-3 reader does: the generic codec over a dict per tensor
        old = wire.decode(VersionHeader, json.loads(text))
        assert dict(old.tensors.items()) == dict(VersionHeader.from_json(text).tensors.items())
    _, tensors = replay(store, last.version)
    assert vllm_delta.checksum(tensors) == vllm_delta.checksum(bf16_image(model))
