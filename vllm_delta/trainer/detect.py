"""Exact change detection: compare the low-precision image of the weights with the last published one.

The snapshot holds the last published bit patterns (2 bytes per parameter for bf16) on the
parameters' device, or in pinned host memory on request. Comparing bit patterns, not values, makes
recall 1.0 by construction: every element whose published bits change is found, including sign
flips of zero and NaN payloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..bits import bit_view
from .names import checkpoint_tensors


def named_tensors(source: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
    """(name, tensor) pairs to publish; tensors sharing storage (tied weights) appear once."""
    items: Iterable[tuple[str, torch.Tensor]]
    if isinstance(source, nn.Module):
        items = checkpoint_tensors(source)  # checkpoint names (names.py); tied duplicates dropped
    elif isinstance(source, Mapping):
        items = source.items()
    else:
        items = source
    seen, out = set(), []
    for name, t in items:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


class Snapshot:
    """The last published image, one flat integer tensor per name."""

    def __init__(self, *, device: torch.device | str | None = None, pin: bool = False):
        self.device = torch.device(device) if device is not None else None
        self.pin = pin
        self.bits: dict[str, torch.Tensor] = {}

    def _home(self, like: torch.Tensor) -> torch.device:
        return self.device if self.device is not None else like.device

    def reset(self, name: str, image: torch.Tensor) -> None:
        """Take a whole tensor image (anchors)."""
        flat = bit_view(image).reshape(-1)
        home = self._home(image)
        if name in self.bits and self.bits[name].numel() == flat.numel() and self.bits[name].device == home:
            self.bits[name].copy_(flat)
            return
        buf = torch.empty(
            flat.numel(),
            dtype=flat.dtype,
            device=home,
            pin_memory=self.pin and home.type == "cpu" and torch.cuda.is_available(),
        )
        buf.copy_(flat)
        self.bits[name] = buf

    def changes(self, name: str, image: torch.Tensor):
        """(positions, new bits, old bits) of the elements whose bits differ, on the image's device."""
        new_all = bit_view(image).reshape(-1)
        old_all = self.bits[name]
        if old_all.numel() != new_all.numel():
            raise ValueError(f"tensor {name!r} changed size: {old_all.numel()} -> {new_all.numel()} elements")
        if old_all.device != new_all.device:
            old_all = old_all.to(new_all.device, non_blocking=True)
        positions = (new_all != old_all).nonzero().reshape(-1)
        return positions, new_all[positions], old_all[positions]

    def update(self, name: str, positions: torch.Tensor, new_bits: torch.Tensor) -> None:
        buf = self.bits[name]
        buf.index_copy_(0, positions.to(buf.device), new_bits.to(buf.device))
