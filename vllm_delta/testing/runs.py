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
    codec: str = "compact",
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
