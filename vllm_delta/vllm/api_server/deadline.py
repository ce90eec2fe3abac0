"""The running update's deadline in the API process: everything an update does before its pause.

Every store operation is bounded by the store's own `timeout_s` (store.py); the whole of an update
or prefetch before its pause by `update_timeout_s`. Past it the update fails with StoreTimeoutError
(504) and nothing is written. The pause itself is never cut short (`clear` before the writes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from ...errors import StoreTimeoutError

R = TypeVar("R")
NONE = float("inf")


class Deadline:
    def __init__(self, timeout_s: float, store_uri: str):
        self.timeout_s = timeout_s
        self.store_uri = store_uri
        self.until = NONE  # time.monotonic() by which the running update must reach its pause

    def start(self) -> None:
        self.until = time.monotonic() + self.timeout_s

    def clear(self) -> None:
        self.until = NONE

    def left(self, what: str, until: float | None = None) -> float:
        """Seconds left before the deadline (or `until`, a time.monotonic()); StoreTimeoutError when
        none are."""
        left = (self.until if until is None else until) - time.monotonic()
        if left <= 0:
            raise StoreTimeoutError(
                f"the update did not reach its pause within {self.timeout_s:.0f} s "
                f"(update_timeout_s; store {self.store_uri}, while {what}): nothing was written"
            )
        return left

    async def in_thread(self, fn: Callable[[], R], until: float | None = None) -> R:
        """`fn()` on a thread (store I/O stays off the event loop), bounded by the deadline (or `until`).
        A call past it is abandoned (its own store timeout ends it) and StoreTimeoutError is raised."""
        what = str(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "a store operation"))
        end = self.until if until is None else until
        future = asyncio.get_running_loop().run_in_executor(None, fn)
        try:
            return await asyncio.wait_for(future, self.left(what, end) if end != NONE else None)
        except asyncio.TimeoutError:
            self.left(what, end)  # raises: the deadline has passed
            raise
