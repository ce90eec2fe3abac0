"""Fail closed on expert-parallel load balancing (EPLB): one check, asked on every path that writes weights.

With `--enable-eplb` (`parallel_config.enable_eplb`) vLLM rebalances experts at run time: it moves
expert weights between physical slots (and adds redundant copies) in place. The plugin probes where each
checkpoint element lives once (worker/probe.py) and scatters into those addresses on every update, so
an update after a rebalance would write experts into the wrong slots, silently (vLLM's own
`sharded_rdt` backend refuses EPLB for the same reason; no other backend does). Until an EPLB-aware
apply exists, a server with EPLB takes no store version at all:

    start-up        --load-format delta refuses to load (worker/loader.py)
    push, follow    the API process refuses before staging (api_server/operations.py; the follower
                    at its start, api_server/service.py), 409
    every write     every engine core refuses PATCH_ALL, in a pause or in flight (engine_core/calls.py)
    native backend  the weight-transfer backend "delta" refuses init_transfer_engine and update_weights
                    (worker/backend.py)
"""

from __future__ import annotations

from typing import Any

from ...errors import EplbRefusedError
from ...server_api import Operation

OPTION = "--enable-eplb (parallel_config.enable_eplb)"


def eplb_enabled(vllm_config: Any) -> bool:
    """Whether the server balances experts at run time (False for a config without the option)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return bool(getattr(parallel, "enable_eplb", False))


def refusal(what: str) -> EplbRefusedError:
    """The error every path raises: names the option, says why and what to do."""
    return EplbRefusedError(
        f"vllm-delta refuses {what}: the server runs with expert-parallel load balancing, {OPTION}. EPLB moves "
        "expert weights between physical slots at run time, while vllm-delta maps each checkpoint element to "
        "its slot once, so an update after a rebalance would write experts into the wrong slots. Start the "
        "server without --enable-eplb to take store versions"
    )


def refuse_eplb(vllm_config: Any, what: str) -> None:
    """Raise EplbRefusedError (409) if `vllm_config` enables EPLB; `what`: the refused operation."""
    if eplb_enabled(vllm_config):
        raise refusal(what)


def refuse_operation(vllm_config: Any, operation: Operation) -> None:
    """EplbRefusedError for an update or a stage on a server with EPLB (Operations' refusal hook)."""
    refuse_eplb(vllm_config, "weight updates" if operation == "update" else "staging a version")
