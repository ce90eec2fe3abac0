"""The ranks' exchanges over a real key-value store (torch's TCPStore on 127.0.0.1), one thread per rank.

Each "rank" has its own client of the store, as each process of a job has. The process-group tests
(test_no_hang.py) run the same channels under real Publishers in real processes.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from vllm_delta.errors import PublishError, RankTimeoutError, ShardingError
from vllm_delta.testing.ports import free_port
from vllm_delta.trainer.rendezvous import RankChannel, next_instance


@pytest.fixture()
def kv():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))

    def client() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))

    yield server, client


def channels(client, world: int, timeout_s: float = 10.0, instance: str = "t/0") -> list[RankChannel]:
    return [
        RankChannel(client(), instance=instance, name="control", rank=r, world=world, timeout_s=timeout_s)
        for r in range(world)
    ]


def on_every_rank(chans: list[RankChannel], fn: Callable[[RankChannel], Any], delays: dict[int, float] | None = None):
    """fn(channel) on one thread per rank; each rank's result or exception, in rank order."""
    out: list[Any] = [None] * len(chans)

    def run(r: int) -> None:
        time.sleep((delays or {}).get(r, 0.0))
        try:
            out[r] = fn(chans[r])
        except BaseException as exc:  # noqa: BLE001 - compared by the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(chans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_exchanges_give_every_rank_rank_zeros_answer(kv):
    _, client = kv
    chans = channels(client, 3)
    got = on_every_rank(chans, lambda c: c.all_gather(f"from {c.rank}", what="hello"))
    assert got == [["from 0", "from 1", "from 2"]] * 3
    got = on_every_rank(chans, lambda c: c.exchange(c.rank + 1, sum, what="sum"))
    assert got == [6, 6, 6]
    got = on_every_rank(chans, lambda c: c.broadcast({"v": 7} if c.rank == 0 else None, what="bcast"))
    assert got == [{"v": 7}] * 3


def test_late_ranks_are_waited_for(kv):
    _, client = kv
    chans = channels(client, 3)
    t0 = time.monotonic()
    got = on_every_rank(chans, lambda c: c.all_gather(c.rank, what="x"), delays={0: 1.0, 2: 0.5})
    assert got == [[0, 1, 2]] * 3 and time.monotonic() - t0 >= 1.0


def test_keys_are_deleted_once_read(kv):
    server, client = kv
    chans = channels(client, 2)
    base = server.num_keys()
    for i in range(20):
        assert on_every_rank(chans, lambda c, i=i: c.all_gather(i, what="x")) == [[i, i]] * 2
    # what remains: rank 0's last answer (nobody has yet been seen past it)
    assert server.num_keys() - base <= 1
    # every rank closes, rank 1 a moment after rank 0: rank 0 waits for it (it may still have to read the
    # last answer), then deletes what is left
    t0 = time.monotonic()
    closed_at = on_every_rank(chans, lambda c: (c.close(), time.monotonic() - t0)[1], delays={1: 0.3})
    assert closed_at[0] >= 0.3, closed_at  # rank 0 left after rank 1 said it had read everything
    assert server.num_keys() == base


def test_a_rank_that_never_arrives_is_named_and_the_channel_stays_broken(kv):
    _, client = kv
    chans = channels(client, 3, timeout_s=1.0)
    t0 = time.monotonic()
    got = on_every_rank(chans[:2], lambda c: c.all_gather(c.rank, what="agree of version 4"))
    waited = time.monotonic() - t0
    assert 0.9 <= waited < 10
    assert isinstance(got[0], RankTimeoutError) and got[0].missing == [2]
    assert "ranks [2] did not arrive at agree of version 4 within 1 s" in str(got[0])
    # rank 1 waited for rank 0's answer, which never came: it names the rank whose message is absent
    assert isinstance(got[1], RankTimeoutError) and got[1].missing == [2]
    for c in chans[:2]:  # broken: the next exchange raises at once, naming the first failure
        t0 = time.monotonic()
        with pytest.raises(PublishError, match="failed earlier .*did not arrive at agree of version 4"):
            c.all_gather(0, what="agree of version 5")
        assert time.monotonic() - t0 < 0.5
    # a new channel (a new Publisher on every rank) works
    fresh = channels(client, 3, instance="t/1")
    assert on_every_rank(fresh, lambda c: c.all_gather(c.rank, what="x")) == [[0, 1, 2]] * 3


def test_a_missing_rank_zero_is_named(kv):
    _, client = kv
    chans = channels(client, 3, timeout_s=1.0)
    got = on_every_rank(chans[1:], lambda c: c.all_gather(c.rank, what="agree"))
    assert all(isinstance(e, RankTimeoutError) and e.missing == [0] for e in got), got
    assert "ranks [0] did not arrive at agree" in str(got[0])


def test_a_failing_decision_raises_the_same_error_everywhere(kv):
    _, client = kv
    chans = channels(client, 3)

    def disagree(msgs: list[int]) -> int:
        raise ShardingError(f"ranks disagree: {msgs}", tensor="w")

    got = on_every_rank(chans, lambda c: c.exchange(c.rank, disagree, what="x"))
    assert all(isinstance(e, ShardingError) for e in got)
    assert {str(e) for e in got} == {"ranks disagree: [0, 1, 2] (tensor 'w')"}

    def broken(msgs: list[int]) -> int:
        raise KeyError("bug")

    got = on_every_rank(chans, lambda c: c.exchange(c.rank, broken, what="the sums"))
    assert all(type(e) is PublishError for e in got)
    assert {str(e) for e in got} == {"rank 0 failed at the sums: KeyError: 'bug'"}
    # the channel is not broken by a decision that failed: the ranks are still in step
    assert on_every_rank(chans, lambda c: c.all_gather(c.rank, what="x")) == [[0, 1, 2]] * 3


def test_a_blocking_wait_on_one_thread_does_not_hold_up_another(kv):
    """The control and upload channels of one rank are used by two threads: each has its own client."""
    _, client = kv
    shared = client()
    control = [RankChannel(shared, instance="t/0", name="control", rank=r, world=2, timeout_s=10) for r in range(2)]
    upload = [RankChannel(shared, instance="t/0", name="upload", rank=r, world=2, timeout_s=10) for r in range(2)]
    waiting = threading.Thread(target=lambda: upload[0].all_gather(0, what="commit"))
    waiting.start()  # rank 0's upload thread waits for rank 1's upload
    time.sleep(0.2)
    t0 = time.monotonic()
    assert on_every_rank(control, lambda c: c.all_gather(c.rank, what="agree")) == [[0, 1]] * 2
    assert time.monotonic() - t0 < 5
    assert upload[1].all_gather(1, what="commit") == [0, 1]
    waiting.join(timeout=10)
    assert not waiting.is_alive()


def test_instances_count_per_group():
    a, b = next_instance([0, 1]), next_instance([0, 1])
    c = next_instance([0, 2])
    assert a.split("/")[0] == b.split("/")[0] != c.split("/")[0]
    assert int(b.split("/")[1]) == int(a.split("/")[1]) + 1
