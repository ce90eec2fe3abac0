"""A published training run: a tiny model trained a few steps, every step published to a store.

    run = publish_run("/tmp/run", TinyModelSpec(num_kv_heads=1), steps=6, anchor_every=4)
    run.model_dir      # config + tokenizer, no weights: a vLLM server takes them from the store
    run.store          # the store's path
    run.checksums[v]   # vllm_delta.checksum of the trainer's bf16 weights at version v

Used by the vLLM tests, the pause-latency benchmark and the demo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .models import TinyModelSpec, save_tiny_model


@dataclass
class PublishedRun:
    root: str
    model_dir: str
    store: str
    spec: TinyModelSpec
    checksums: dict[int, str] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)
    nnz: dict[int, int] = field(default_factory=dict)

    @property
    def versions(self) -> list[int]:
        return sorted(self.checksums)


def publish_run(
    root: str,
    spec: TinyModelSpec | None = None,
    *,
    steps: int = 6,
    anchor_every: int = 4,
    lr: float | list[float] = 3e-5,
    seed: int = 0,
    codec: str = "chunked",
) -> PublishedRun:
    """Version 0 is the initial model; versions 1..steps follow one AdamW step each (lr per step)."""
    from ..checksums import checksum
    from ..trainer import Publisher
    from .training import bf16_image, build_master_model, train_steps

    spec = spec or TinyModelSpec()
    lrs = list(lr) if isinstance(lr, (list, tuple)) else [lr] * steps
    if len(lrs) != steps:
        raise ValueError(f"{steps} steps need {steps} learning rates, got {len(lrs)}")
    model = build_master_model(spec, seed=seed)
    run = PublishedRun(root, os.path.join(root, "model"), os.path.join(root, "store"), spec)
    save_tiny_model(model, run.model_dir, weights=False)
    with Publisher(run.store, anchor_every=anchor_every, codec=codec) as pub:
        infos = [pub.publish(model, version=0)]
        run.checksums[0] = checksum(bf16_image(model))
        for step, step_lr in enumerate(lrs, start=1):
            for _ in train_steps(model, 1, lr=step_lr, seed=seed * 1000 + step):
                pass
            infos.append(pub.publish(model, version=step))
            run.checksums[step] = checksum(bf16_image(model))
    for info in infos:
        if info.checksum != run.checksums[info.version]:
            raise AssertionError(f"publisher checksum {info.checksum} != {run.checksums[info.version]}")
        run.kinds[info.version] = info.kind
        run.nnz[info.version] = info.nnz
    return run


class LiveRun:
    """A trainer that keeps publishing: a tiny model with fp32 master weights and one AdamW optimizer,
    each `step()` one optimizer step on random tokens, published (and flushed) as the next version.

        run = LiveRun(uri, TinyModelSpec(), model_dir=..., storage_options=..., anchor_every=4)
        run.publish()          # version 0, the initial weights
        info = run.step()      # version 1, ...
        run.checksums[1]       # vllm_delta.checksum of the trainer's bf16 weights at version 1

    Used by the fault tests and the soak benchmark (a server follows the run while it is published).
    """

    def __init__(
        self,
        uri: str,
        spec: TinyModelSpec | None = None,
        *,
        model_dir: str | None = None,
        storage_options: dict | None = None,
        anchor_every: int = 4,
        lr: float = 1e-6,
        seed: int = 0,
        codec: str = "chunked",
    ):
        import torch

        from ..trainer import Publisher
        from .training import build_master_model

        self.spec = spec or TinyModelSpec()
        self.seed = seed
        self.lr = lr
        self.model = build_master_model(self.spec, seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.model_dir = model_dir
        if model_dir is not None:
            save_tiny_model(self.model, model_dir, weights=False)
        self.publisher = Publisher(
            uri,
            anchor_every=anchor_every,
            codec=codec,
            storage_options=storage_options,
        )
        self.checksums: dict[int, str] = {}
        self.kinds: dict[int, str] = {}
        self.visible_at: dict[int, float] = {}  # unix time each version became visible (its record written)
        self.version: int | None = None  # the last published version
        self.steps = 0

    def publish(self, version: int | None = None):
        """Publish the current weights (the next version, or `version`) and wait until it is visible."""
        import time

        from ..checksums import checksum
        from .training import bf16_image

        info = self.publisher.publish(self.model, version=version)
        info.uploaded.add_done_callback(lambda _: self.visible_at.__setitem__(info.version, time.time()))
        self.publisher.flush()
        expected = checksum(bf16_image(self.model))
        if info.checksum != expected:
            raise AssertionError(f"publisher checksum {info.checksum} != {expected}")
        self.checksums[info.version] = info.checksum
        self.kinds[info.version] = info.kind
        self.version = info.version
        return info

    def step(self, version: int | None = None, lr: float | None = None):
        """One AdamW step on random tokens, then `publish`."""
        import torch

        self.steps += 1
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps)
        tokens = torch.randint(0, self.spec.vocab_size, (4, 32), generator=gen)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.model.train()
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return self.publish(version)

    def close(self) -> None:
        self.publisher.close()

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
