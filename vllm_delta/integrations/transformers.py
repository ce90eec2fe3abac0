"""`DeltaSyncCallback`: publish a `transformers.Trainer`'s weights to a store after optimizer steps.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[DeltaSyncCallback("s3://bucket/run1", anchor_every=20)])

Version numbers are the trainer's `global_step` (the initial weights are version 0, published when
training begins), so a version names the optimizer step that produced it. Servers that follow the
store (`"delta_follow": true`) pick each version up on their own; with `servers=[URL, ...]` the
callback also pushes it to them (`POST /v1/delta/update_weights`) once it is visible in the store.
Any `Trainer` subclass works (TRL's trainers included): the callback only reads the model it is
handed. In a `torch.distributed` job every rank runs the callback; the Publisher then publishes
each rank's shard when it supports sharded publishing, else rank 0 publishes alone.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from transformers import TrainerCallback

from ..trainer.publisher import Publisher, PublishInfo

log = logging.getLogger(__name__)


class DeltaSyncCallback(TrainerCallback):
    def __init__(
        self,
        uri: str,
        *,
        anchor_every: int = 20,
        every_n_steps: int = 1,
        servers: list[str] | None = None,
        api_key: str | None = None,
        mode: str = "keep",
        push_timeout_s: float = 300.0,
        **publisher_kwargs: Any,
    ):
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be >= 1")
        self.uri = uri
        self.anchor_every = anchor_every
        self.every_n_steps = every_n_steps
        self.servers = [s.rstrip("/") for s in servers or ()]
        self.api_key = api_key
        self.mode = mode
        self.push_timeout_s = push_timeout_s
        self.publisher_kwargs = publisher_kwargs
        self.publisher: Publisher | None = None
        self.published: list[PublishInfo] = []
        self.push_errors: list[str] = []  # server pushes that failed (training goes on)
        self._active = True

    # -- transformers callback events -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001 - transformers' API
        self._active = self._publishing_rank()
        if not self._active:
            return
        kwargs_ = dict(self.publisher_kwargs)
        group = self._group()
        if group is not None:
            kwargs_["group"] = group
        self.publisher = Publisher(self.uri, anchor_every=self.anchor_every, **kwargs_)
        latest = self.publisher.store.latest()
        if latest is None or latest < state.global_step:
            self._publish(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        if self._active and self.publisher is not None and state.global_step % self.every_n_steps == 0:
            self._publish(model, state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        if self.publisher is not None:
            if self.published and self.published[-1].version != state.global_step:
                self._publish(model, state.global_step)  # the final weights, whatever every_n_steps says
            self.publisher.close()  # waits for the uploads; raises the first upload error
            self.publisher = None

    # -- internals --------------------------------------------------------------------------------------
    def _publish(self, model: torch.nn.Module | None, step: int) -> None:
        if model is None:
            raise ValueError("DeltaSyncCallback needs the model (the Trainer passes it to callbacks)")
        assert self.publisher is not None
        info = self.publisher.publish(model, version=step)
        self.published.append(info)
        if self.servers:
            info.uploaded.result()  # visible in the store before any server is asked for it
            self._push(info.version)

    def _push(self, version: int) -> None:
        import requests

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for url in self.servers:
            try:
                r = requests.post(
                    f"{url}/v1/delta/update_weights",
                    json={"version": version, "mode": self.mode},
                    headers=headers,
                    timeout=self.push_timeout_s,
                )
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            except Exception as exc:  # noqa: BLE001 - a server that can't update must not stop training
                msg = f"{url}: version {version}: {exc}"
                self.push_errors.append(msg)
                log.warning("vllm-delta: push failed: %s", msg)

    def _group(self) -> Any:
        """The process group for a sharded Publisher, when there is one and the Publisher takes it."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return None
        if torch.distributed.get_world_size() == 1:
            return None
        if "group" in inspect.signature(Publisher.__init__).parameters:
            return torch.distributed.group.WORLD
        return None

    def _publishing_rank(self) -> bool:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return True
        if self._group_supported():
            return True  # every rank publishes its own shard
        return torch.distributed.get_rank() == 0

    @staticmethod
    def _group_supported() -> bool:
        return "group" in inspect.signature(Publisher.__init__).parameters
