"""A sharded publisher never hangs (issue 25 item 1): real process groups, one process per rank.

Creating a Publisher in a group waits for nobody; every wait between ranks has a deadline
(`ShardingOptions.timeout_s`) and ends in a clear error on every rank, naming the ranks that did not
arrive. gloo on CPU here; the same tests on NCCL (2 GPUs) are marked `gpu`.
"""

from __future__ import annotations

import pytest
import torch
from no_hang_workers import (
    dies_before_publishing,
    different_stores,
    late_beyond_the_deadline,
    publishers_in_sequence,
)

from vllm_delta.store import DeltaStore
from vllm_delta.testing.sharded import run_ranks

pytestmark = pytest.mark.slow


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


BACKENDS = [
    pytest.param("gloo", "cpu", id="gloo"),
    pytest.param(
        "nccl",
        "cuda",
        id="nccl",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs (the lent device)")],
    ),
]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("late_rank", [0, 1])
def test_publishers_in_sequence_with_a_late_rank(tmp_path, backend, device, late_rank):
    """The hang of issue 25: a second Publisher built 3 s later on one rank than on the other."""
    world = 2
    results = run_ranks(
        publishers_in_sequence, world, (str(tmp_path), late_rank, 3.0, device), backend=backend, timeout=120
    )
    for res in results:
        assert res["construct_b_s"] < 1.0 and res["construct_a_s"] < 1.0, res  # constructing waits for nobody
        # a new Publisher has no image to compare with: it starts with an anchor
        assert res["kinds_b"] == res["kinds_a"] == ["anchor", "delta"], res
    on_time = 1 - late_rank
    assert results[on_time]["first_publish_b_s"] >= 2.5  # the first publish is where ranks meet
    assert results[0]["checksums_b"] == results[1]["checksums_b"]
    assert results[0]["checksums_a"] == results[1]["checksums_a"]
    assert DeltaStore(str(tmp_path / "a")).versions() == [0, 1, 2, 3]
    assert DeltaStore(str(tmp_path / "b")).versions() == [0, 1]


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_a_rank_late_beyond_the_deadline_is_named_on_every_rank(tmp_path, backend, device):
    timeout_s, late_s = 2.0, 5.0
    results = run_ranks(
        late_beyond_the_deadline, 2, (str(tmp_path), late_s, timeout_s, device), backend=backend, timeout=120
    )
    (cls0, msg0, t0), (cls1, msg1, t1) = results[0]["first"], results[1]["first"]
    assert cls0 == cls1 == "RankTimeoutError"
    assert "ranks [1] did not arrive at agree" in msg0 and timeout_s - 0.2 <= t0 < timeout_s + 3
    assert "ranks [0] did not arrive at agree" in msg1 and timeout_s - 0.2 <= t1 < timeout_s + 3
    assert "ShardingOptions(timeout_s)" in msg0
    for res in results:
        cls, msg, t = res["again"]
        assert cls == "PublishError" and "failed earlier" in msg and t < 1.0, res["again"]
        assert res["kind"] == "anchor" and res["versions"] == [0]


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_a_rank_that_dies_is_named_within_the_deadline(tmp_path, backend, device):
    timeout_s = 3.0
    world = 3 if backend == "gloo" else 2  # NCCL: one GPU per rank, and the lent machine has two
    victim = world - 1  # not rank 0: it holds the job's key-value store (the next test)
    args = (str(tmp_path), victim, timeout_s, device)
    results = run_ranks(dies_before_publishing, world, args, backend=backend, may_die=(victim,), timeout=120)
    assert results[victim] is None
    for res in results[:victim]:
        cls, msg, t = res["raised"]
        assert cls == "RankTimeoutError" and f"ranks [{victim}] did not arrive at agree" in msg, res
        assert t < timeout_s + 3
        assert res["versions"] == [0]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed")
def test_when_the_rank_holding_the_key_value_store_dies_the_others_raise(tmp_path):
    """Rank 0 hosts the job's TCPStore here (init_process_group from env://, as under mp.spawn): its
    death is a store failure on every other rank, raised at once or within the deadline."""
    timeout_s = 5.0
    results = run_ranks(dies_before_publishing, 2, (str(tmp_path), 0, timeout_s, "cpu"), may_die=(0,), timeout=120)
    cls, msg, t = results[1]["raised"]
    assert cls in ("PublishError", "RankTimeoutError") and "publisher group failed" in msg, results[1]
    assert t < timeout_s + 3


def test_ranks_that_publish_to_different_stores_are_refused(tmp_path):
    seen = run_ranks(different_stores, 2, (str(tmp_path),), timeout=120)
    assert seen[0] == seen[1] and seen[0] is not None and "different stores" in seen[0]
    assert DeltaStore(str(tmp_path / "store0")).versions() == []
