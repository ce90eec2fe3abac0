"""Publisher end to end on real stores: exact change detection, background upload, errors."""

import threading

import pytest
import torch

import vllm_delta
from vllm_delta import Publisher, replay
from vllm_delta.store import DeltaStore
from vllm_delta.testing.models import TinyModelSpec, build_model
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
from vllm_delta.trainer import DetectOptions, PublisherOptions, PublishError, StoreOptions, UploadOptions

SPEC = TinyModelSpec(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=512)


def assert_same_bits(got: dict, want: dict):
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name


@pytest.mark.parametrize("codec", ["chunked", "compact", "raw"])
def test_every_version_replays_bit_exact(tmp_path, codec):
    model = build_master_model(SPEC, seed=3)
    images = {}
    with Publisher(str(tmp_path / "store"), anchor_every=3, codec=codec) as pub:
        info = pub.publish(model, version=0)
        images[0] = bf16_image(model)
        assert info.kind == "anchor" and info.checksum == vllm_delta.checksum(images[0])
        for step in train_steps(model, 6, seed=3):
            info = pub.publish(model, version=step)
            images[step] = bf16_image(model)
            assert info.checksum == vllm_delta.checksum(images[step])
            assert info.kind == ("anchor" if step % 3 == 0 else "delta")
            assert info.base == (None if step % 3 == 0 else step - 1)
            assert 0 < info.density < 0.2 or info.kind == "anchor"
    store = DeltaStore(str(tmp_path / "store"))
    assert store.versions() == list(range(7))
    for v, image in images.items():
        version, tensors = replay(store, v)
        assert version == v
        assert_same_bits(tensors, image)
        rec = store.record(v)
        assert rec.checksum == vllm_delta.checksum(image)
        if rec.kind == "delta":
            assert rec.nnz == sum(
                int((image[n].view(torch.int16) != images[v - 1][n].view(torch.int16)).sum()) for n in image
            )


def test_bf16_params_named_tensors_and_cpu_snapshot(tmp_path):
    model = build_model(SPEC, seed=4)  # bf16 parameters, no master copy
    with Publisher(str(tmp_path / "s"), options=PublisherOptions(detect=DetectOptions(snapshot_device="cpu"))) as pub:
        pub.publish(dict(model.named_parameters()))
        with torch.no_grad():
            p = model.model.layers[0].mlp.up_proj.weight
            p.view(torch.int16)[0, :5] += 1
            p.view(torch.int16)[3, 7] = -p.view(torch.int16)[3, 7]  # a large bit jump (an escape)
        info = pub.publish(dict(model.named_parameters()))
        assert info.nnz == 6 and info.version == 1 and info.kind == "delta"
    _, tensors = replay(DeltaStore(str(tmp_path / "s")), "latest")
    assert_same_bits(tensors, {n: t.detach() for n, t in model.named_parameters()})


def test_tied_weights_are_published_once(tmp_path):
    model = build_master_model(TinyModelSpec(**{**SPEC.__dict__, "tie_word_embeddings": True}), seed=5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with Publisher(str(tmp_path / "s")) as pub:
        pub.publish(model)
        state = dict(model.state_dict())  # holds both names for the one tensor
        info = pub.publish(state)
        assert info.nnz == 0
    header = DeltaStore(str(tmp_path / "s")).open(0).header
    assert "model.embed_tokens.weight" in header.tensors and "lm_head.weight" not in header.tensors


def test_publish_returns_before_the_upload_ends(tmp_path):
    store = DeltaStore(str(tmp_path / "s"))
    gate, entered = threading.Event(), threading.Event()
    real_publish = store.writer.commit_file

    def gated_publish(*args, **kwargs):  # instrumentation around the real store, not a mock of it
        entered.set()
        assert gate.wait(30)
        return real_publish(*args, **kwargs)

    store.writer.commit_file = gated_publish  # callers that write hold the writer
    model = build_master_model(SPEC, seed=6)
    pub = Publisher(store, options=PublisherOptions(upload=UploadOptions(queue_size=2)))
    info = pub.publish(model)
    assert entered.wait(30)
    assert not info.uploaded.done() and store.versions() == []
    gate.set()
    pub.flush()
    assert info.uploaded.result().version == 0 and store.versions() == [0]
    pub.close()


def test_upload_error_is_raised_next_and_chain_restarts_with_an_anchor(tmp_path):
    store = DeltaStore(str(tmp_path / "s"))
    real_publish = store.writer.commit_file
    fail = {"version": 2}

    def flaky_publish(header, path, **kwargs):
        if header.version == fail["version"]:
            raise OSError("disk full (injected)")
        return real_publish(header, path, **kwargs)

    store.writer.commit_file = flaky_publish
    model = build_master_model(SPEC, seed=7)
    steps = train_steps(model, 5, seed=7)
    pub = Publisher(store, anchor_every=100)
    pub.publish(model, version=0)
    next(steps)
    pub.publish(model, version=1)
    next(steps)
    pub.publish(model, version=2)  # will fail in the background
    with pytest.raises(PublishError, match="disk full.*version 2"):
        pub.flush()
    next(steps)
    info = pub.publish(model, version=3)
    assert info.kind == "anchor"  # its base never became visible
    pub.flush()
    assert store.versions() == [0, 1, 3]
    _, tensors = replay(store, 3)
    assert_same_bits(tensors, bf16_image(model))
    pub.close()


def test_error_in_queued_deltas_is_not_dropped_silently(tmp_path):
    store = DeltaStore(str(tmp_path / "s"))
    real_publish = store.writer.commit_file

    def flaky_publish(header, path, **kwargs):
        if header.version == 1:
            raise OSError("network down (injected)")
        return real_publish(header, path, **kwargs)

    store.writer.commit_file = flaky_publish
    model = build_master_model(SPEC, seed=8)
    pub = Publisher(store, anchor_every=100, options=PublisherOptions(upload=UploadOptions(queue_size=4)))
    pub.publish(model)
    for _ in train_steps(model, 1, seed=8):
        info1 = pub.publish(model)
    with pytest.raises(PublishError):
        pub.flush()
    with pytest.raises(OSError):
        info1.uploaded.result()
    assert store.versions() == [0]
    pub.close()


def test_version_rules(tmp_path):
    model = build_master_model(SPEC, seed=9)
    with Publisher(str(tmp_path / "s")) as pub:
        pub.publish(model, version=5)
        with pytest.raises(ValueError, match="not after"):
            pub.publish(model, version=5)
        assert pub.publish(model).version == 6
    # a new publisher continues after the store's latest version, starting with an anchor
    with Publisher(str(tmp_path / "s")) as pub:
        info = pub.publish(model)
        assert (info.version, info.kind) == (7, "anchor")


def test_retention_keeps_recent_anchors(tmp_path):
    model = build_master_model(SPEC, seed=10)
    with Publisher(
        str(tmp_path / "s"), anchor_every=2, options=PublisherOptions(store=StoreOptions(keep_anchors=2))
    ) as pub:
        pub.publish(model)
        for _ in train_steps(model, 6, seed=10):
            pub.publish(model)
    store = DeltaStore(str(tmp_path / "s"))
    assert store.versions() == [4, 5, 6]
    _, tensors = replay(store, 6)
    assert_same_bits(tensors, bf16_image(model))


@pytest.mark.parametrize("spelling", ["storage_options=", "StoreOptions"])
def test_s3_store(tmp_path, s3_server, spelling):
    """The fsspec options reach the store in either spelling: `Publisher(uri, storage_options=...)` (as
    DeltaStore, pandas and datasets take them) or `options=PublisherOptions(store=StoreOptions(...))`."""
    uri = s3_server.uri(f"publisher-test-{len(spelling)}")
    model = build_master_model(SPEC, seed=11)
    if spelling == "StoreOptions":
        kw = {"options": PublisherOptions(store=StoreOptions(storage_options=s3_server.storage_options))}
    else:
        kw = {"storage_options": s3_server.storage_options}
    with Publisher(uri, anchor_every=3, **kw) as pub:
        assert pub.store.storage_options == s3_server.storage_options
        pub.publish(model)
        for _ in train_steps(model, 3, seed=11):
            pub.publish(model)
    store = DeltaStore(uri, storage_options=s3_server.storage_options)
    assert [r.kind for r in store.records()] == ["anchor", "delta", "delta", "anchor"]
    _, tensors = replay(store, 2)
    _, latest = replay(store, "latest")
    assert_same_bits(latest, bf16_image(model))
    assert not all(torch.equal(tensors[n], latest[n]) for n in latest)
