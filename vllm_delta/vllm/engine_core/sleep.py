"""No update while the engine sleeps (vLLM's sleep mode: `/sleep`, `/wake_up` in dev mode).

Asleep at level 1 the weights are offloaded to the host, at level 2 discarded; an update then reads and
writes memory that is not there (vLLM #57853: an update while sleeping kills the engine). Only the engine
core knows for sure: its executor's `is_sleeping` (`sleeping_tags`, set by `sleep`, cleared by
`wake_up`). vLLM's `EngineClient.is_sleeping()` in the API process cannot tell: it is also true while
scheduling is merely paused (its `EngineCore.is_sleeping` is `is_scheduler_paused() or
model_executor.is_sleeping`), as in every pause of an update. Level 0 (a pause of scheduling only, no
memory change) is not sleep here.

So the engine core refuses, with EngineSleepingError (409), every call of ours that reads or writes the
weights while its executor sleeps, before it reaches a worker: staging, writes, rollbacks, the probe,
the live sums (rpc.py names them); and the reserved PATCH_ALL (engine_core/calls.py). The engine core
runs those calls and vLLM's `sleep` one at a time between engine steps, so the check and the call
cannot be split by a sleep. A `/sleep` sent while a staging runs on a worker's background thread is not
refused (that is vLLM's route); the update's next call (its poll, its write) is.
"""

from __future__ import annotations

from typing import Any

from ...errors import EngineSleepingError
from ..shared import rpc

# Worker calls that read or write the weights (STATUS only with its live sums)
GUARDED = frozenset(
    c.name for c in (rpc.PROBE, rpc.LIVE_SUMS, rpc.STAGE_START, rpc.PATCH, rpc.ROLLBACK, rpc.TEST_PATCH)
)


def sleeping(core: Any) -> list[str] | None:
    """What the engine core's executor keeps asleep (its sleep tags), or None when it is awake."""
    executor = getattr(core, "model_executor", None)
    if not getattr(executor, "is_sleeping", False):
        return None
    return sorted(getattr(executor, "sleeping_tags", None) or ["weights"])


def refusal(what: str, tags: list[str]) -> EngineSleepingError:
    return EngineSleepingError(
        f"vllm-delta refuses {what}: the engine sleeps (vLLM's sleep mode; asleep: {', '.join(tags)}), its weights "
        "are not in place, and an update now would kill it (vLLM #57853); nothing was applied: POST /wake_up first"
    )


def refuse_asleep(core: Any, what: str = "weight updates") -> None:
    """EngineSleepingError (409) if the engine core's executor sleeps."""
    tags = sleeping(core)
    if tags is not None:
        raise refusal(what, tags)


def guarded_call(core: Any, method: str, kwargs: dict[str, Any] | None) -> EngineSleepingError | None:
    """The refusal of one of our worker calls while the engine sleeps (None: let it through)."""
    if method == rpc.STATUS.name:
        if not (kwargs or {}).get("live_sums"):
            return None  # what a rank serves: no weight is read
    elif method not in GUARDED:
        return None
    tags = sleeping(core)
    return None if tags is None else refusal(f"{method} (it reads or writes the weights)", tags)
