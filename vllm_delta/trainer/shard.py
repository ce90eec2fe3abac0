"""Who publishes which elements: ownership of the tensors of a sharded (or single-process) trainer.

Every element of every published tensor has exactly one owning rank, which detects, encodes and
uploads it. The unit is a range of rows of dim 0 (a 0-d tensor is one row):

* a DTensor sharded on dim 0 (`Shard(0)`: FSDP2's parameters): the rank's local rows, at the row
  offset its spec gives (`compute_local_shape_and_global_offset`, no collective); uneven and empty
  shards are fine. On a mesh that also replicates (HSDP), the replica at coordinate 0 of the
  replicating mesh dimensions owns the rows;
* a `ShardedTensor(local, global_shape, row_offset)`: frameworks that shard by hand say the same;
* a replicated tensor (a plain tensor, or a DTensor with only `Replicate()` placements): one owner
  for the whole tensor, chosen identically on every rank from the names and sizes alone (largest
  first, each to the rank with the least replicated elements so far; ties to the lower rank).

A single process (world size 1) owns everything whole. `spec` is what all ranks must agree on (the
tensor names, global shapes and how each is held); the Publisher checks that through its group, and
checks that the gathered row ranges of every sharded tensor tile it without gaps or overlaps.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..checksums import name_keys
from ..errors import ShardingError


@dataclass(frozen=True)
class ShardedTensor:
    """A rank's rows of a tensor sharded by hand on dim 0: `local` holds global rows
    [row_offset, row_offset + local.shape[0]) of a tensor of `global_shape` (0 rows: an empty shard)."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    row_offset: int


@dataclass
class Owned:
    """The elements of one tensor this rank owns: rows [row0, row1) of the global tensor."""

    name: str
    source: torch.Tensor  # the rank's data for those rows (any float dtype, any device), flat
    shape: tuple[int, ...]  # global shape
    row0: int
    row1: int

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def start(self) -> int:
        """Global flat position of the first owned element."""
        return self.row0 * self.row_size

    @property
    def count(self) -> int:
        return (self.row1 - self.row0) * self.row_size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        return (self.row1 - self.row0, *self.shape[1:]) if self.shape else ()


@dataclass
class Ownership:
    """This rank's share of one call's tensors."""

    spec: list[tuple[str, tuple[int, ...], str]]  # every tensor: (name, global shape, "shard" | "replicated")
    owned: list[Owned]  # what this rank publishes, in spec order (non-empty ranges only)
    ranges: dict[str, list[int]]  # sharded tensors: the rows this rank holds, [row0, row1) (may be empty)

    # Derived once: an Ownership is reused by every publish of the same tensors (sources.py). Read-only.
    @functools.cached_property
    def fingerprint(self) -> str:
        return _digest(self.spec)

    @functools.cached_property
    def layout_fingerprint(self) -> str:
        return _digest(sorted(self.ranges.items()))

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, shape, _ in self.spec}

    @functools.cached_property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.spec]

    @functools.cached_property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.spec)

    @functools.cached_property
    def owned_at(self) -> np.ndarray:
        """Each owned tensor's index in `names` (intp): where its sums go in a whole-set array."""
        at = {name: i for i, name in enumerate(self.names)}
        return np.fromiter((at[o.name] for o in self.owned), dtype=np.intp, count=len(self.owned))

    def spread(self, owned_values: np.ndarray) -> np.ndarray:
        """Per-owned-tensor uint64 values as a whole-set array (`names` order; 0 where this rank owns
        nothing)."""
        out = np.zeros(len(self.names), dtype=np.uint64)
        out[self.owned_at] = owned_values
        return out

    @functools.cached_property
    def keys(self) -> np.ndarray:
        """checksums.name_keys(names): a whole-set sums array's weights in its checksum."""
        return name_keys(self.names)

    @functools.cached_property
    def part_rows(self) -> dict[str, list[int]]:
        """A part header's row ranges: owned tensor -> [row0, row1). A list per tensor (~19K at
        Qwen3-30B-A3B), made once per resolution of the model, not per publish; every part shares them
        (nothing writes them)."""
        return {o.name: [o.row0, o.row1] for o in self.owned}


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:32]


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard without autograd dispatch (publish reads it every step)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()  # type: ignore[attr-defined]


_SPECS: dict[tuple[object, ...], tuple[tuple[int, ...], int, bool]] = {}  # (shape, mesh, placements) -> local rows


def _dtensor_rows(name: str, t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], int, bool] | None:
    """(local data, global shape, row offset, owner) of a DTensor sharded on dim 0; None if replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    assert isinstance(t, DTensor)
    shape = tuple(int(d) for d in t.shape)
    key = (shape, t.device_mesh, tuple(t.placements))
    cached = _SPECS.get(key)
    if cached is not None:
        local = local_tensor(t)
        if tuple(local.shape) == cached[0]:
            return local, shape, cached[1], cached[2]
    placements = list(t.placements)
    shards = [p for p in placements if isinstance(p, Shard)]
    if not shards:
        if all(isinstance(p, Replicate) for p in placements):
            return None
        raise ShardingError(f"unsupported DTensor placements {placements} (Shard(0) and Replicate() are)", tensor=name)
    if any(p.dim != 0 for p in shards) or not all(isinstance(p, (Shard, Replicate)) for p in placements):
        raise ShardingError(
            f"unsupported DTensor placements {placements}: only dim 0 may be sharded (Shard(0), FSDP2); "
            "pass a ShardedTensor or the full tensor otherwise",
            tensor=name,
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = local_tensor(t)
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local.shape) != tuple(local_shape):
        raise ShardingError(
            f"local shard has shape {tuple(local.shape)}, its DTensor spec says {tuple(local_shape)} "
            "(padded shards are not supported)",
            tensor=name,
        )
    coord: list[int] = list(t.device_mesh.get_coordinate() or [])
    owner = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
    row0 = int(offset[0]) if shape else 0
    _SPECS[key] = (tuple(local.shape), row0, owner)
    return local, shape, row0, owner


def resolve(tensors: list[tuple[str, object]], rank: int = 0, world: int = 1) -> Ownership:
    """This rank's share of `tensors` ((name, tensor | DTensor | ShardedTensor) pairs)."""
    spec: list[tuple[str, tuple[int, ...], str]] = []
    sharded: dict[str, tuple[torch.Tensor, int, bool]] = {}
    replicated: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if isinstance(t, ShardedTensor):
            shape = tuple(int(d) for d in t.global_shape)
            local = t.local
            if world == 1 and (t.row_offset != 0 or tuple(local.shape) != shape):
                raise ShardingError("a ShardedTensor in a single process must hold the whole tensor", tensor=name)
            if tuple(local.shape[1:]) != shape[1:] or (not shape and local.dim() != 0):
                raise ShardingError(f"local shape {tuple(local.shape)} does not fit global {shape}", tensor=name)
            rows = int(local.shape[0]) if shape else 1
            if t.row_offset < 0 or t.row_offset + rows > _rows(shape):
                raise ShardingError(
                    f"rows [{t.row_offset}, {t.row_offset + rows}) outside the tensor's {_rows(shape)} rows",
                    tensor=name,
                )
            spec.append((name, shape, "shard"))
            sharded[name] = (local, t.row_offset, True)
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r}: expected a tensor, a DTensor or a ShardedTensor, not {type(t).__name__}")
        if _is_dtensor(t):
            if world == 1 and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                raise ShardingError(
                    "a DTensor in a job of several ranks: pass the Publisher a process group (group=...)", tensor=name
                )
            held = _dtensor_rows(name, t)
            if held is None:
                spec.append((name, tuple(int(d) for d in t.shape), "replicated"))
                replicated[name] = local_tensor(t)
                continue
            local, shape, offset, owner = held
            spec.append((name, shape, "shard"))
            sharded[name] = (local, offset, owner)
            continue
        spec.append((name, tuple(int(d) for d in t.shape), "replicated"))
        replicated[name] = t
    owners = replicated_owners([(n, s) for n, s, k in spec if k == "replicated"], world)
    owned: list[Owned] = []
    ranges: dict[str, list[int]] = {}
    for name, shape, kind in spec:
        if kind == "shard":
            local, offset, owner = sharded[name]
            n_rows = (int(local.shape[0]) if shape else 1) if owner else 0
            ranges[name] = [offset, offset + n_rows]
            if n_rows:
                owned.append(Owned(name, local.detach().reshape(-1), shape, offset, offset + n_rows))
        elif owners[name] == rank:
            t = replicated[name]
            owned.append(Owned(name, t.detach().reshape(-1), shape, 0, _rows(shape)))
    return Ownership(spec=spec, owned=[o for o in owned if o.count], ranges=ranges)


def replicated_owners(tensors: list[tuple[str, tuple[int, ...]]], world: int) -> dict[str, int]:
    """The owning rank of each replicated tensor: largest first, to the least loaded rank."""
    load = [0] * world
    out = {}
    for name, shape in sorted(tensors, key=lambda x: (-math.prod(x[1]), x[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += math.prod(shape)
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def check_layouts(spec: list[tuple[str, tuple[int, ...], str]], ranges: list[dict[str, list[int]]]) -> None:
    """Every sharded tensor's rows are held exactly once over the ranks (`ranges[rank]`); raises
    ShardingError naming the tensor and the ranks otherwise."""
    for name, shape, kind in spec:
        if kind != "shard":
            continue
        held = sorted(
            (r[name][0], r[name][1], rank) for rank, r in enumerate(ranges) if name in r and r[name][1] > r[name][0]
        )
        missing = [rank for rank, r in enumerate(ranges) if name not in r]
        if missing:
            raise ShardingError(f"ranks {missing} report no shard of the tensor", tensor=name)
        covered, last = 0, None
        for r0, r1, rank in held:
            if r0 < covered:
                raise ShardingError(
                    f"rows [{r0}, {min(r1, covered)}) are held by ranks {last} and {rank} (overlapping shards)",
                    tensor=name,
                )
            if r0 > covered:
                who = f"between ranks {last} and {rank}" if last is not None else f"before rank {rank}"
                raise ShardingError(f"rows [{covered}, {r0}) are held by no rank ({who})", tensor=name)
            covered, last = r1, rank
        if covered != _rows(shape):
            after = f"after rank {last}" if last is not None else "by any rank"
            raise ShardingError(f"rows [{covered}, {_rows(shape)}) are held by no rank ({after})", tensor=name)


def describe_mismatch(specs: list[list[tuple[str, tuple[int, ...], str]]]) -> str:
    """What differs between the ranks' tensor sets, naming a tensor and the ranks."""
    by_rank = [{n: (tuple(s), k) for n, s, k in spec} for spec in specs]
    names = sorted(set().union(*by_rank))
    for name in names:
        views = [d.get(name) for d in by_rank]
        if len(set(views)) > 1:
            parts = []
            for view in dict.fromkeys(views):
                ranks = [r for r, v in enumerate(views) if v == view]
                what = "lack it" if view is None else f"have shape {list(view[0])} ({view[1]})"
                parts.append(f"ranks {ranks} {what}")
            return f"tensor {name!r}: " + "; ".join(parts)
    order = [[n for n, _, _ in spec] for spec in specs]
    return f"the ranks list the same tensors in different orders (rank 0: {order[0][:3]}...)"


__all__ = ["Owned", "Ownership", "ShardedTensor", "check_layouts", "describe_mismatch", "replicated_owners", "resolve"]
