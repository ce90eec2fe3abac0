"""TRL's asynchronous GRPO trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`, TRL 1.16) with
vllm-delta rollout servers: weights through the store, rollouts tagged with the version that made them.

    from vllm_delta.integrations.trl_async import DeltaAsyncGRPOTrainer as AsyncGRPOTrainer
    trainer = AsyncGRPOTrainer(model_path, reward_funcs, args=AsyncGRPOConfig(vllm_server_base_url=URL, ...),
                               train_dataset=ds, delta="s3://bucket/run1")

Two of TRL's extension points, TRL unmodified:

* `weight_transfer=` (TRL's `WeightTransferProtocol`): `DeltaWeightTransfer` publishes each sync
  (every `weight_sync_steps`) to the store instead of streaming it over NCCL. `pause`/`resume` do
  nothing: a server pauses itself, for its apply only, when it takes the version (push or follow).
  TRL hands rank 0 full tensors (it gathers FSDP2 shards itself), so rank 0 publishes alone.
  With `RolloutSyncOptions(mode="follow", wait_live=False)` the trainer does not wait for the
  servers at all; the ledger gate (`max_staleness`, `min_replicas`) can bound their lag.
* The rollout worker's loop class (`AsyncRolloutWorker._loop_cls`): `DeltaRolloutLoop` asks every
  completion for its spans (`"return_weight_versions": true`, vLLM 0.33's flag), reads its
  `weight_versions` and tags each sample with the oldest version that produced any of
  its tokens, in TRL's numbering (`model_version`), instead of the version the worker believed live
  when it sent the request. TRL's staleness filter (`max_staleness`: samples older than that many
  syncs are dropped) then works on what really produced the sample, whether the servers follow the
  store with a lag or update in flight. A completion attributed to a version this trainer has not
  published, or carrying no attribution, fails the worker (the trainer raises; nothing is trained
  on it). A completion request vLLM 0.33 refuses while paused in mode `wait` or `abort` (503
  `engine_paused`) is retried within the request's timeout.

In-flight updates (a server following with `"delta_follow_mode": "inflight"`): a completion may
span two versions. TRL's loss needs, per token, the log-probability of the policy that sampled it
(`old_log_probs`, the behaviour policy of its importance ratio): the server returns exactly that for
every token, computed with the weights of that token's version, so TRL gets what it needs per token;
the sample's version (oldest) only decides staleness. (Tokens after a switch attend to keys and
values earlier weights computed: docs/VLLM.md, "In-flight updates".)

Store versions and TRL's `model_version` are offset by the store's newest version when training
begins (`base`): TRL's sync m publishes store version base + m.

What it relies on in TRL 1.16 (experimental): `AsyncGRPOTrainer(weight_transfer=...)`,
`AsyncRolloutWorker._loop_cls`/`_loop_kwargs`/`_child_ready_timeout`, and the loop's
`_post`/`_retry`/`session`/`vllm_server_url`/`_generate_one`/`_score_group`. Running it needs what
TRL's async trainer needs: a CUDA device (its tree attention is a FlashAttention-3 kernel fetched from
the Hub, and it looks the device's peak FLOPs up through CUDA).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import torch
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, RolloutSample, _AsyncRolloutLoop

from ..attribution import Attribution, attribution_of, request_weight_versions
from ..server_api import is_engine_paused
from .rollout_sync import RolloutSync, RolloutSyncError, RolloutSyncOptions, SyncRecord
from .trl import PAUSED_RETRY_S, AttributionError, warn_if_untested

log = logging.getLogger(__name__)


def rollout_version(attributions: list[Attribution | None], *, base: int, current: int) -> int:
    """TRL's version of a rollout (several turns, one attribution each): the oldest store version
    that produced any of its tokens, minus `base`. `current`: TRL's version now; the one after it
    may be live already (TRL counts a sync once the transfer returned, the servers take it before).
    Raises AttributionError for a turn without attribution, a version that is not a store version,
    or one after `base + current + 1` (not published by this trainer)."""
    versions: list[int] = []
    for a in attributions:
        if a is None:
            raise AttributionError("a completion carries no weight_versions: its server is not a vllm-delta one")
        for v in a.versions:
            if not isinstance(v, int):
                raise AttributionError(f"a completion was produced by weights {v!r}, not by a version of the store")
            if v > base + current + 1 or v < 0:
                raise AttributionError(
                    f"a completion was produced by store version {v}, which this trainer has not published "
                    f"(its newest is {base + current + 1})"
                )
            versions.append(v)
    if not versions:
        raise AttributionError("a rollout without any generated token has no version")
    return min(versions) - base


class DeltaWeightTransfer:
    """TRL's `WeightTransferProtocol`, through the store (module docstring). `servers`: the servers
    to keep live (TRL's `vllm_server_base_url` is added by DeltaAsyncGRPOTrainer)."""

    def __init__(self, options: RolloutSyncOptions, *, servers: list[str] | None = None):
        self.options = options
        self.servers = list(servers or [])
        self.sync: RolloutSync | None = None
        self.base: int | None = None  # the store's newest version when training began
        self.version_fn: Callable[[], int] | None = None  # TRL's number of the next sync
        self.synced: list[SyncRecord] = []

    def init_weight_transfer(self) -> None:
        self.sync = RolloutSync(self.options, servers=self.servers)
        latest = self.sync.store.latest()
        if latest is None:
            raise RolloutSyncError(
                f"the store {self.sync.store.uri} is empty: publish the initial weights (version 0) and start the "
                "servers from it"
            )
        self.base = latest

    def pause(self) -> None:
        """Nothing: a server pauses itself, for its apply only, when it takes a version."""

    def resume(self) -> None:
        """Nothing (see pause)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.sync is None or self.base is None:
            raise RuntimeError("init_weight_transfer was not called")
        tensors = {name: t.detach() for name, t in iterator}
        number = self.version_fn() if self.version_fn is not None else len(self.synced) + 1
        self.synced.append(self.sync.sync(tensors, self.base + number))

    def destroy(self) -> None:
        if self.sync is not None:
            self.sync.close()


_ATTRIBUTIONS: contextvars.ContextVar[list[Attribution | None] | None] = contextvars.ContextVar(
    "vllm_delta_rollout_attributions", default=None
)


class DeltaRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the worker's child process), tagging samples with their producing version.

    `version_base`: the store version TRL's version 0 stands for (a loop keyword argument)."""

    def __init__(self, *, version_base: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.version_base = version_base
        self._versions: dict[int, int] = {}  # id(a rollout's training rows) -> its TRL version

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        if not path.endswith("/completions"):
            return await super()._post(path, payload, timeout, max_retries)
        payload = request_weight_versions(payload)
        content = await self._retry(
            lambda: self._post_while_paused(path, payload, timeout), label=f"POST {path}", max_attempts=max_retries
        )
        found = _ATTRIBUTIONS.get()
        if found is not None:
            found.extend(attribution_of(choice) for choice in content.get("choices", ()))
        return content

    async def _post_while_paused(self, path: str, payload: dict, timeout: float) -> dict:
        """TRL's POST, retrying vLLM's 503 `engine_paused` until `timeout` has passed (TRL's own `_retry`
        around it retries transport errors)."""
        give_up = time.monotonic() + timeout
        session = self.session
        assert session is not None, "TRL opens the loop's session before it posts"
        while True:
            async with session.post(
                f"{self.vllm_server_url}{path}", json=payload, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                if response.status == 503 and time.monotonic() < give_up:
                    try:
                        body = await response.json(content_type=None)
                    except ValueError:
                        body = None
                    if is_engine_paused(503, body):
                        await asyncio.sleep(PAUSED_RETRY_S)
                        continue
                response.raise_for_status()
                content = await response.json()
                return content if content else {}

    async def _generate_one(self, prompt: Any, tool_dict: Any, tools: Any, group_id: int = 0) -> Any:
        found: list[Attribution | None] = []
        _ATTRIBUTIONS.set(found)  # this rollout's task: its requests add their attributions here
        result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        version = rollout_version(found, base=self.version_base, current=self.model_version)
        self._versions[id(result[2])] = version
        self._push_metrics(
            {
                "delta/attributed_rollouts_total": 1.0,
                "delta/mixed_version_rollouts_total": float(any(a is not None and a.mixed for a in found)),
                "delta/rollout_version_min": float(version),
                "delta/rollout_version_max": float(version),
            }
        )
        return result

    async def _score_group(self, group: Any) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        # TRL builds one sample per training row, conversation by conversation, rows in order.
        tags = [self._versions.pop(id(rows)) for rows in group.completions_sequences for _ in rows]
        if len(tags) != len(samples):
            raise AttributionError(f"{len(samples)} samples for {len(tags)} attributed training rows")
        for sample, version in zip(samples, tags):
            sample.model_version = version
        return samples


class DeltaAsyncRolloutWorker(AsyncRolloutWorker):
    """TRL's rollout worker running DeltaRolloutLoop; it learns the version base from the transfer."""

    _loop_cls = DeltaRolloutLoop

    def __init__(self, *, transfer: DeltaWeightTransfer, **kwargs: Any):
        super().__init__(**kwargs)
        self.transfer = transfer

    def start(self) -> None:
        # Called by TRL after the cold sync, so the transfer knows its base by now.
        if self.transfer.base is None:
            raise RuntimeError("the weight transfer was not initialized before the rollout worker started")
        self._loop_kwargs["version_base"] = self.transfer.base
        super().start()


class DeltaAsyncGRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` with weights through a vllm-delta store and version-tagged rollouts.

    Takes AsyncGRPOTrainer's arguments plus `delta`: the store URI (the servers follow it; each sync
    waits until they serve the version) or `RolloutSyncOptions`.
    `trainer.weight_transfer.synced` lists every sync (rank 0)."""

    def __init__(self, *args: Any, delta: str | RolloutSyncOptions, **kwargs: Any):
        warn_if_untested()
        options = delta if isinstance(delta, RolloutSyncOptions) else RolloutSyncOptions(store=delta, mode="follow")
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if config is None:
            raise ValueError("DeltaAsyncGRPOTrainer needs args=AsyncGRPOConfig(vllm_server_base_url=...)")
        transfer = kwargs.get("weight_transfer") or DeltaWeightTransfer(options, servers=[config.vllm_server_base_url])
        if not isinstance(transfer, DeltaWeightTransfer):
            raise ValueError("DeltaAsyncGRPOTrainer syncs through its own DeltaWeightTransfer: pass no weight_transfer")
        kwargs["weight_transfer"] = transfer
        super().__init__(*args, **kwargs)
        from ..trainer.names import conversions

        if conversions(self.accelerator.unwrap_model(self.model)):
            raise NotImplementedError(
                "this model's tensors are converted on load (fused MoE experts): TRL's async trainer sends them under "
                "their in-memory names, which the servers do not load; not supported yet"
            )
        transfer.version_fn = lambda: self.model_version + 1  # TRL bumps model_version after each send
        worker = self.rollout_worker
        # exactly TRL's worker: a user's own subclass is left alone
        if (
            self.accelerator.is_main_process
            and isinstance(worker, AsyncRolloutWorker)
            and type(worker) is AsyncRolloutWorker
        ):
            loop_kwargs = dict(worker._loop_kwargs)
            queue_maxsize = loop_kwargs.pop("queue_maxsize")
            self.rollout_worker = DeltaAsyncRolloutWorker(
                transfer=transfer,
                queue_maxsize=queue_maxsize,
                child_ready_timeout=worker._child_ready_timeout,
                **loop_kwargs,
            )
            self.rollout_queue = self.rollout_worker.rollout_buffer
        elif self.accelerator.is_main_process and not isinstance(worker, DeltaAsyncRolloutWorker):
            log.warning("vllm-delta: a custom rollout worker tags its own samples; their versions are not checked")


__all__ = [
    "DeltaAsyncGRPOTrainer",
    "DeltaAsyncRolloutWorker",
    "DeltaRolloutLoop",
    "DeltaWeightTransfer",
    "rollout_version",
]
