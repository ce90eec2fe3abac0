"""The weight-transfer backend's names in vLLM's real factory (no engine): "vllm_delta" always, "delta" where
it is free; a "delta" another package registered first (SkyRL does) is said at start-up, naming both, and
left to it."""

from __future__ import annotations

import logging
import sys
import types

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_objects]  # objects only: make check-vllm-next runs them


@pytest.fixture
def factory(monkeypatch):
    """vLLM's WeightTransferEngineFactory with its built-in engines only (a copy of its registry: the
    process's own registry is left as it was)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm_delta.vllm import plugin

    builtin = {
        k: v for k, v in WeightTransferEngineFactory._registry.items() if k not in (plugin.BACKEND, plugin.BACKEND_OWN)
    }
    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", builtin)
    return WeightTransferEngineFactory


def engine_class(factory, name: str) -> type:
    return factory._registry[name]()


def test_both_names_lead_to_our_engine_where_delta_is_free(factory, caplog):
    from vllm_delta.vllm import plugin
    from vllm_delta.vllm.worker.backend import DeltaWeightTransferEngine

    with caplog.at_level(logging.WARNING, logger="vllm_delta.vllm.plugin"):
        assert sorted(plugin.register_backend(factory)) == ["delta", "vllm_delta"]
        assert sorted(plugin.register_backend(factory)) == ["delta", "vllm_delta"]  # again: nothing raised
    assert engine_class(factory, "delta") is engine_class(factory, "vllm_delta") is DeltaWeightTransferEngine
    assert not caplog.records


@pytest.mark.parametrize("how", ["module path", "class"])
def test_a_delta_registered_by_another_package_is_said_and_kept(factory, caplog, monkeypatch, how):
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from vllm_delta.vllm import plugin
    from vllm_delta.vllm.worker.backend import DeltaWeightTransferEngine

    other = types.ModuleType("skyrl_fake.weight_sync")
    other.SkyRLDeltaEngine = type("SkyRLDeltaEngine", (WeightTransferEngine,), {"__module__": other.__name__})
    monkeypatch.setitem(sys.modules, other.__name__, other)
    if how == "module path":  # how SkyRL registers: lazily, by module path
        factory.register_engine("delta", other.__name__, "SkyRLDeltaEngine")
    else:
        factory.register_engine("delta", other.SkyRLDeltaEngine)
    with caplog.at_level(logging.WARNING, logger="vllm_delta.vllm.plugin"):
        assert plugin.register_backend(factory) == ["vllm_delta"]
    assert engine_class(factory, "vllm_delta") is DeltaWeightTransferEngine
    assert engine_class(factory, "delta") is other.SkyRLDeltaEngine  # theirs, untouched
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "'delta' is already registered by" in warning and "skyrl_fake.weight_sync" in warning
    assert "registered as 'vllm_delta' only" in warning and '{"backend": "vllm_delta"}' in warning
