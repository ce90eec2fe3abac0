"""Tensors as bit patterns: the one home of "a float tensor's bits as integers" and its dtype maps.

Everything in vllm-delta that compares, encodes, checksums or writes weights works on bit patterns,
never on values: 16- and 32-bit floats are viewed (no copy) as signed integers of the same width.
A leaf module: it imports nothing from the package.
"""

from __future__ import annotations

import numpy as np
import torch

# Element width in bytes -> the signed integer type of that width (torch / numpy).
INT_DTYPE: dict[int, torch.dtype] = {2: torch.int16, 4: torch.int32}
NP_INT: dict[int, type[np.signedinteger]] = {2: np.int16, 4: np.int32}
# Element width in bytes -> the mask that turns a signed bit pattern into its unsigned value.
UNSIGNED_MASK: dict[int, int] = {2: 0xFFFF, 4: 0xFFFFFFFF}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """A 16/32-bit float tensor's elements as signed integers of the same width (no copy)."""
    size = t.element_size()
    if size not in INT_DTYPE or not t.is_floating_point():
        raise TypeError(f"bit patterns are defined for 16- and 32-bit floating point tensors, not {t.dtype}")
    return t.view(INT_DTYPE[size])


def int_view(t: torch.Tensor) -> torch.Tensor:
    """`bit_view` for floats; integer tensors (already bit patterns) pass through."""
    return bit_view(t) if t.is_floating_point() else t


def unsigned_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a 16/32-bit float (or of its integer bit view) as non-negative int64."""
    size = t.element_size()
    if size not in UNSIGNED_MASK:
        raise TypeError(f"bit patterns are defined for 16- and 32-bit tensors, not {t.dtype}")
    return int_view(t).to(torch.int64) & UNSIGNED_MASK[size]


def wrap_add(bits: torch.Tensor, diffs: torch.Tensor, width: int) -> torch.Tensor:
    """(bits + diffs) mod 2^(8·width), as the signed integer type of that width."""
    wide = torch.int32 if width == 2 else torch.int64
    return (bits.to(wide) + diffs.to(wide)).to(INT_DTYPE[width])


def wrap_sub(bits: torch.Tensor, diffs: torch.Tensor, width: int) -> torch.Tensor:
    """(bits - diffs) mod 2^(8·width): the bits a delta's differences were added to (old = new - d, the
    inverse of `wrap_add`), as the signed integer type of that width."""
    wide = torch.int32 if width == 2 else torch.int64
    return (bits.to(wide) - diffs.to(wide)).to(INT_DTYPE[width])


def wrap_diff(new: torch.Tensor, old: torch.Tensor, width: int) -> torch.Tensor:
    """new - old mod 2^(8·width), as a signed int64 in [-2^(8·width-1), 2^(8·width-1))."""
    bits = 8 * width
    d = (new.to(torch.int64) - old.to(torch.int64)) & ((1 << bits) - 1)
    return torch.where(d >= (1 << (bits - 1)), d - (1 << bits), d)


__all__ = [
    "INT_DTYPE",
    "NP_INT",
    "UNSIGNED_MASK",
    "bit_view",
    "int_view",
    "unsigned_bits",
    "wrap_add",
    "wrap_diff",
    "wrap_sub",
]
