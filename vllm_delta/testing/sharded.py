"""Sharded trainers for tests, benchmarks and the docs: real process groups, one process per rank.

    results = run_ranks(fn, world=2, args=(...,))      # fn(rank, world, *args) in each rank, gloo group
    model = fsdp_model(spec, seed=0)                    # a tiny causal LM under FSDP2 (fully_shard)
    run = publish_sharded_run(root, spec, world=2)      # like runs.publish_run, published by 2 ranks

`run_ranks` starts the ranks with torch.multiprocessing (spawn), initializes a gloo process group in
each, runs `fn` and returns what each rank returned (in rank order). A rank that raises makes
`run_ranks` raise with its traceback; ranks listed in `may_die` may end without a result (killed).
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from .models import TinyModelSpec, save_tiny_model
from .ports import free_port
from .runs import PublishedRun


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple, backend: str, threads: int
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank, before the communicator exists
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120), device_id=None
        )
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - shutting down
                pass


_CTX: Any = None


def _context() -> Any:
    """A forkserver whose server imported torch and transformers once: ranks start in about a
    second instead of re-importing everything (spawn), and never inherit a parent's threads (fork)."""
    global _CTX
    if _CTX is None:
        import torch.multiprocessing as mp

        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            [
                "torch",
                "torch.distributed.fsdp",
                "transformers",
                "transformers.models.qwen3.modeling_qwen3",
                "transformers.models.llama.modeling_llama",
                "vllm_delta.testing.sharded",
                "vllm_delta.trainer.publisher",
            ]
        )
    return _CTX


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    *,
    timeout: float = 300.0,
    may_die: tuple[int, ...] = (),
    backend: str = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` fresh processes joined in one process group
    (`backend` "gloo", or "nccl" with rank r on GPU r; `threads`: torch CPU threads per rank).

    Returns each rank's result (None for a rank of `may_die` that died). Raises RuntimeError with
    the failing rank's traceback if a rank raised, or if a rank not in `may_die` died or hung."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world, port, results, args, backend, threads), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and r not in errors]
                if dead and all(r in may_die for r in dead) and len(out) + len(errors) + len(dead) == world:
                    break
                if any(r not in may_die for r in dead):
                    # a rank that was not allowed to die ended without reporting
                    time.sleep(0.5)
                    if results.empty():
                        codes = [procs[r].exitcode for r in dead]
                        raise RuntimeError(f"ranks {dead} died (exit codes {codes})") from None
                continue
            (out if status == "ok" else errors)[rank] = value
        if errors:
            rank = min(errors)
            raise RuntimeError(f"rank {rank} of {world} failed:\n{errors[rank]}")
        missing = [r for r in range(world) if r not in out and r not in may_die]
        if missing:
            raise RuntimeError(f"ranks {missing} of {world} did not finish within {timeout:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [out.get(r) for r in range(world)]


def fsdp_model(spec: TinyModelSpec | None = None, seed: int = 0):
    """A tiny causal LM with fp32 master weights (the same on every rank), under FSDP2: each decoder
    layer and the root are `fully_shard`ed over the default process group."""
    from torch.distributed.fsdp import fully_shard

    from .training import build_master_model

    model: Any = build_master_model(spec, seed=seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def full_image(model) -> dict[str, Any]:
    """Every rank: the bf16 image of the whole model (a collective over the model's DTensors)."""
    import torch

    from ..trainer.detect import named_tensors

    out = {}
    for name, t in named_tensors(model):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().to(torch.bfloat16)
    return out


def _publish_rank(rank: int, world: int, root: str, spec: TinyModelSpec, lrs: list[float], seed: int, kw: dict):
    import torch.distributed as dist

    from ..checksums import checksum
    from ..trainer import Publisher
    from .training import train_steps

    model = fsdp_model(spec, seed=seed)
    sums, kinds, nnz = {}, {}, {}
    with Publisher(os.path.join(root, "store"), group=dist.group.WORLD, **kw) as pub:
        for step in range(len(lrs) + 1):
            if step:
                for _ in train_steps(model, 1, lr=lrs[step - 1], seed=seed * 1000 + step):
                    pass
            info = pub.publish(model, version=step)
            image = full_image(model)
            sums[step] = checksum(image)
            if info.checksum != sums[step]:
                raise AssertionError(f"rank {rank}: publisher checksum {info.checksum} != {sums[step]}")
            kinds[step], nnz[step] = info.kind, info.nnz
    return {"checksums": sums, "kinds": kinds, "nnz": nnz}


def publish_sharded_run(
    root: str,
    spec: TinyModelSpec | None = None,
    *,
    world: int = 2,
    steps: int = 4,
    lr: float | list[float] = 3e-5,
    seed: int = 0,
    **publisher_kw: Any,
) -> PublishedRun:
    """`runs.publish_run`, published by `world` FSDP2 ranks (gloo, CPU): version 0 is the initial
    model, each later version one AdamW step; every version is a multi-part version."""
    from .training import build_master_model

    spec = spec or TinyModelSpec()
    lrs = list(lr) if isinstance(lr, (list, tuple)) else [lr] * steps
    run = PublishedRun(root, os.path.join(root, "model"), os.path.join(root, "store"), spec)
    save_tiny_model(build_master_model(spec, seed=seed), run.model_dir, weights=False)
    results = run_ranks(_publish_rank, world, (root, spec, lrs, seed, publisher_kw))
    first = results[0]
    for r in results[1:]:
        if r["checksums"] != first["checksums"]:
            raise AssertionError("ranks disagree on the published checksums")
    run.checksums = {int(v): c for v, c in first["checksums"].items()}
    run.kinds = {int(v): k for v, k in first["kinds"].items()}
    run.nnz = {int(v): n for v, n in first["nnz"].items()}
    return run


__all__ = ["fsdp_model", "full_image", "publish_sharded_run", "run_ranks"]
