"""Position-weighted additive checksum of tensor bit patterns (definition: docs/FORMAT.md).

    w(p)       = (p + 1) * 0x9E3779B97F4A7C15            mod 2^64
    sum(t)     = Σ_p w(p) * (bits(t[p]) + 1)               mod 2^64   p = row-major flat index
    key(name)  = blake2b-64(name, little endian) | 1
    checksum   = Σ_t key(name_t) * sum(t)                  mod 2^64   -> 16 hex digits

Everything is a sum of per-element terms, so partial sums over disjoint shards (tensor-parallel
ranks, chunks) add up to the whole, in any order, and an update changes a tensor's sum by
Σ w(p) (bits(new) - bits(old)) over its changed elements (`partial_terms`). `w` is odd for every p,
so any single changed element always changes the sum. The arithmetic is int64 with two's-complement
wrap-around, which is exactly arithmetic mod 2^64 on CPU and GPU.

This module is the one home of the constants and of every sum over them (the chunked codec's chunk
hashes included); it needs only torch and numpy.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np
import torch

from .bits import UNSIGNED_MASK, unsigned_bits
from .errors import ChecksumMismatchError

MASK64 = (1 << 64) - 1
WEIGHT = 0x9E3779B97F4A7C15
WEIGHT_INT64 = WEIGHT - (1 << 64)  # the same bits as a torch int64 scalar
_CHUNK = 1 << 22  # bounds temporary memory to a few 32 MiB int64 buffers

Sums = dict[str, int]  # HF tensor name -> positional sum (or a partial of it), mod 2^64


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
        total += ((pos + 1) * WEIGHT_INT64 * chunk).sum()
    return total


def positional_sum(bits: torch.Tensor, positions: torch.Tensor | int = 0) -> int:
    """Σ w(p) * (bits + 1) mod 2^64 over the given elements.

    `bits` is a float tensor or its integer bit view (flattened). `positions` gives each element's
    flat index in the full tensor: a tensor of the same length, or an int offset of a contiguous run.
    """
    return int(positional_sum_tensor(bits, positions).item()) & MASK64


def partial_terms(positions: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor) -> torch.Tensor:
    """Per element, w(p) * (bits(new) - bits(old)) as int64 (wrapping): what an update adds to a sum.

    `positions` int64 (consumed: updated in place), `new_bits`/`old_bits` integer bit views of one width."""
    mask = UNSIGNED_MASK[new_bits.element_size()]
    delta = (new_bits.to(torch.int64) & mask) - (old_bits.to(torch.int64) & mask)
    return positions.add_(1).mul_(WEIGHT_INT64).mul_(delta)


def chunk_hashes(blob: torch.Tensor, chunk_bytes: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Hash of each chunk of a blob (the chunked codec's integrity check, docs/FORMAT.md):
    h = Σ_j w(j) · word_j mod 2^64 over the chunk's little-endian 64-bit words (j from 0 in each
    chunk). `blob` uint8, chunks laid end to end with `chunk_bytes` (int64, multiples of 8) bytes
    each. Returns int64 [chunks] on the blob's device; `chunk_hash_np` is the same for one chunk."""
    dev = blob.device
    host_counts = torch.as_tensor(chunk_bytes, dtype=torch.int64).cpu() // 8
    counts = host_counts.to(dev, non_blocking=True)
    out = torch.zeros(counts.numel(), dtype=torch.int64, device=dev)
    if not counts.numel():
        return out
    words = blob.view(torch.int64)
    host_ends = torch.cumsum(host_counts, 0).tolist()
    first, at = 0, 0
    while first < counts.numel():  # groups of whole chunks of about _CHUNK words (bounded temporaries)
        last = first
        while last + 1 < counts.numel() and host_ends[last + 1] - at <= _CHUNK:
            last += 1
        stop = host_ends[last]
        cnt = counts[first : last + 1]
        seg = torch.repeat_interleave(torch.arange(cnt.numel(), device=dev), cnt, output_size=stop - at)
        j = torch.arange(stop - at, dtype=torch.int64, device=dev) - (torch.cumsum(cnt, 0) - cnt)[seg]
        terms = j.add_(1).mul_(WEIGHT_INT64).mul_(words[at:stop])
        out[first : last + 1].index_add_(0, seg, terms)
        first, at = last + 1, stop
    return out


def chunk_hashes_np(data: np.ndarray, chunk_bytes: np.ndarray) -> np.ndarray:
    """`chunk_hashes` on the host: numpy uint8 `data` of chunks laid end to end (`chunk_bytes` each,
    multiples of 8) -> int64 [chunks] (the index's signed values)."""
    words = np.frombuffer(np.ascontiguousarray(data), dtype="<u8")
    counts = np.asarray(chunk_bytes, dtype=np.int64) // 8
    starts = np.cumsum(counts) - counts
    j = np.arange(1, words.size + 1, dtype=np.uint64) - np.repeat(starts, counts).astype(np.uint64)
    terms = words * (j * np.uint64(WEIGHT))
    sums = np.add.reduceat(terms, starts) if words.size else np.zeros(0, dtype=np.uint64)
    sums[counts == 0] = 0
    return sums.view(np.int64)


def chunk_hash_np(data: np.ndarray) -> int:
    """`chunk_hashes` of one chunk's bytes (numpy uint8, length a multiple of 8), as a signed int64
    value (what the index stores)."""
    words = np.frombuffer(data.tobytes() if not data.flags.c_contiguous else data, dtype="<u8")
    weights = np.arange(1, words.size + 1, dtype=np.uint64) * np.uint64(WEIGHT)
    h = int((words * weights).sum(dtype=np.uint64))
    return h - (1 << 64) if h >= 1 << 63 else h


@functools.lru_cache(maxsize=1 << 18)
def name_key(name: str) -> int:
    """key(name) (module docstring). Memoized: a publish combines every tensor's sum with its key, twice
    per version, and a model's names never change (19K blake2b digests are ~30 ms per publish at
    30B-A3B; 2^18 names cover the largest MoE checkpoints)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1


def tensor_sum(t: torch.Tensor) -> int:
    """The per-tensor sum of a whole tensor (row-major positions)."""
    return positional_sum(t.detach().reshape(-1), 0)


def add_sums(parts: Iterable[Mapping[str, int]]) -> Sums:
    """Per-tensor sums of several shards (ranks) or increments, added up mod 2^64."""
    total: Sums = {}
    for part in parts:
        for name, value in part.items():
            total[name] = (total.get(name, 0) + value) & MASK64
    return total


def combine(partials: Iterable[tuple[str, int]]) -> int:
    """Whole-model value from (name, partial sum) pairs; a name may appear several times (shards)."""
    total = 0
    for name, part in partials:
        total = (total + name_key(name) * part) & MASK64
    return total


def name_keys(names: Iterable[str]) -> np.ndarray:
    """key(name) of each name, as a uint64 array (what `combine_arrays` weighs sums with)."""
    return np.fromiter(map(name_key, names), dtype=np.uint64)


def combine_arrays(keys: np.ndarray, sums: np.ndarray) -> int:
    """`combine(zip(names, sums))` for aligned uint64 arrays (`keys = name_keys(names)`): Σ key · sum mod
    2^64, in numpy's uint64 arithmetic, which wraps (no Python int per tensor)."""
    return int(np.multiply(keys, sums, dtype=np.uint64).sum(dtype=np.uint64))


def to_hex(value: int) -> str:
    return f"{value & MASK64:016x}"


def is_hex(value: object) -> bool:
    """Whether `value` is a checksum as files and records store it: 16 lower-case hex digits (a
    regular expression: a header checks one per tensor, per part file)."""
    return isinstance(value, str) and _HEX16.fullmatch(value) is not None


_HEX16 = re.compile(r"[0-9a-f]{16}")


def from_hex(text: str) -> int:
    """A 16-hex-digit checksum as an int; ValueError for anything else."""
    if not isinstance(text, str) or len(text) != 16 or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise ValueError(f"a checksum is 16 hex digits, not {text!r:.40}")
    return int(text, 16)


def sum_of_parts(part_checksums: Iterable[str]) -> str:
    """A multi-part version's checksum from its parts': each part's is Σ_t key(t) · (partial sum of t
    over the elements it owns), so the parts' checksums add up to the whole (16 hex digits each)."""
    return to_hex(sum(from_hex(c) for c in part_checksums))


def checksum(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """Checksum of named tensors' bit patterns: the value a vLLM server with the plugin reports
    for its live weights, as 16 hex digits. Pass the bf16 tensors (e.g. `{n: p.to(torch.bfloat16)}`)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return to_hex(combine((name, tensor_sum(t)) for name, t in items))


class _Entry(Protocol):
    @property
    def checksum(self) -> str: ...


class _Header(Protocol):
    """What verification reads of a version header (format.VersionHeader)."""

    @property
    def version(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, _Entry]: ...


def verify_partials(
    current: Mapping[str, int], partials: Iterable[Mapping[str, int]], expected: _Header, *, engine: int | None = None
) -> None:
    """Check that the current per-tensor sums plus every rank's staged partials give the per-tensor
    checksums `expected` (the target version's header) records. Raises ChecksumMismatchError naming
    the first tensor that disagrees (and `engine`, the data-parallel engine whose ranks staged them,
    when there are several); nothing has been written at this point."""
    have = add_sums([current, *partials])
    where = f"engine {engine}: " if engine is not None else ""
    tensors = expected.tensors
    values = getattr(tensors, "sum_values", None)  # a header's table (format.TensorTable): its columns
    if values is not None:
        names: list[str] = list(tensors)
        if list(map(have.get, names, itertools.repeat(0))) == values():  # the common case: no per-tensor object
            return
    for name, entry in tensors.items():
        got = have.get(name, 0)
        if got != int(entry.checksum, 16):
            raise ChecksumMismatchError(
                f"{where}staged result would have checksum {to_hex(got)}, the publisher recorded {entry.checksum}",
                version=expected.version,
                tensor=name,
            )


__all__ = [
    "MASK64",
    "Sums",
    "add_sums",
    "chunk_hash_np",
    "chunk_hashes_np",
    "chunk_hashes",
    "checksum",
    "combine",
    "combine_arrays",
    "from_hex",
    "is_hex",
    "name_key",
    "name_keys",
    "partial_terms",
    "positional_sum",
    "positional_sum_tensor",
    "sum_of_parts",
    "tensor_sum",
    "to_hex",
    "verify_partials",
]
