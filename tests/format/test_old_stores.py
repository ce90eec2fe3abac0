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
from vllm_delta.format import ARRAYS_FORMAT_VERSION, COLUMNS_FORMAT_VERSION, STREAMS_FORMAT_VERSION
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
    are chunked (format 5), and a reader replays the mixed store."""
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
        assert vf.header.codec == "chunked" and vf.header.format_version == ARRAYS_FORMAT_VERSION
    _, tensors = replay(store, 7)
    assert vllm_delta.checksum(tensors) == vllm_delta.checksum(bf16_image(model))
    _, old = replay(store, 3)  # the old chain still reads
    assert vllm_delta.checksum(old) == store.record(3).checksum


@pytest.mark.parametrize(
    "upload, written",
    [({}, ARRAYS_FORMAT_VERSION), ({"header_format": 4}, COLUMNS_FORMAT_VERSION), ({"header_format": 3}, 3),
     ({"header_columns": False}, STREAMS_FORMAT_VERSION)],
    ids=["format-5", "format-4", "format-3", "header_columns=False"],
)  # fmt: skip
def test_a_publisher_writes_older_formats_for_older_readers(tmp_path, upload, written):
    """`UploadOptions(header_format=4 or 3)` (or the older `header_columns=False`): chunked deltas with
    format-4 or format-3 headers, what readers from before format 5 (or 4) read; the same weights
    either way."""
    from vllm_delta import wire
    from vllm_delta.format import VersionFile, VersionHeader
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
    from vllm_delta.trainer.options import PublisherOptions, UploadOptions

    spec = TinyModelSpec(arch="qwen3", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=32, vocab_size=256)  # fmt: skip
    model = build_master_model(spec, seed=3)
    store = DeltaStore(str(tmp_path / "store"))
    options = PublisherOptions(upload=UploadOptions(**upload))
    with Publisher(store, options=options) as pub:
        pub.publish(model)
        for _ in train_steps(model, 2, lr=1e-4, seed=3):
            last = pub.publish(model)
    (path,) = store.local_paths(last.version)
    with VersionFile(path) as vf:
        text = vf._f.metadata()["header"]
        assert vf.header.codec == "chunked"
        assert vf.header.format_version == written
        assert json.loads(text)["format_version"] == written
    if written == STREAMS_FORMAT_VERSION:  # what a format-3 reader does: the generic codec over a dict per tensor
        old = wire.decode(VersionHeader, json.loads(text))
        assert dict(old.tensors.items()) == dict(VersionHeader.from_json(text).tensors.items())
    _, tensors = replay(store, last.version)
    assert vllm_delta.checksum(tensors) == vllm_delta.checksum(bf16_image(model))


def test_a_bad_header_format_is_refused():
    from vllm_delta.trainer.options import UploadOptions

    with pytest.raises(ValueError, match="header_format"):
        UploadOptions(header_format=6)


# -- a store written before format 5 (commit a406554: chunked deltas in formats 4 and 3, one of two parts) --
BEFORE_ARRAYS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "store_a406554")


@pytest.fixture
def store_a406554(tmp_path) -> tuple[DeltaStore, dict]:
    root = tmp_path / "store"
    shutil.copytree(BEFORE_ARRAYS, root)
    with open(root / "expected.json") as f:
        expected = json.load(f)
    return DeltaStore(str(root)), expected


def test_versions_written_before_format_5_replay_bit_exact(store_a406554):
    """Formats 4 (one file and two parts) and 3, as commit a406554 wrote them, read and replay to the
    writer's weights."""
    store, expected = store_a406554
    assert store.versions() == list(range(6))
    assert store.record(5).parts is not None
    for v in range(6):
        with store.open(v) as vf:
            assert vf.header.format_version == expected["formats"][str(v)], v
        _, tensors = replay(store, v)
        assert vllm_delta.checksum(tensors) == expected["checksums"][str(v)], v
    for v in (2, 5):
        want = _bits(load_file(os.path.join(BEFORE_ARRAYS, f"expected_v{v}.safetensors")))
        got = _bits(replay(store, v)[1])
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), v


def test_an_engine_stages_old_formats_then_format_5_on_top(store_a406554):
    """A server's engine catches up over the old deltas (format 3, then format 4 of two parts), then a
    Publisher of this release continues the store with format-5 deltas, which the same engine stages
    next, bit-exact with the trainer's weights."""
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.training import bf16_image, build_master_model, train_steps

    store, expected = store_a406554
    files = open_chain(store, 5)
    anchor = files[0]
    targets = {n: anchor.dense(n).clone() for n in anchor.header.tensors}
    engine = ApplyEngine(targets, Layout.identity({n: tuple(t.shape) for n, t in targets.items()}), "cpu")
    for f in files[1:]:
        engine.patch(engine.stage([f]))
    assert to_hex(combine(engine.live_sums().items())) == expected["checksums"]["5"]
    spec = TinyModelSpec(arch="qwen3", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=32, vocab_size=256)  # fmt: skip
    model = build_master_model(spec, seed=7)
    with torch.no_grad():  # the trainer resumes from the store's weights (version 5)
        image = replay(store, 5)[1]
        for name, p in model.named_parameters():
            p.copy_(image[name].float())
    with Publisher(store, anchor_every=100) as pub:
        assert pub.publish(model).kind == "anchor"  # a new publisher starts its chain with an anchor
        for _ in train_steps(model, 2, lr=1e-4, seed=11):
            last = pub.publish(model)
    with store.open(last.version) as vf:
        assert vf.header.format_version == ARRAYS_FORMAT_VERSION
    engine.patch(engine.stage(open_chain(store, last.version)[1:]))  # the anchor holds version 5's weights
    assert to_hex(combine(engine.live_sums().items())) == vllm_delta.checksum(bf16_image(model))
    want = bf16_image(model)
    assert all(torch.equal(targets[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
    engine.close()
