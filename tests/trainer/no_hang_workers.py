"""What each rank runs in tests/trainer/test_no_hang.py (imported by name in the rank processes).

Every function takes (rank, world, ...) and runs in a real process group (gloo on CPU, or NCCL with
rank r on GPU r: `device`). Ranks publish hand-sharded tensors (ShardedTensor: building them needs no
collective, so a broken group cannot hang the test itself) and return what only they can see: how
long each call took, what they raised.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from vllm_delta import Publisher, ShardedTensor
from vllm_delta.errors import PublishError, RankTimeoutError, ShardingError
from vllm_delta.store import DeltaStore
from vllm_delta.trainer import PublisherOptions, ShardingOptions

ROWS = 8


def tensors(rank: int, world: int, v: int, device: str = "cpu") -> dict[str, ShardedTensor]:
    """This rank's rows of two tensors at version v (the same full tensors on every rank)."""
    gen = torch.Generator().manual_seed(7)
    full = {
        "w.weight": torch.randn(ROWS * world, 16, generator=gen),
        "u.weight": torch.randn(ROWS * world, 4, generator=gen),
    }
    for step in range(1, v + 1):
        g = torch.Generator().manual_seed(100 + step)
        for t in full.values():
            flat = t.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 4]] += 0.05
    r0, r1 = rank * ROWS, (rank + 1) * ROWS
    return {n: ShardedTensor(t[r0:r1].clone().to(device), tuple(t.shape), r0) for n, t in full.items()}


def _device(kind: str, rank: int) -> str:
    """ "cuda": this rank's GPU (NCCL runs rank r on GPU r)."""
    return f"cuda:{rank}" if kind == "cuda" else "cpu"


def _options(timeout_s: float) -> PublisherOptions:
    return PublisherOptions(sharding=ShardingOptions(timeout_s=timeout_s))


def _raised(fn) -> tuple[str | None, str, float]:
    """(exception class name or None, message, seconds) of fn()."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def publishers_in_sequence(rank, world, root, late_rank, late_s, device="cpu"):
    """Publisher A publishes two versions and closes; then every rank builds Publisher B, `late_rank`
    `late_s` after the others (the hang of issue 25), and B publishes two versions; then C, on A's store
    again, with the same lateness."""
    device = _device(device, rank)
    out = {}
    with Publisher(os.path.join(root, "a"), group=dist.group.WORLD, options=_options(60)) as pub:
        for v in range(2):
            pub.publish(tensors(rank, world, v, device), version=v)
    for name, first in (("b", 0), ("a", 2)):
        if rank == late_rank:
            time.sleep(late_s)
        t0 = time.monotonic()
        pub = Publisher(os.path.join(root, name), group=dist.group.WORLD, options=_options(60))
        out[f"construct_{name}_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        infos = [pub.publish(tensors(rank, world, v, device), version=v) for v in (first, first + 1)]
        out[f"first_publish_{name}_s"] = time.monotonic() - t0
        pub.close()
        out[f"kinds_{name}"] = [i.kind for i in infos]
        out[f"checksums_{name}"] = [i.checksum for i in infos]
    return out


def late_beyond_the_deadline(rank, world, root, late_s, timeout_s, device="cpu"):
    """Rank 1 reaches its first publish `late_s` after the others, past the deadline: every rank raises
    RankTimeoutError naming the ranks it waited for; the broken publisher raises at once after that;
    a new Publisher on every rank publishes."""
    device = _device(device, rank)
    uri = os.path.join(root, "late")
    pub = Publisher(uri, group=dist.group.WORLD, options=_options(timeout_s))
    if rank == 1:
        time.sleep(late_s)
    first = _raised(lambda: pub.publish(tensors(rank, world, 0, device), version=0))
    again = _raised(lambda: pub.publish(tensors(rank, world, 0, device), version=0))
    try:
        pub.close()
    except PublishError:
        pass
    # every rank gets here at its own time: the new publisher waits (a longer deadline) for the last
    fresh = Publisher(uri, group=dist.group.WORLD, options=_options(max(60.0, 4 * late_s)))
    info = fresh.publish(tensors(rank, world, 0, device), version=0)
    fresh.close()
    return {"first": first, "again": again, "kind": info.kind, "versions": DeltaStore(uri).versions()}


def dies_before_publishing(rank, world, root, victim, timeout_s, device="cpu"):
    """Ranks publish version 0 together; at version 1 `victim` is killed (SIGKILL) before it reaches
    the group. Every other rank raises within the deadline, naming the victim (or, where the victim
    held the job's key-value store, saying the store failed), and version 1 never becomes visible."""
    device = _device(device, rank)
    uri = os.path.join(root, "dies")
    pub = Publisher(uri, group=dist.group.WORLD, options=_options(timeout_s))
    pub.publish(tensors(rank, world, 0, device), version=0)
    pub.flush()
    dist.barrier()  # every rank has read version 0's outcome (the victim may hold the key-value store)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    raised = _raised(lambda: pub.publish(tensors(rank, world, 1, device), version=1))
    return {"raised": raised, "versions": DeltaStore(uri).versions()}


def different_stores(rank, world, root):
    """Ranks that publish to different stores are refused, on every rank, with the same message."""
    pub = Publisher(os.path.join(root, f"store{rank}"), group=dist.group.WORLD, options=_options(60))
    try:
        pub.publish(tensors(rank, world, 0), version=0)
    except ShardingError as exc:
        return str(exc)
    finally:
        pub.close()
    return None


__all__ = [
    "RankTimeoutError",
    "dies_before_publishing",
    "different_stores",
    "late_beyond_the_deadline",
    "publishers_in_sequence",
]
