"""Integrations with training frameworks (imported lazily: the package itself never needs them).

from vllm_delta.integrations import DeltaSyncCallback
trainer = transformers.Trainer(..., callbacks=[DeltaSyncCallback("s3://bucket/run1", anchor_every=20)])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["DeltaSyncCallback"]

if TYPE_CHECKING:
    from .transformers import DeltaSyncCallback


def __getattr__(name: str) -> Any:
    if name == "DeltaSyncCallback":
        from .transformers import DeltaSyncCallback

        globals()[name] = DeltaSyncCallback
        return DeltaSyncCallback
    raise AttributeError(f"module 'vllm_delta.integrations' has no attribute {name!r}")
