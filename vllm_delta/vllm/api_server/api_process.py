"""The API process as the update's parts use it (`ApiProcess`): vLLM's engine client, the typed calls to
the worker ranks and the engine cores over it (shared/rpc.py), the store spec, the running operation's
deadline, and the trust policy. Built once per server (`ApiProcess.of`); every part is handed it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..shared import rpc
from ..shared.options import StoreSpec
from ..shared.trust import TrustPolicy
from .deadline import Deadline

RPC_TIMEOUT_S = float(os.environ.get("VLLM_DELTA_RPC_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class ApiProcess:
    """What the steps use in the API process."""

    engine: Any  # vLLM's EngineClient: pause, resume, prefix-cache reset
    workers: rpc.Workers
    engine_core: rpc.EngineCore
    spec: StoreSpec
    deadline: Deadline
    trust: TrustPolicy | None = None  # delta_trusted_keys: every plan checked (shared/trust.py)

    @property
    def vllm_config(self) -> Any:
        """vLLM's config of the engine (None for a stand-in engine without one)."""
        return getattr(self.engine, "vllm_config", None)

    @property
    def engines(self) -> int:
        """The engine cores this API process fronts (vLLM's data-parallel engines; 1 without)."""
        return len(getattr(getattr(self.engine, "engine_core", None), "core_engines", None) or [None])

    @classmethod
    def of(cls, engine_client: Any, spec: StoreSpec) -> ApiProcess:
        transport = rpc.engine_client_transport(engine_client, RPC_TIMEOUT_S)
        return cls(
            engine_client,
            rpc.Workers(transport),
            rpc.EngineCore(transport),
            spec,
            Deadline(spec.update_timeout_s, spec.uri),
            TrustPolicy.of(spec.trust()),
        )
