"""Parts of the TRL integration that need no server: the version a rollout is tagged with, the
options' checks, and the CPU stand-in for TRL's tree attention used by the asynchronous test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trl_workers as W

from vllm_delta import DeltaStore, Publisher, checksum
from vllm_delta.attribution import parse_spans
from vllm_delta.integrations.rollout_sync import LiveMismatchError, RolloutSync, RolloutSyncError, RolloutSyncOptions
from vllm_delta.integrations.trl import AttributionError, DeltaGRPOTrainer
from vllm_delta.integrations.trl_async import rollout_version
from vllm_delta.signatures import TrustedKeys, keygen
from vllm_delta.store.signed import signature_state
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps


def spans(*items):
    return parse_spans(items)


def test_a_rollout_is_tagged_with_the_oldest_version_in_trl_numbering():
    base = 40  # store version 40 is TRL's version 0
    assert rollout_version([spans([42, 0, 6])], base=base, current=2) == 2
    # several turns, one updated in flight (41 -> 42 at token 3): the oldest version decides staleness
    assert rollout_version([spans([42, 0, 6]), spans([41, 0, 3], [42, 3, 6])], base=base, current=2) == 1
    # the version being synced now may be live before TRL counts it
    assert rollout_version([spans([43, 0, 6])], base=base, current=2) == 3


@pytest.mark.parametrize(
    "turns, message",
    [
        ([None], "carries no weight_versions"),
        ([spans(["default", 0, 6])], "not by a version of the store"),
        ([spans([44, 0, 6])], "has not published"),
        ([spans([42, 0, 2], [44, 2, 6])], "has not published"),
        ([], "without any generated token"),
    ],
)
def test_a_rollout_from_a_version_the_trainer_did_not_publish_is_refused(turns, message):
    with pytest.raises(AttributionError, match=message):
        rollout_version(turns, base=40, current=2)


def test_options_are_checked():
    with pytest.raises(ValueError, match="mode must be one of"):
        RolloutSyncOptions(store="/tmp/x", mode="pull")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="live_timeout_s must be positive"):
        RolloutSyncOptions(store="/tmp/x", live_timeout_s=0)


def test_cpu_tree_attention_matches_the_model_attention():
    """The stand-in kernel of the asynchronous test computes what the model's own attention does."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention

    register_tree_attention()
    AttentionInterface.register(TREE_ATTENTION, W.tree_attention_cpu)
    plain = build_master_model(W.SPEC, seed=13)
    tree = build_master_model(W.SPEC, seed=13)
    tree.config._attn_implementation = TREE_ATTENTION
    mask = np.array([0, 0, 1, 1, 1, 1])
    samples = [np.array([5, 6, 7, 8 + i, 9 + 2 * i, 10]) for i in range(3)]  # a shared prefix, then forks
    row = TreeRow()
    for ids in samples:
        row.add(
            {"input_ids": ids, "completion_mask": mask, "old_log_probs": np.zeros(6), "advantage": 1.0, "group_id": 0}
        )
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(s) for s in samples)  # the prefix is forwarded once
    with torch.no_grad():
        hidden = tree.model(
            input_ids=packed["input_ids"][None],
            position_ids=packed["position_ids"][None],
            tree_kv_index=packed["tree_kv_index"],
            tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
        ).last_hidden_state[0]
        # TRL scores each trained token off its predecessor's packed position (token_index)
        predecessors = [p - 1 for p in range(1, 6) if mask[p]]
        want = torch.cat(
            [plain.model(input_ids=torch.tensor(ids)[None]).last_hidden_state[0][predecessors] for ids in samples]
        )
    got = hidden[packed["token_index"]]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_versions_are_published_once_and_a_store_ahead_is_refused(tmp_path):
    """RolloutSync's publishing side (no server to keep live): version numbers are the trainer's
    steps, a step synced twice is published once, a store that is ahead or holds another run's
    weights under the trainer's starting version is refused before anything is published."""
    store = str(tmp_path / "store")
    model = build_master_model(W.SPEC, seed=1)
    sync = RolloutSync(RolloutSyncOptions(store=store), servers=[])
    first = sync.sync(model, 0)
    assert (first.published, first.kind) == (True, "anchor")
    assert sync.sync(model, 0).published is False  # TRL asked twice at the same step
    for _ in train_steps(model, 1, lr=1e-3):
        pass
    second = sync.sync(model, 1)
    assert (second.published, second.kind) == (True, "delta")
    assert second.checksum == checksum(bf16_image(model)) == DeltaStore(store).record(1).checksum
    sync.close()

    resumed = RolloutSync(RolloutSyncOptions(store=store), servers=[])
    assert resumed.sync(model, 1).published is False  # a run resumed at the store's last step: checked
    with pytest.raises(RolloutSyncError, match="already holds versions up to 1"):
        RolloutSync(RolloutSyncOptions(store=store), servers=[]).sync(model, 0)
    other = str(tmp_path / "other")
    with Publisher(other) as pub:
        pub.publish(build_master_model(W.SPEC, seed=2), version=0)
    with pytest.raises(LiveMismatchError, match="published by another run"):
        RolloutSync(RolloutSyncOptions(store=other), servers=[]).sync(model, 0)
    assert DeltaStore(other).versions() == [0]


def test_a_signing_key_signs_every_version_the_sync_publishes(tmp_path):
    """RolloutSyncOptions(signing_key=...) hands the key to its Publisher: the anchor and the delta are
    signed by that key (a server with `delta_trusted_keys` takes them); without it they are unsigned."""
    key = keygen(str(tmp_path / "trainer.key"))
    trusted = TrustedKeys.load([f"{key.path}.pub"])
    model = build_master_model(W.SPEC, seed=1)
    states = {}
    for name, signing_key in (("signed", str(tmp_path / "trainer.key")), ("plain", None)):
        store = str(tmp_path / name)
        sync = RolloutSync(RolloutSyncOptions(store=store, signing_key=signing_key), servers=[])
        sync.sync(model, 0)
        for _ in train_steps(model, 1, lr=1e-3, seed=3):
            pass
        sync.sync(model, 1)
        sync.close()
        states[name] = [signature_state(DeltaStore(store).record(v), trusted) for v in (0, 1)]
    assert [s.status for s in states["signed"]] == ["signed", "signed"], states
    assert {s.key for s in states["signed"]} == {key.fingerprint}
    assert [s.status for s in states["plain"]] == ["unsigned", "unsigned"], states


def test_trainer_arguments_are_checked(tmp_path):
    from trl import GRPOConfig

    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=8)
    model = build_master_model(W.SPEC, seed=8)
    for args in (GRPOConfig(**common), GRPOConfig(use_vllm=True, vllm_mode="colocate", **common)):
        with pytest.raises(ValueError, match="use_vllm=True, vllm_mode='server'"):
            DeltaGRPOTrainer(model=model, reward_funcs=W.parity_reward, args=args, delta=str(tmp_path))
