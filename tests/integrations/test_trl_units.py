"""Parts of the TRL integration that need no server: the version a rollout is tagged with, the
options' checks, and the CPU stand-in for TRL's tree attention used by the asynchronous test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trl_workers as W

from vllm_delta.attribution import parse_spans
from vllm_delta.integrations.rollout_sync import RolloutSyncOptions
from vllm_delta.integrations.trl import AttributionError
from vllm_delta.integrations.trl_async import rollout_version
from vllm_delta.testing.training import build_master_model


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
