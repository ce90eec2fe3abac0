"""Exchanges between the ranks of a sharded publisher, through the process group's key-value store.

Why not process groups of our own: forming one (`torch.distributed.new_group`) is itself a collective.
A training script that built a second Publisher (a second store, a codec change) deadlocked the
whole job when one rank arrived a few seconds after the other: gloo reuses a destroyed group's name
and its rendezvous found the stale keys of the first Publisher's groups (issue 25; reproduced with
two ranks on CPU, one sleeping 3 s). The key-value store that every process group is built on
(`TCPStore` under torchrun and `init_process_group`) needs no forming: creating a `RankChannel` does
no I/O and never blocks, and every wait on it has a deadline.

One exchange (`exchange`): every rank writes its message under its own key, rank 0 (the group's first
rank) waits for all of them with a deadline, computes one result from the list (`decide`) and writes it
under one key, which every other rank waits for, again with a deadline. So each rank reads one value
per exchange, and the store serves O(world) requests per exchange, not O(world^2). If `decide` raises
on rank 0, every rank raises the same error (ShardingError with rank 0's message). `broadcast` is an
exchange where only rank 0 speaks.

Keys: `vllm_delta/publisher/<ranks>/<instance>/<channel>/<exchange>/(in/<rank> | out)`, where
`<ranks>` names the group's global ranks and `<instance>` counts the publishers this process created
on that group: every rank must create its Publishers in the same order (as it must for any collective
object), and a new Publisher never reads what an earlier one left. Keys are deleted once read (a
rank deletes its own message when it has rank 0's answer; rank 0 deletes an answer once every rank
has arrived at a later exchange, so has read it).

A wait that passes its deadline raises RankTimeoutError naming the ranks that did not arrive, and the
channel is broken from then on (its exchange numbers no longer match across ranks): every later
exchange raises at once; a new Publisher (on every rank) starts a new channel.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from ..errors import PublishError, RankTimeoutError, ShardingError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

M = TypeVar("M")
R = TypeVar("R")

log = logging.getLogger(__name__)

KEY_ROOT = "vllm_delta/publisher"
CLOSE_WAIT_S = 60.0  # rank 0's wait at close for the other ranks to leave (they have nothing left to do)

_instances: dict[str, itertools.count[int]] = {}
_instances_lock = threading.Lock()


@dataclass(frozen=True)
class _Answer(Generic[R]):
    value: R | None
    error: str | None = None  # rank 0's `decide` raised: every rank raises the same error
    disagreement: bool = False  # ...and it was a ShardingError (else a PublishError)

    def raise_error(self, cause: BaseException | None = None) -> None:
        if self.error is not None:
            raise (ShardingError if self.disagreement else PublishError)(self.error) from cause


def group_ranks(group: ProcessGroup) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def next_instance(ranks: Sequence[int]) -> str:
    """`<ranks>/<instance>`: this process's next publisher on the group of `ranks` (global ranks)."""
    tag = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]
    with _instances_lock:
        n = next(_instances.setdefault(tag, itertools.count()))
    return f"{tag}/{n}"


def group_store(group: ProcessGroup) -> Store:
    """The key-value store under the default process group (every process of a job reaches it)."""
    from torch.distributed import distributed_c10d as c10d

    del group  # every subgroup's ranks reach the default store; subgroup stores are prefixed by group name
    return c10d._get_default_store()


class RankChannel:
    """A sequence of exchanges among the ranks of one group (see the module docstring). Not
    thread-safe: each thread that exchanges uses its own channel (each has its own store client)."""

    def __init__(
        self,
        store: Store,
        *,
        instance: str,
        name: str,
        rank: int,
        world: int,
        timeout_s: float,
    ):
        self.rank, self.world, self.name = rank, world, name
        self.timeout_s = timeout_s
        self._prefix = f"{KEY_ROOT}/{instance}/{name}"
        self._store, self._blocking_wait = _own_client(store)
        self._n = 0  # the next exchange
        self._unread_answers: list[str] = []  # rank 0: answers written, not yet known read by everyone
        self.broken: str | None = None
        self.last_wait_ms = 0.0  # how long the last exchange waited for other ranks (a phase's named wait)

    # -- the exchanges -------------------------------------------------------------------------------
    def exchange(self, mine: M, decide: Callable[[list[M]], R], *, what: str) -> R:
        """Every rank sends `mine`; rank 0 computes `decide(every rank's message)`, every rank returns it."""
        n = self._begin(what)
        key_in = f"{self._prefix}/{n}/in/{self.rank}"
        key_out = f"{self._prefix}/{n}/out"
        t0 = time.perf_counter()
        if self.rank != 0:
            self._store.set(key_in, _blob(mine))
            t0 = time.perf_counter()
            answer: _Answer[R] = pickle.loads(self._wait_get([key_out], what, n)[0])
            self.last_wait_ms = (time.perf_counter() - t0) * 1e3  # for rank 0's gather and decide
            self._store.delete_key(key_in)
        else:
            others = [f"{self._prefix}/{n}/in/{r}" for r in range(1, self.world)]
            received = self._wait_get(others, what, n)
            self.last_wait_ms = (time.perf_counter() - t0) * 1e3  # for the other ranks' messages
            msgs = [mine] + [pickle.loads(b) for b in received]
            self._forget_read_answers()  # every rank arrived here: it read every earlier answer
            try:
                answer = _Answer(decide(msgs))
            except ShardingError as exc:  # the ranks disagree: every rank raises the same message
                answer = _Answer(None, str(exc), disagreement=True)
                self._publish_answer(key_out, answer)
                answer.raise_error(exc)
            except Exception as exc:  # noqa: BLE001 - every rank raises it
                answer = _Answer(None, f"rank 0 failed at {what}: {type(exc).__name__}: {exc}")
                self._publish_answer(key_out, answer)
                answer.raise_error(exc)
            self._publish_answer(key_out, answer)
        answer.raise_error()
        return answer.value  # type: ignore[return-value]  # None only where decide returned None

    def all_gather(self, mine: M, *, what: str) -> list[M]:
        """Every rank's message, on every rank (keep messages small: each rank reads world of them)."""
        return self.exchange(mine, list, what=what)

    def broadcast(self, value: R | None, *, what: str) -> R:
        """Rank 0's `value` on every rank (the others pass None); every rank waits for rank 0."""
        return self.exchange(value, lambda msgs: msgs[0], what=what)  # type: ignore[return-value]

    @contextlib.contextmanager
    def longer_deadline(self, extra_s: float) -> Iterator[None]:
        """Exchanges inside wait `extra_s` longer (rank 0 does something slow first, with its own deadline)."""
        saved = self.timeout_s
        self.timeout_s = saved + extra_s
        try:
            yield
        finally:
            self.timeout_s = saved

    def close(self) -> None:
        """Leave the channel, then delete what this rank wrote (best effort: logged, never raised).

        A rank's exchanges run in order, so by its close it has read every answer; it says so under
        `closed/<rank>`. Rank 0 waits for that from every rank (at most CLOSE_WAIT_S, and not at all once
        the channel broke) before it deletes its answers: otherwise a rank still to read the last answer
        (a commit decision) could find it deleted, or the store gone with rank 0's process, and fail a
        version that was committed."""
        try:
            if self.world > 1 and self._n > 0:
                closed = [f"{self._prefix}/closed/{r}" for r in range(1, self.world)]
                if self.rank != 0:
                    self._store.set(closed[self.rank - 1], _blob(True))
                elif self.broken is None:
                    self._wait(closed, min(self.timeout_s, CLOSE_WAIT_S))
                    for key in closed:
                        self._delete(key)
        except Exception as exc:  # noqa: BLE001 - a peer gone at close changes nothing already committed
            log.warning("rank %d: the other ranks did not all leave the %s channel: %s", self.rank, self.name, exc)
        for key in self._unread_answers:
            self._delete(key)
        self._unread_answers = []

    # -- internals -----------------------------------------------------------------------------------
    def _begin(self, what: str) -> int:
        if self.broken is not None:
            raise PublishError(
                f"rank {self.rank}: the publisher group failed earlier ({self.broken}); "
                "create a new Publisher on every rank to publish again"
            )
        n = self._n
        self._n += 1
        return n

    def _publish_answer(self, key: str, answer: _Answer[R]) -> None:
        self._store.set(key, _blob(answer))
        self._unread_answers.append(key)

    def _forget_read_answers(self) -> None:
        for key in self._unread_answers:
            self._delete(key)
        self._unread_answers = []

    def _delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception:  # noqa: BLE001 - a leftover key costs a few bytes, never correctness
            pass

    def _wait_get(self, keys: list[str], what: str, n: int) -> list[bytes]:
        if keys:
            try:
                self._wait(keys)
            except _Timeout:
                missing = self._missing(n)
                self.broken = (
                    f"ranks {missing} did not arrive at {what} within {self.timeout_s:g} s "
                    f"(exchange {n} of the {self.name} channel)"
                )
                raise RankTimeoutError(
                    f"rank {self.rank}: the publisher group failed: {self.broken}. A rank died, hangs, or "
                    "publishes on another schedule (every rank calls publish and flush for the same "
                    "versions, and creates its Publishers in the same order); the deadline is "
                    "ShardingOptions(timeout_s)",
                    missing=missing,
                ) from None
            except Exception as exc:  # noqa: BLE001 - the store itself failed (its host died)
                self.broken = f"{type(exc).__name__}: {exc}"
                raise PublishError(
                    f"rank {self.rank}: the publisher group failed: its key-value store failed at {what} "
                    f"({self.broken})"
                ) from exc
        return _multi_get(self._store, keys)

    def _missing(self, n: int) -> list[int]:
        """The ranks that did not arrive at exchange n: those whose message is absent; if every message
        is there, rank 0 (it did not answer). Any rank can tell: the keys are the same for all."""
        out = []
        for r in range(1, self.world):
            try:
                present = self._store.check([f"{self._prefix}/{n}/in/{r}"])
            except Exception:  # noqa: BLE001 - the store is gone: say every awaited rank
                present = False
            if not present:
                out.append(r)
        return out or [0]

    def _wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self._blocking_wait:
            try:
                self._store.wait(keys, datetime.timedelta(seconds=timeout_s))
            except Exception as exc:
                if time.monotonic() >= deadline - 0.05 or "timeout" in str(exc).lower():
                    raise _Timeout() from exc
                raise
            return
        # A store client shared with another thread (no clone): poll, so this thread never holds the
        # client's lock for the whole wait.
        pause = 0.0005
        while not self._store.check(keys):
            if time.monotonic() >= deadline:
                raise _Timeout()
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


class _Timeout(Exception):
    pass


def _own_client(store: Store) -> tuple[Store, bool]:
    """A client of `store` for this channel alone (`Store.clone`), so that a blocking wait here never
    holds up another thread's store calls (a TCPStore client holds its lock for the whole of a wait).
    Stores that cannot clone are polled instead."""
    try:
        return store.clone(), True  # type: ignore[attr-defined]  # torch >= 2.5; not in its stubs
    except Exception:  # noqa: BLE001 - FileStore/HashStore, older torch
        return store, False


def _blob(obj: object) -> str:
    """`Store.set` takes bytes at run time; its stubs say str."""
    return pickle.dumps(obj)  # type: ignore[return-value]


def _multi_get(store: Store, keys: list[str]) -> list[bytes]:
    if len(keys) > 1:
        try:
            return list(store.multi_get(keys))
        except Exception:  # noqa: BLE001 - stores without multi_get: one get per key
            pass
    return [store.get(k) for k in keys]


__all__ = ["KEY_ROOT", "RankChannel", "group_ranks", "group_store", "next_instance"]
