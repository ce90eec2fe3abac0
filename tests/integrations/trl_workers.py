"""What tests/integrations/test_trl.py runs: the GRPO setup shared by its single-process and its
sharded runs, and the per-rank function of the sharded run (imported by name in the rank processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_delta import checksum
from vllm_delta.testing.models import TinyModelSpec, build_tokenizer
from vllm_delta.testing.training import bf16_image

SPEC = TinyModelSpec(
    arch="qwen3", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=320
)
PROMPTS = ("the house is", "my cat is", "the sky was", "a big dog and a")
GENERATIONS = 4  # completions per prompt (the GRPO group)
BATCH = 8  # completions per step and rank: two groups
TOKENS = 6


def parity_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The fraction of even token ids: varies within every group, so every step moves the weights."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def dataset(n: int = 64) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})


def grpo_config(output_dir: str, server_url: str, *, max_steps: int, save_steps: int | None = None, **extra: Any):
    from trl import GRPOConfig

    fields: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=BATCH,
        num_generations=GENERATIONS,
        max_completion_length=TOKENS,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server_url,
        vllm_server_timeout=60,
    )
    return GRPOConfig(**{**fields, **extra})


@dataclass
class Witness:
    """What a test sees for itself, around TRL's steps: the trainer's bf16 weights when each step
    begins (what that step's sync publishes) and the server's status when it ends."""

    server_url: str
    weights: dict[int, str] = field(default_factory=dict)  # global_step at step begin -> checksum
    served: dict[int, tuple[int | None, str | None]] = field(default_factory=dict)  # step end -> (version, live)
    read_server: bool = True

    def callback(self) -> Any:
        from transformers import TrainerCallback

        witness = self

        class _Witness(TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
                witness.weights[state.global_step] = checksum(bf16_image(model))

            def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
                if witness.read_server:
                    import requests

                    doc = requests.get(f"{witness.server_url}/v1/delta/status", timeout=60).json()
                    witness.served[state.global_step] = (doc["version"], doc["checksum"])

        return _Witness()


def sharded_rank(rank: int, world: int, model_dir: str, store: str, server_url: str, checkpoint: str, out: str) -> dict:
    """One rank of a 2-rank GRPO run under accelerate (gloo), resumed from `checkpoint`, pushing to
    the server: every rank publishes its part of each version."""
    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    from vllm_delta.integrations.trl import DeltaGRPOTrainer, RolloutSyncOptions

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    witness = Witness(server_url, read_server=rank == 0)
    trainer = DeltaGRPOTrainer(
        model=model,
        reward_funcs=parity_reward,
        args=grpo_config(out, server_url, max_steps=8),
        train_dataset=dataset(),
        processing_class=build_tokenizer(SPEC.vocab_size),
        callbacks=[witness.callback()],
        delta=RolloutSyncOptions(store=store, mode="push"),
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    state = PartialState()
    synced = trainer.vllm_generation.synced
    return {
        "distributed_type": state.distributed_type.value,
        "num_processes": state.num_processes,
        "synced": [(r.version, r.checksum, r.published, r.kind, [s.checksum for s in r.live]) for r in synced],
        "weights": witness.weights,
        "final": checksum(bf16_image(trainer.model)),
        "served": witness.served,
    }


# -- TRL's asynchronous trainer on CPU ------------------------------------------------------------------
# TRL 1.16's AsyncGRPOTrainer needs CUDA in two places, neither of them about weight sync: its packed
# "tree" attention is FlashAttention-3 fetched from the Hub (`kernels`, CUDA only; no network here), and
# its constructor asks CUDA for the device name to look its peak FLOPs up. The test replaces the first
# with the same varlen causal attention written with SDPA (checked against the model's own attention),
# and the second with "unknown device" (MFU metrics off).


def tree_attention_cpu(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    *,
    tree_kv_index: Any,
    tree_cu_seqlens_q: Any,
    tree_cu_seqlens_k: Any,
    scaling: float | None = None,
    **_: Any,
) -> tuple[Any, None]:
    """`flash_attn_varlen_func(causal=True)` over TRL's packed trie: segment s attends to the keys of
    its root-to-segment path (`tree_kv_index`), causal aligned bottom-right (the segment's own tokens
    end the path)."""
    import torch
    import torch.nn.functional as F

    q = query[0]  # (heads, tokens, dim)
    k = key[0].index_select(1, tree_kv_index)
    v = value[0].index_select(1, tree_kv_index)
    if q.shape[0] != k.shape[0]:  # grouped-query attention
        k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    outs = []
    for s in range(len(cq) - 1):
        lq, lk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, cq[s] : cq[s + 1]], k[:, ck[s] : ck[s + 1]], v[:, ck[s] : ck[s + 1]], attn_mask=mask, scale=scaling
            )
        )
    return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0), None


def chat_tokenizer() -> Any:
    """The tiny tokenizer with Qwen3's chat template (TRL's async worker renders chat prompts and
    parses responses with the template's response schema)."""
    from trl.chat_template_utils import qwen3_chat_template

    tok = build_tokenizer(SPEC.vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = qwen3_chat_template
    assert len(tok) <= SPEC.vocab_size
    return tok


def chat_dataset(n: int = 64) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]})
