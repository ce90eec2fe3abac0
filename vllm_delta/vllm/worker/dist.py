"""The few collectives the workers need among themselves (vLLM's world group, over its CPU/gloo group).

Worker-side code runs in every rank at once (collective_rpc, model loading, the weight-transfer
engine), so ranks can exchange small Python objects: probed boxes, checksum partials, success flags.
Outside a vLLM worker (unit tests) there is one rank.
"""

from __future__ import annotations

from typing import Any


def _world():
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group()
    except Exception:  # noqa: BLE001 - not initialized: a single process
        return None


def rank_and_size() -> tuple[int, int]:
    group = _world()
    if group is None:
        return 0, 1
    return group.rank_in_group, group.world_size


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a blocking collective: every rank must call it)."""
    group = _world()
    if group is None or group.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out
