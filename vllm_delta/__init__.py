"""vllm-delta: publish sparse bf16 weight deltas, apply them in place inside vLLM.

from vllm_delta import Publisher, checksum, DeltaStore
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Lazy: vLLM imports this package in every process through the plugin entry point, and most of
# those processes never publish anything. No public name is also a submodule's name, so importing
# a submodule never shadows a function of the same name.
_LAZY = {
    # trainer side
    "Publisher": "vllm_delta.trainer.publisher",
    "PublishInfo": "vllm_delta.trainer.publisher",
    "ShardedTensor": "vllm_delta.trainer.shard",
    "checksum": "vllm_delta.checksums",
    "checkpoint_tensors": "vllm_delta.trainer.names",
    # stores and readers
    "DeltaStore": "vllm_delta.store",
    "materialize": "vllm_delta.reconstruct",
    "replay": "vllm_delta.reconstruct",
}

__all__ = [
    "Publisher",
    "PublishInfo",
    "ShardedTensor",
    "checksum",
    "checkpoint_tensors",
    "DeltaStore",
    "materialize",
    "replay",
    "__version__",
]

if TYPE_CHECKING:
    from .checksums import checksum
    from .reconstruct import materialize, replay
    from .store import DeltaStore
    from .trainer.names import checkpoint_tensors
    from .trainer.publisher import Publisher, PublishInfo
    from .trainer.shard import ShardedTensor


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups don't come back here
        return value
    raise AttributeError(f"module 'vllm_delta' has no attribute {name!r}")
