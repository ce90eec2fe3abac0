"""materialize / replay and the `vllm-delta` CLI on real stores."""

import dataclasses
import json
import os

import pytest
import torch

import vllm_delta
from vllm_delta.cli import main as cli
from vllm_delta.errors import ChecksumMismatchError, IntegrityError, MissingBaseError
from vllm_delta.format import FILE_PAYLOAD, VersionFile, payload_key, write
from vllm_delta.reconstruct import materialize
from vllm_delta.store import DeltaStore
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps

SPEC = TinyModelSpec(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=512)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A store with versions 0..4 (anchor every 3) of a model trained with AdamW; the bf16 images."""
    root = str(tmp_path_factory.mktemp("store"))
    model = build_master_model(SPEC, seed=21)
    images = {}
    with vllm_delta.Publisher(root, anchor_every=3) as pub:
        pub.publish(model, version=0)
        images[0] = bf16_image(model)
        for step in train_steps(model, 4, seed=21):
            pub.publish(model, version=step)
            images[step] = bf16_image(model)
    return root, images, model.config


def test_materialize_is_hf_loadable_and_bit_exact(run, tmp_path):
    from transformers import AutoModelForCausalLM

    root, images, _ = run
    out = materialize(DeltaStore(root), 4, str(tmp_path / "v4"), progress=False)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    state = loaded.state_dict()
    for name, t in images[4].items():
        assert torch.equal(state[name].view(torch.int16), t.view(torch.int16)), name


def test_cli_materialize_and_inspect(run, tmp_path, capsys):
    root, images, _ = run
    assert cli(["materialize", root, "--version", "2", "--out", str(tmp_path / "v2"), "--quiet"]) == 0
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "v2" / "model.safetensors"))
    assert all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in images[2].items())
    capsys.readouterr()
    assert cli(["inspect", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["kind"], r["base"]) for r in rows] == [
        (0, "anchor", None),
        (1, "delta", 0),
        (2, "delta", 1),
        (3, "anchor", None),
        (4, "delta", 3),
    ]
    for r in rows:
        assert r["checksum"] == vllm_delta.checksum(images[r["version"]])
        assert r["bytes"] > 0 and 0 < r["density"] <= 1 and r["nnz"] > 0
    assert cli(["inspect", root, "--version", "latest"]) == 0
    table = capsys.readouterr().out
    assert "delta" in table and vllm_delta.checksum(images[4]) in table


def test_cli_reports_errors(run, tmp_path, capsys):
    root, _, _ = run
    assert cli(["inspect", root, "--version", "99"]) == 1
    assert "VersionNotFoundError" in capsys.readouterr().err
    assert cli(["inspect", root, "--version", "x"]) == 2


def _copy_store_with(root, tmp_path, version, mutate):
    """A new store holding `root`'s chain up to `version`, with that version's header/payload mutated."""
    src, dst = DeltaStore(root), DeltaStore(str(tmp_path / "tampered"))
    for rec in src.chain(version):
        path = src.local_path(rec.version)
        vf = VersionFile(path)
        header = vf.header
        if rec.version == version:
            payload = {}
            for name in header.tensors:
                if header.kind == "anchor":
                    payload[name] = vf.dense(name).clone()
                else:
                    payload.update({payload_key(name, k): v.clone() for k, v in vf.parts(name).items()})
            if header.kind == "delta":  # a file-level codec's streams (format 3)
                payload.update({payload_key(FILE_PAYLOAD, k): v.clone() for k, v in vf.parts(FILE_PAYLOAD).items()})
            mutate(header, payload)
            path = str(tmp_path / f"t{version}.safetensors")
            write(path, header, payload)
        dst.writer.commit_file(header, path)
    return dst


def test_checksum_mismatch_writes_nothing(run, tmp_path):
    root, _, _ = run

    def flip_one_value(header, payload):
        name = next(n for n, e in header.tensors.items() if e.nnz)
        # re-encode is not needed: claim a different resulting checksum for the tensor
        wrong = f"{(int(header.tensors[name].checksum, 16) + 1) % (1 << 64):016x}"
        header.tensors[name] = dataclasses.replace(header.tensors[name], checksum=wrong)
        assert payload_key(FILE_PAYLOAD, "blob") in payload or payload_key(name, "blob") in payload

    store = _copy_store_with(root, tmp_path, 2, flip_one_value)
    out = tmp_path / "never"
    with pytest.raises(ChecksumMismatchError, match="version 2"):
        materialize(store, 2, str(out), progress=False)
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".materialize-")]


def test_wrong_base_checksum_breaks_the_chain(run, tmp_path):
    root, _, _ = run

    def other_base(header, payload):
        header.base_checksum = "0" * 16

    store = _copy_store_with(root, tmp_path, 1, other_base)
    with pytest.raises(IntegrityError, match="version 1"):
        materialize(store, 1, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_base(run, tmp_path):
    root, _, _ = run
    store = _copy_store_with(root, tmp_path, 2, lambda h, p: None)
    os.unlink(os.path.join(store.uri.removeprefix("file://"), "versions", "0000000001.json"))
    with pytest.raises(MissingBaseError, match="1"):
        materialize(DeltaStore(store.uri), 2, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_refuses_non_empty_destination(run, tmp_path):
    root, _, _ = run
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        materialize(DeltaStore(root), 1, str(tmp_path / "busy"), progress=False)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"


def test_large_versions_are_written_in_shards(run, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import vllm_delta.reconstruct as m

    root, images, _ = run
    monkeypatch.setattr(m, "SHARD_BYTES", 200_000)
    out = materialize(DeltaStore(root), 3, str(tmp_path / "sharded"), progress=False)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and set(index["weight_map"]) == set(images[3])
    got = {}
    for shard in shards:
        got.update(load_file(os.path.join(out, shard)))
    assert all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in images[3].items())
