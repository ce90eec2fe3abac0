"""Realistic RL-style weight updates for tests, benchmarks and the demo.

A tiny causal LM with fp32 master weights (HF's default init, std 0.02) trained with AdamW at an RL
learning rate (1e-6) on random tokens: between steps, only a few percent of the bf16 images change,
mostly by one ULP -- the statistics the compact codec is built for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .models import TinyModelSpec, build_config


def build_master_model(spec: TinyModelSpec | None = None, seed: int = 0) -> torch.nn.Module:
    """fp32 master weights with HF's default initialization."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(build_config(spec or TinyModelSpec()), dtype=torch.float32)


def train_steps(
    model: torch.nn.Module,
    steps: int,
    *,
    lr: float = 1e-6,
    batch: int = 4,
    seq_len: int = 32,
    seed: int = 0,
) -> Iterator[int]:
    """Run `steps` AdamW steps on random tokens, yielding the step number after each."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    config: Any = model.config
    vocab = int(config.vocab_size)
    model.train()
    for step in range(1, steps + 1):
        tokens = torch.randint(0, vocab, (batch, seq_len), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield step


def bf16_image(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a server should hold: the bf16 image of every published tensor (tied weights once)."""
    from ..trainer.detect import named_tensors

    return {n: t.detach().to(torch.bfloat16) for n, t in named_tensors(model)}
