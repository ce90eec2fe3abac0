"""In-process vLLM engines (a subprocess per test): the probed layout, the load format at every version,
tensors forced through vLLM's sparse path, and a start-up that must be refused."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from craft import flip_tail_bytes
from vllm_helpers import LLAMA, private_store, run_engine_script

from vllm_delta.checksums import tensor_sum
from vllm_delta.format import write
from vllm_delta.reconstruct import replay
from vllm_delta.signatures import keygen
from vllm_delta.store import DeltaStore
from vllm_delta.store.cache import file_sha256
from vllm_delta.store.signed import RecordSigner, new_run_id
from vllm_delta.testing.models import PROMPTS
from vllm_delta.testing.runs import publish_run
from vllm_delta.writer import encode_anchor

pytestmark = pytest.mark.vllm


def test_load_format_delta_at_every_version(llama_fresh, llama_run):
    for v in llama_run.versions:
        got = llama_fresh[str(v)]
        assert got["checksum"] == llama_run.checksums[v], f"version {v}: live weights differ from the trainer's"
        assert got["fallback"] == []
    assert llama_fresh["0"]["outputs"] != llama_fresh["6"]["outputs"]


def test_probed_layout_of_a_gqa_llama(llama_fresh):
    segs = llama_fresh["0"]["segments"]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    # q: 2 heads x 64 rows, then k and v: 1 head x 64 rows each, 128 columns.
    assert segs["model.layers.0.self_attn.q_proj.weight"] == [[qkv, 0, 128, 0, True]]
    assert segs["model.layers.0.self_attn.k_proj.weight"] == [[qkv, 0, 64, 128 * 128, True]]
    assert segs["model.layers.0.self_attn.v_proj.weight"] == [[qkv, 0, 64, 192 * 128, True]]
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    assert segs["model.layers.0.mlp.up_proj.weight"] == [[gate_up, 0, 256, 256 * 128, True]]
    # Vocab 500 padded to 512 rows: the HF rows land at the start.
    assert segs["model.embed_tokens.weight"] == [["model.embed_tokens.weight", 0, 500, 0, True]]
    assert segs["lm_head.weight"] == [["lm_head.weight", 0, 500, 0, True]]


def test_tensors_through_vllms_sparse_path(llama_run, tmp_path):
    """Forced fallbacks must give the same weights: updates, the vLLM commit method, then a rollback."""
    forced = ["model.norm.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"]
    res = run_engine_script(
        {
            "task": "fallback",
            "model": llama_run.model_dir,
            "store": llama_run.store,
            "start": 1,
            "fallback": forced,
            "cache_dir": str(tmp_path / "cache"),
            "updates": [[[2], "delta"], [[3], "vllm"], [[4, 5], "delta"], [[6], "delta"]],
            "prompts": list(PROMPTS),
        }
    )
    assert res["start"] == llama_run.checksums[1]
    assert sorted(res["layout"]["fallback"]) == sorted(forced)
    assert "model.norm.weight" not in res["layout"]["segments"]
    for step in res["steps"]:
        assert "error" not in step["commit"], step
        assert step["checksum"] == llama_run.checksums[step["versions"][-1]], step["versions"]
    last = res["steps"][-1]
    assert last["rollback"] == {"rolled_back": True}
    assert last["after_rollback"] == llama_run.checksums[5]
    assert last["status"]["version"] == 5


def test_a_damaged_version_refuses_to_start(llama_run, tmp_path):
    store = private_store(llama_run, str(tmp_path))
    # Same size, damaged bytes at the end of the anchor's last tensor: the replayed tensor's
    # checksum can't match its header, and the engine must not come up serving it.
    rec = DeltaStore(store).record(4)
    flip_tail_bytes(os.path.join(store, rec.file), n=64)
    res = run_engine_script({"task": "refuse", "model": llama_run.model_dir, "store": store, "version": 5})
    assert res["started"] is False
    assert "ChecksumMismatchError" in res["error"] or "checksum" in res["error"], res["error"]


def test_a_start_version_not_signed_by_a_trusted_key_refuses_to_start(llama_run, tmp_path):
    """delta_trusted_keys that do not sign the start version's chain: an unsigned store, and one signed by
    another key, each refused before any weight is loaded, with a message naming the version, the store and
    the signature."""
    trusted, other = keygen(tmp_path / "trusted.key"), keygen(tmp_path / "other.key")
    unsigned = private_store(llama_run, str(tmp_path / "unsigned"))
    foreign = private_store(llama_run, str(tmp_path / "foreign"))
    sign_store(DeltaStore(foreign), other)
    extra = {"delta_trusted_keys": [f"{trusted.path}.pub"]}
    res = run_engine_script(
        {
            "task": "refuse",
            "model": llama_run.model_dir,
            "cases": [
                {"store": unsigned, "version": 3, "extra": extra},
                {"store": foreign, "version": "latest", "extra": extra},
            ],
        }
    )
    not_signed, signed_by_other = res["cases"]
    latest = DeltaStore(foreign).latest()
    for case, store, version in ((not_signed, unsigned, 3), (signed_by_other, foreign, latest)):
        assert case["started"] is False
        assert "SignatureError" in case["error"], case["error"]
        assert f"does not start at version {version} of store {store}" in case["error"], case["error"]
    assert "it is not signed" in not_signed["error"]
    assert f"signed by key {other.fingerprint}, which is not trusted" in signed_by_other["error"]


def sign_store(store: DeltaStore, key) -> None:
    """Sign every record of a local store after the fact (files hashed, one run), as a signing Publisher
    would have: a store signed by `key`."""
    signer = RecordSigner(new_run_id(), key)
    for rec in store.records():
        files = [file_sha256(os.path.join(store.uri, d.file)) for d in rec.data_files]
        if rec.parts:
            rec = dataclasses.replace(
                rec, parts=tuple(dataclasses.replace(p, sha256=h) for p, h in zip(rec.parts, files))
            )
        else:
            rec = dataclasses.replace(rec, sha256=files[0])
        store.io.write_small(store.record_reader.record_path(rec.version), signer.seal(rec).to_json().encode())


def test_a_version_that_does_not_fit_the_model_refuses_to_start(llama_run, tmp_path):
    """Another model's shapes (the model's own loader fails), or the same model in float16 (vLLM's loader
    would convert it silently): refused with the store, the version and the tensor named."""
    wider = publish_run(str(tmp_path / "wider"), dataclasses.replace(LLAMA, intermediate_size=384), steps=0)
    f16_store = str(tmp_path / "f16")
    _, tensors = replay(DeltaStore(llama_run.store), 2, progress=False)
    tensors = {n: t.to(torch.float16) for n, t in tensors.items()}
    header, payload = encode_anchor(7, tensors, {n: tensor_sum(t) for n, t in tensors.items()})
    write(str(tmp_path / "f16.safetensors"), header, payload)
    DeltaStore(f16_store).writer.commit_file(header, str(tmp_path / "f16.safetensors"))
    res = run_engine_script(
        {
            "task": "refuse",
            "model": llama_run.model_dir,
            "cases": [{"store": wider.store, "version": 0}, {"store": f16_store, "version": "latest"}],
        }
    )
    shape, dtype = res["cases"]
    assert shape["started"] is False and dtype["started"] is False
    for case, store, version in ((shape, wider.store, 0), (dtype, f16_store, 7)):
        assert "ShapeMismatchError" in case["error"], case["error"]
        assert f"version {version} of store {store}" in case["error"], case["error"]
        assert "tensor '" in case["error"], case["error"]  # names the tensor
    assert "dtype F16" in dtype["error"], dtype["error"]


def test_plain_checkpoint_server_and_native_backend(llama_run, llama_fresh, tmp_path):
    """A server loaded from an ordinary HF checkpoint knows no version: the first update must say
    allow_reanchor; then vLLM's own LLM.update_weights moves it along the store like any other, back along
    its chain too (5 -> 4 by undoing 5, then 5 again)."""
    res = run_engine_script(
        {
            "task": "plain",
            "model": llama_run.model_dir,
            "store": llama_run.store,
            "start": 2,
            "out": str(tmp_path / "ckpt"),
            "updates": [
                {"version": 3},
                {"version": 3, "allow_reanchor": True},
                {"version": 5},
                {"version": 1},  # back through the anchor 4: no backward path
                {"version": 4},  # back along the chain: 5's differences undone (issue 36)
                {"version": 5},
            ],
            "prompts": list(PROMPTS),
        }
    )
    assert res["status"]["version"] is None
    refused, reanchored, forward, backwards, undone, again = res["steps"]
    assert "NotSuccessorError" in refused["error"] and refused["version"] is None
    assert refused["checksum"] == llama_run.checksums[2]  # the checkpoint it was loaded from, untouched
    assert reanchored["error"] is None and reanchored["version"] == 3
    assert reanchored["checksum"] == llama_run.checksums[3]
    assert forward["error"] is None and forward["checksum"] == llama_run.checksums[5]
    assert "NotSuccessorError" in backwards["error"] and backwards["checksum"] == llama_run.checksums[5]
    assert "version 4 is an anchor" in backwards["error"]
    assert (undone["error"], undone["version"], undone["checksum"]) == (None, 4, llama_run.checksums[4])
    assert (again["error"], again["version"], again["checksum"]) == (None, 5, llama_run.checksums[5])
    assert res["outputs"] == llama_fresh["5"]["outputs"][: len(PROMPTS)]
