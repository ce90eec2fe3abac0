"""Position-weighted additive checksum of tensor bit patterns (definition: docs/FORMAT.md).

    w(p)       = (p + 1) * 0x9E3779B97F4A7C15            mod 2^64
    sum(t)     = Σ_p w(p) * (bits(t[p]) + 1)               mod 2^64   p = row-major flat index
    key(name)  = blake2b-64(name, little endian) | 1
    checksum   = Σ_t key(name_t) * sum(t)                  mod 2^64   -> 16 hex digits

Everything is a sum of per-element terms, so partial sums over disjoint shards (tensor-parallel
ranks, chunks) add up to the whole, in any order. `w` is odd for every p, so any single changed
element always changes the sum. The arithmetic is int64 with two's-complement wrap-around, which is
exactly arithmetic mod 2^64 on CPU and GPU.
"""

from __future__ import annotations

import hashlib
import sys
import types
from collections.abc import Iterable, Mapping

import torch

MASK64 = (1 << 64) - 1
_K = 0x9E3779B97F4A7C15
_K_SIGNED = _K - (1 << 64)  # the same bits as a torch int64 scalar
_CHUNK = 1 << 22  # bounds temporary memory to a few 32 MiB int64 buffers

_INT_VIEW = {2: torch.int16, 4: torch.int32}
_UNSIGNED_MASK = {2: 0xFFFF, 4: 0xFFFFFFFF}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of the same width (no copy)."""
    size = t.element_size()
    if size not in _INT_VIEW or not t.is_floating_point():
        raise TypeError(f"checksum covers 16- and 32-bit floating point tensors, not {t.dtype}")
    return t.view(_INT_VIEW[size])


def unsigned_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a 16/32-bit float (or its integer bit view) as non-negative int64."""
    size = t.element_size()
    if size not in _UNSIGNED_MASK:
        raise TypeError(f"checksum covers 16- and 32-bit floating point tensors, not {t.dtype}")
    ints = t if not t.is_floating_point() else bit_view(t)
    return ints.to(torch.int64) & _UNSIGNED_MASK[size]


def positional_sum_tensor(bits: torch.Tensor, positions: torch.Tensor | int = 0) -> torch.Tensor:
    """`positional_sum` as a 0-d int64 tensor on the input's device (no host synchronization)."""
    flat = bits.reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = unsigned_bits(flat[start : start + _CHUNK]) + 1
        if isinstance(positions, int):
            pos = torch.arange(
                positions + start, positions + start + chunk.numel(), dtype=torch.int64, device=flat.device
            )
        else:
            pos = positions.reshape(-1)[start : start + _CHUNK].to(torch.int64)
        total += ((pos + 1) * _K_SIGNED * chunk).sum()
    return total


def positional_sum(bits: torch.Tensor, positions: torch.Tensor | int = 0) -> int:
    """Σ w(p) * (bits + 1) mod 2^64 over the given elements.

    `bits` is a float tensor or its integer bit view (flattened). `positions` gives each element's
    flat index in the full tensor: a tensor of the same length, or an int offset of a contiguous run.
    """
    return int(positional_sum_tensor(bits, positions).item()) & MASK64


def name_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1


def tensor_sum(t: torch.Tensor) -> int:
    """The per-tensor sum of a whole tensor (row-major positions)."""
    return positional_sum(t.detach().reshape(-1), 0)


def combine(partials: Iterable[tuple[str, int]]) -> int:
    """Whole-model value from (name, partial sum) pairs; a name may appear several times (shards)."""
    total = 0
    for name, part in partials:
        total = (total + name_key(name) * part) & MASK64
    return total


def to_hex(value: int) -> str:
    return f"{value & MASK64:016x}"


def checksum(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Checksum of named tensors' bit patterns: the value a vLLM server with the plugin reports
    for its live weights, as 16 hex digits. Pass the bf16 tensors (e.g. `{n: p.to(torch.bfloat16)}`)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return to_hex(combine((name, tensor_sum(t)) for name, t in items))


class _CallableModule(types.ModuleType):
    """`from vllm_delta import checksum` must be the function of the public contract, while
    `vllm_delta.checksum` is also this module: the module itself is made callable."""

    def __call__(self, named_tensors) -> str:
        return checksum(named_tensors)


sys.modules[__name__].__class__ = _CallableModule
