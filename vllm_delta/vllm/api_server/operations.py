"""One update or prefetch at a time in the API process: the lock, what runs since when, the last failure.

Updates and prefetches (the routes and the follower alike) run inside `Operations.run`, so two never
interleave. Status never takes the lock: it shows `in_progress` and `last_failure` as they are. The
running operation's deadline starts with it (deadline.py), and the metrics count it: ours, and vLLM's
own `vllm:rl_weight_update_*` series (metrics.vllm_operation). `refuse` may refuse an operation before
it starts (a server with EPLB: shared/eplb.py), counted as its failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from ...errors import WorkerError, error_type, http_status
from ...server_api import Failure, InProgress, Operation
from .deadline import Deadline
from .metrics import metrics, vllm_operation


class Operations:
    """The update lock, with the state status shows about what holds it."""

    def __init__(self, deadline: Deadline, refuse: Callable[[Operation], None] | None = None) -> None:
        self.lock = asyncio.Lock()
        self.deadline = deadline
        self.refuse = refuse  # raises if this server must not run the operation at all
        self.in_progress: InProgress | None = None
        self.last_failure: Failure | None = None
        self.started = 0  # operations started so far (a recomputation outside the lock notices one starting)

    @property
    def busy(self) -> bool:
        return self.in_progress is not None

    @contextlib.asynccontextmanager
    async def run(self, name: Operation, version: int | str) -> AsyncIterator[None]:
        """Hold the lock for one update or prefetch: its deadline, in-progress state, failure and metrics."""
        async with self.lock:
            self.started += 1
            self.in_progress = InProgress(name, version, time.time())
            self.deadline.start()
            m = metrics()
            if m is not None:
                m.in_progress.set(1)
            try:
                with vllm_operation(name):  # vLLM's vllm:rl_weight_update_* series, beside ours
                    if self.refuse is not None:
                        self.refuse(name)
                    yield
            except Exception as exc:
                type_name = exc.type_name if isinstance(exc, WorkerError) else error_type(exc)
                self.last_failure = Failure(name, version, type_name, http_status(exc), str(exc)[:2000], time.time())
                if m is not None:
                    m.failed(name, type_name, http_status(exc))
                raise
            finally:
                self.in_progress = None
                self.deadline.clear()
                if m is not None:
                    m.in_progress.set(0)
