"""vllm-delta: publish sparse bf16 weight deltas, apply them in place inside vLLM.

    from vllm_delta import Publisher, checksum, DeltaStore
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Publisher", "PublishInfo", "DeltaStore", "checksum", "materialize", "replay", "__version__"]

# Lazy: vLLM imports this package in every process through the plugin entry point, and most of
# those processes never publish anything.
_LAZY = {
    "Publisher": ("vllm_delta.trainer.publisher", "Publisher"),
    "PublishInfo": ("vllm_delta.trainer.publisher", "PublishInfo"),
    "DeltaStore": ("vllm_delta.store", "DeltaStore"),
    "checksum": ("vllm_delta.checksum", None),  # a callable module: checksum(named_tensors) -> str
    "materialize": ("vllm_delta.materialize", "materialize"),
    "replay": ("vllm_delta.materialize", "replay"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'vllm_delta' has no attribute {name!r}")
