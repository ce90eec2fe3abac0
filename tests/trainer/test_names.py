"""Publishing what vLLM loads: a transformers MoE model's fused in-memory experts under checkpoint names
(trainer/names.py), checked against what save_pretrained writes, and a materialized version that
from_pretrained loads back."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import vllm_delta
from vllm_delta import Publisher
from vllm_delta.reconstruct import materialize
from vllm_delta.store import DeltaStore
from vllm_delta.testing.models import TinyModelSpec, build_config
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
from vllm_delta.trainer.detect import named_tensors
from vllm_delta.trainer.names import _box_of, checkpoint_map, checkpoint_tensors

MOE = TinyModelSpec(arch="qwen3_moe", num_heads=2, num_kv_heads=1, vocab_size=500, num_experts=4)


def saved_tensors(model, directory) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    out: dict[str, torch.Tensor] = {}
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def test_moe_checkpoint_form_equals_save_pretrained_without_copies(tmp_path):
    model = build_master_model(MOE, seed=5)
    fused = dict(model.named_parameters())
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 128)  # [E, 2I, H]
    pairs = checkpoint_tensors(model)
    saved = saved_tensors(model, str(tmp_path / "ckpt"))
    assert [n for n, _ in pairs] and {n for n, _ in pairs} == set(saved)
    for name, t in pairs:
        assert t.dtype == saved[name].dtype and torch.equal(t, saved[name]), name
    # Every tensor is a view of a live parameter: no copy at publish time.
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(t.untyped_storage().data_ptr() in storages for _, t in pairs)
    up = dict(pairs)["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert up.shape == (64, 128) and torch.equal(up, fused["model.layers.1.mlp.experts.gate_up_proj"][2, 64:])
    # Learned once per distinct (template, shape): both layers share it; the map is cached on the model.
    assert checkpoint_map(model) is checkpoint_map(model)
    assert named_tensors(model)[0][0] == pairs[0][0]


def test_models_without_conversions_publish_named_parameters_unchanged():
    for spec in (TinyModelSpec(arch="llama"), TinyModelSpec(arch="qwen3", tie_word_embeddings=True)):
        model = build_master_model(spec)
        want = list(model.named_parameters())
        got = named_tensors(model)
        assert [n for n, _ in got] == [n for n, _ in want]
        assert all(a is b for (_, a), (_, b) in zip(got, want))


def test_box_of_recognises_views_and_refuses_the_rest():
    coded = torch.arange(24, dtype=torch.int32).reshape(2, 3, 4)
    assert _box_of(coded, coded[1, :, 2:]) == ((4, 1), 14)
    assert _box_of(coded, coded.transpose(1, 2)[0]) == ((1, 4), 0)
    interleaved = coded.reshape(2, 3, 2, 2).transpose(2, 3).reshape(2, 3, 4)
    assert _box_of(coded, interleaved) is None


def test_publish_moe_from_named_parameters_and_materialize_for_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    config = build_config(MOE)
    config.architectures = None  # as from_config leaves a model built without them
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    uri = str(tmp_path / "store")
    with Publisher(uri, anchor_every=10) as pub:
        infos = [pub.publish(model, version=0)]
        for step in train_steps(model, 2, lr=1e-3, seed=7):
            infos.append(pub.publish(model, version=step))
    image = bf16_image(model)
    assert infos[-1].kind == "delta" and infos[-1].checksum == vllm_delta.checksum(image)
    store = DeltaStore(uri)
    header = store.open(2).header
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in header.tensors
    assert not any("gate_up_proj" in n for n in header.tensors)
    assert json.loads(store.objects.get_asset("config.json"))["architectures"] == ["Qwen3MoeForCausalLM"]
    out = materialize(store, 2, str(tmp_path / "hf"), progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    got = dict(checkpoint_tensors(loaded))
    assert set(got) == set(image)
    for name, t in image.items():
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_other_moe_families_match_save_pretrained(tmp_path, kind):
    import transformers as T

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if kind == "qwen2_moe":
        config = T.Qwen2MoeConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, **common
        )
    else:
        config = T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    saved = saved_tensors(model, str(tmp_path / kind))
    got = dict(checkpoint_tensors(model))
    assert set(got) == set(saved)
    assert all(torch.equal(got[n], saved[n]) for n in saved)
