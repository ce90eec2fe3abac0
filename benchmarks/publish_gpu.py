#!/usr/bin/env python
"""What publishing costs a training step, and how long until the new weights are live (issue 9).

Parameters of the exact Qwen3 shapes (default qwen3-8b: 8.19B fp32 master weights, all 36 layers)
are trained by real `torch.optim.SGD` steps (foreach). To fit one 80 GB card next to the bf16
snapshot and the engine's bf16 targets, every parameter's gradient is a view into one shared random
buffer (the size of the largest parameter): the step reads and writes the master weights as any
optimizer does; the learning rate is calibrated so that the step changes `--density` of the bf16
images (1%: the RL regime). With `--world 2` the parameters are FSDP2-sharded (`fully_shard`, NCCL,
one GPU per rank; gradients are DTensors over the same shared buffer) and every rank publishes its
part of each version.

(a) added step time: the same loop of optimizer steps, without and with `publish` after each step
    (same run, same card); `added = median(step + publish) - median(step)`. Uploads are drained
    between iterations outside the timed region, so the number is what publish holds the training
    thread, not back-pressure of the store.
(b) time to live (rank 0, one engine): end of the optimizer step -> `publish` returns -> the version
    is visible in the local store (`info.uploaded`: zstd packing on the upload thread's pool, file
    write, commit; with 2 ranks, rank 0 commits after both parts are in) -> `store.open` ->
    `ApplyEngine.stage` (vLLM's fused qkv/gate_up layout, bf16 targets on GPU 0) -> `commit`. The
    last line estimates a 10 Gbit/s link to object storage: the version's bytes up and down once.

The engine starts from the trainer's bf16 image (version 0 is published as an anchor, its file is not
re-read); the live checksum of the engine is checked against the publisher's at the end.

    python benchmarks/publish_gpu.py --out DIR                  # one GPU, Qwen3-8B shape, 1%
    python benchmarks/publish_gpu.py --world 2 --out DIR        # FSDP2 on 2 GPUs of one host
    python benchmarks/publish_gpu.py --world 1,2,4 --out DIR    # W=1, then 2, then 4 ranks: one table
    python benchmarks/publish_gpu.py --smoke                    # tiny shapes on CPU (gloo, W=1,2,4)

With several world sizes the last table has one row per (W, codec): what a version of W parts costs
the server (one engine on GPU 0, as for W=1): `open` (the store's open of the W part files), staging
and its phases (read, h2d, inflate: nvCOMP; decode: the fused planes decode), the changed elements
decoded, and step end -> live. Issue 25: W=2 and W=4 no slower than W=1, open under 10 ms at any W.
Prints a short table last; writes DIR/publish_gpu[_w<W>].json and .log.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402
from publish_report import by_world, final_table, report  # noqa: E402
from publish_syncs import Live  # noqa: E402
from torch import nn  # noqa: E402

from vllm_delta import mapped_writes  # noqa: E402
from vllm_delta.apply.engine import ApplyEngine  # noqa: E402
from vllm_delta.checksums import combine, to_hex  # noqa: E402
from vllm_delta.codec import chunked  # noqa: E402
from vllm_delta.codec.chunked import gpu  # noqa: E402
from vllm_delta.codec.chunked.blocks import RANK_BLOCKS  # noqa: E402
from vllm_delta.store import DeltaStore  # noqa: E402
from vllm_delta.testing.apply_fixtures import QWEN3, QWEN3_MOE, model_layout  # noqa: E402
from vllm_delta.trainer import DetectOptions, Publisher, PublisherOptions, ShardingOptions, UploadOptions  # noqa: E402
from vllm_delta.trainer.detect import STREAM_PASS_ELEMS  # noqa: E402

# -- the model: parameters of the HF shapes in nested modules (one per decoder layer) -------------------


def build_module(shapes: dict[str, tuple[int, ...]], device: torch.device | str) -> nn.Module:
    """A module tree whose named_parameters() are exactly `shapes` (fp32, uninitialized)."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device)))
    return root


def layer_modules(root: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(root, "model", None), "layers", None)
    return list(layers.children()) if layers is not None else []


def init_(params: list[torch.Tensor], seed: int) -> None:
    """N(0, 0.02), fp32: the master weights sit anywhere inside their bf16 rounding interval."""
    gen = None
    for i, p in enumerate(params):
        local = p.to_local() if hasattr(p, "to_local") else p
        gen = torch.Generator(device=local.device).manual_seed(seed * 100_003 + i)
        with torch.no_grad():
            local.normal_(0.0, 0.02, generator=gen)


def attach_grads(params: list[nn.Parameter], pool: torch.Tensor) -> None:
    """Each gradient is a view of the shared random buffer (a DTensor over it for FSDP2 params)."""
    for p in params:
        if hasattr(p, "to_local"):
            from torch.distributed.tensor import DTensor

            local = p.to_local()
            g = pool[: local.numel()].view(local.shape)
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = pool[: p.numel()].view(p.shape)


def measure_density(params: list[torch.Tensor], lr: float, sample: int = 1 << 22) -> float:
    """Share of bf16 images one SGD step at `lr` would change (on a sample, nothing is modified)."""
    changed = total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if local.numel() == 0:
            continue
        x, d = local.reshape(-1)[:sample], g.reshape(-1)[:sample]
        new = x - lr * d
        changed += int((new.to(torch.bfloat16).view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)).sum())
        total += x.numel()
        if total >= 4 * sample:
            break
    return changed / max(1, total)


def calibrate(params: list[torch.Tensor], density: float) -> float:
    lr = 1e-4
    for _ in range(6):
        got = measure_density(params, lr)
        if got <= 0:
            lr *= 10
            continue
        lr *= density / got
    return lr


# -- one rank ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    model: str
    layers: int | None
    codecs: list[str]  # "codec[:cpu|gpu]": the codec, and for chunked the path (nvCOMP or zstandard)
    density: float
    steps: int
    warmup: int
    world: int
    store: str
    threads: int
    chunk_elems: int
    backend: str | None
    smoke: bool
    engine_gpu: int | None = None  # the engine's card (default: rank 0's)
    keep_stores: bool = False  # --store given: the stores stay (benchmarks/open_parts.py reads them)
    header_format: int = 5  # chunked deltas' header: 5 (arrays), 4 (columns) or 3 (an object per tensor), for A/B
    stream_pass_elems: int = STREAM_PASS_ELEMS  # detection's pass when the codec encodes pass by pass
    mem_syncs: int = 2  # syncs after the timed ones with the device's free memory sampled (DeviceMemory)
    # UploadOptions(gpu_encode_frames) values whose device memory the mem syncs measure too (beside the default)
    encode_frames: tuple[int, ...] = ()
    rank_blocks: int = 0  # UploadOptions(rank_blocks): 0 (its default) one stream, RANK_BLOCKS the TP layout


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def fill_targets(layout, targets: list[torch.Tensor], name: str, full: torch.Tensor) -> None:
    """Write an HF tensor (bf16) into the engine's targets through the layout's segments."""
    from vllm_delta.apply.layout import hf_2d

    rows, cols = hf_2d(layout.hf_shapes[name])
    src = full.reshape(rows, cols)
    for seg in layout.segments[name]:
        t = targets[seg.target].reshape(-1)
        box = t.as_strided((seg.rows, seg.cols), (seg.dst_row_stride, seg.dst_col_stride), seg.dst_offset)
        box.copy_(src[seg.row0 : seg.row0 + seg.rows, seg.col0 : seg.col0 + seg.cols])


@dataclasses.dataclass
class Rank:
    """One rank's training state and, on rank 0, the engine the versions go live in."""

    rank: int
    world: int
    dev: torch.device
    module: nn.Module
    opt: torch.optim.Optimizer
    lr: float
    n_params: int
    layout: Any
    targets: list[torch.Tensor]
    engine: ApplyEngine | None
    group: Any

    def step(self) -> None:
        self.opt.step()


def build_rank(rank: int, world: int, cfg: Config) -> Rank:
    """The model's parameters (FSDP2-sharded over W ranks), gradients over one shared random buffer, SGD
    at the learning rate that changes `cfg.density` of the bf16 images, and rank 0's engine."""
    import torch.distributed as dist

    dev = torch.device("cuda", rank) if torch.cuda.is_available() and not cfg.smoke else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    spec = {**QWEN3, **QWEN3_MOE}[cfg.model]
    if cfg.layers is not None:
        spec = dataclasses.replace(spec, layers=cfg.layers)
    target_shapes, layout = model_layout(spec)
    shapes = dict(layout.hf_shapes)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            module = build_module(shapes, "meta")
        for layer in layer_modules(module):
            fully_shard(layer)
        fully_shard(module)
        module.to_empty(device=dev)
    else:
        module = build_module(shapes, dev)
    params = list(module.parameters())
    init_(params, seed=1)
    largest = max((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
    gen = torch.Generator(device=dev).manual_seed(7 + rank)
    pool = torch.randn(largest, generator=gen, device=dev)
    attach_grads(params, pool)
    lr = calibrate(params, cfg.density)
    opt = torch.optim.SGD(params, lr=lr, foreach=True)
    n_params = sum(int(torch.tensor(s).prod()) if s else 1 for s in shapes.values())
    group = dist.group.WORLD if world > 1 else None
    targets: list[torch.Tensor] = []
    # The engine (rank 0's process) on its own card where one is free (--engine-gpu): a whole 30B-A3B's
    # fp32 master shards, snapshot and the engine's bf16 targets do not fit one card together.
    eng_dev = dev if cfg.engine_gpu is None or dev.type != "cuda" else torch.device("cuda", cfg.engine_gpu)
    if rank == 0:
        targets = [torch.zeros(s, dtype=torch.bfloat16, device=eng_dev) for s in target_shapes.values()]
    engine = ApplyEngine(dict(zip(target_shapes, targets)), layout, eng_dev) if rank == 0 else None
    return Rank(rank, world, dev, module, opt, lr, n_params, layout, targets, engine, group)


def run_rank(rank: int, world: int, cfg: Config) -> dict:
    r = build_rank(rank, world, cfg)
    tempfile.tempdir = os.path.dirname(cfg.store)  # the publisher's temp files: renamed into the store
    # (a) without publish
    plain = []
    for i in range(cfg.warmup + cfg.steps):
        _barrier(world)
        _sync(r.dev)
        t = time.perf_counter()
        r.step()
        _sync(r.dev)
        if i >= cfg.warmup:
            plain.append((time.perf_counter() - t) * 1e3)
    out: dict = {"rank": rank, "plain_step_ms": plain, "lr": r.lr, "params": r.n_params, "runs": {}}
    for codec_cfg in cfg.codecs:
        codec_name, _, path = codec_cfg.partition(":")
        path, _, planes = path.partition("/")  # "chunked:gpu/torch": the torch planes (before the Triton kernels)
        if path == "gpu" and r.dev.type == "cuda" and gpu.backend(r.dev)[0] is None:
            out["runs"][codec_cfg] = {"skipped": gpu.backend(r.dev)[1]}
            continue
        os.environ[gpu.PATH_ENV] = "cpu" if path == "cpu" else "auto"
        if planes:
            os.environ[chunked.PLANES_ENV] = planes
        store_dir = f"{cfg.store}-{codec_name}-{path or 'auto'}-{planes or 'default'}"
        if rank == 0:
            shutil.rmtree(store_dir, ignore_errors=True)  # a kept store of an earlier run (--store)
        _barrier(world)
        try:
            out["runs"][codec_cfg] = _publish_run(cfg, codec_name, store_dir, r)
        finally:
            os.environ.pop(gpu.PATH_ENV, None)
            os.environ.pop(chunked.PLANES_ENV, None)
            if not cfg.keep_stores:
                shutil.rmtree(store_dir, ignore_errors=True)
    if r.engine is not None:
        r.engine.close()
    # how fast this rank's files were written each way (mapped_writes: the way of each next file)
    out["write_gbps"] = {
        ("mapped" if k else "pwrite"): [x / 1e9 for x in v] for k, v in mapped_writes.CHOOSER.rates().items()
    }
    return out


def _publish_run(cfg: Config, codec_name: str, store_dir: str, r: Rank) -> dict:
    """One codec configuration: a fresh store, an anchor of the current weights (the engine starts
    from them), a first delta (untimed: kernels, pinned buffers, nvCOMP), then the steady syncs (each
    one's live checksum checked), then `cfg.mem_syncs` more with the device's memory sampled, at the
    default and at each of `cfg.encode_frames` (UploadOptions(gpu_encode_frames))."""
    pub = Publisher(
        store_dir,
        anchor_every=10**9,
        codec=codec_name,
        group=r.group,
        options=PublisherOptions(
            detect=DetectOptions(
                backend=cfg.backend, chunk_elems=cfg.chunk_elems, stream_pass_elems=cfg.stream_pass_elems
            ),
            upload=UploadOptions(
                queue_size=2,
                pack_threads=cfg.threads,
                header_format=cfg.header_format,
                rank_blocks=cfg.rank_blocks,
            ),
            sharding=ShardingOptions(timeout_s=600),
        ),
    )
    store = DeltaStore(store_dir)
    t0 = time.perf_counter()
    info0 = pub.publish(r.module, version=0)
    pub.flush()
    anchor_s = time.perf_counter() - t0
    for name, p in r.module.named_parameters():  # a collective per tensor with FSDP2: every rank
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if r.rank == 0:
            fill_targets(r.layout, r.targets, name, full.to(torch.bfloat16))
        del full
    _sync(r.dev)
    _barrier(r.world)
    live = Live(r.engine)
    r.step()
    live.sync(pub, store, r.module, 1)  # the first delta, untimed
    v = 2 + cfg.warmup + cfg.steps
    rows = _syncs(r, live, pub, store, range(2, v))[cfg.warmup :]
    mem = []
    for frames in (None, *cfg.encode_frames):  # the publish's device memory, at each bound asked for
        if hasattr(pub.codec, "encode_frames"):  # the chunked codec: this Publisher's own copy (_own_codec)
            pub.codec.encode_frames = frames
        mem += [
            {**row, "encode_frames": frames or 0}
            for row in _syncs(r, live, pub, store, range(v, v + cfg.mem_syncs), True)
        ]
        v += cfg.mem_syncs
    pub.close()
    out: dict = {"rows": rows, "mem_rows": mem, "anchor_s": anchor_s, "anchor_checksum": info0.checksum}
    if r.engine is not None:
        whole = to_hex(combine(r.engine.live_sums().items()))  # once, over every weight: what the engine holds
        out["checksum_ok"] = whole == live.checksum and all(row["checksum_ok"] for row in rows + mem)
        out["live_checksum"], out["publisher_checksum"] = whole, live.checksum
    return out


def _syncs(r: Rank, live: Live, pub: Publisher, store: DeltaStore, versions: range, memory: bool = False) -> list[dict]:
    """One sync per version (every rank: a step, then its publish; rank 0 also stages and writes it)."""
    rows = []
    for v in versions:
        _barrier(r.world)
        _sync(r.dev)
        t0 = time.perf_counter()
        r.step()
        _sync(r.dev)
        rows.append(live.sync(pub, store, r.module, v, t_step0=t0, memory=memory))
        _barrier(r.world)
    return rows


def _rank_entry(rank: int, world: int, cfg: Config) -> dict:
    return run_rank(rank, world, cfg)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted({**QWEN3, **QWEN3_MOE}))
    ap.add_argument(
        "--codecs",
        default="compact,chunked:cpu,chunked:gpu",
        help="codec configurations, one after the other in this process (codec[:cpu|gpu[/torch]]; /torch: the "
        "chunked codec's torch planes instead of its Triton kernels)",
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=20, help="timed steady syncs per codec (p50 and p95 over them)")
    ap.add_argument("--warmup", type=int, default=1, help="syncs before the timed ones (excluded)")
    ap.add_argument("--mem-syncs", type=int, default=2, help="syncs after them, the device's memory sampled")
    ap.add_argument(
        "--world", default="1", help="ranks (FSDP2 over NCCL, one GPU each); several (1,2,4): one after the other"
    )
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1), help="zstd packing threads")
    ap.add_argument("--chunk-elems", type=int, default=1 << 28)
    ap.add_argument("--backend", choices=["triton", "triton-chunked", "torch"], default=None, help="detection backend")
    ap.add_argument(
        "--stream-pass-elems",
        type=int,
        default=STREAM_PASS_ELEMS,
        help="detection's pass when the codec encodes pass by pass (DetectOptions.stream_pass_elems)",
    )
    ap.add_argument(
        "--store",
        default=None,
        help="a folder for the stores, kept afterwards (store-w<W>-<codec>-...; default: a fresh one in /dev/shm "
        "or /tmp, removed)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--name", default="", help="the output files' name (default: publish_gpu[_w<W>])")
    ap.add_argument(
        "--engine-gpu",
        type=int,
        default=None,
        help="the engine's card (default: rank 0's; a free card for models "
        "whose training state and engine do not fit one card together)",
    )
    ap.add_argument(
        "--header-format", type=int, choices=(3, 4, 5), default=5, help="chunked deltas' header format (A/B)"
    )
    ap.add_argument(
        "--encode-frames",
        default="",
        help="UploadOptions(gpu_encode_frames) values (comma-separated): the mem syncs run at each too, their "
        "device-wide peak and time beside the default's",
    )
    ap.add_argument(
        "--rank-blocks",
        type=int,
        choices=(0, RANK_BLOCKS),
        default=0,
        help="UploadOptions(rank_blocks): 0 (the default) every tensor whole in one stream, 8 rank blocks (A/B)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, W=1 then W=2 (gloo); checks only")
    return ap.parse_args()


def config_for(args: argparse.Namespace, world: int, root: str) -> Config:
    return Config(
        model=args.model,
        layers=args.layers,
        codecs=args.codecs.split(","),
        density=args.density if not args.smoke else 0.05,
        steps=args.steps,
        warmup=args.warmup,
        world=world,
        store=os.path.join(root, f"store-w{world}"),
        threads=args.threads,
        chunk_elems=args.chunk_elems if not args.smoke else 5000,
        backend=args.backend,
        smoke=args.smoke,
        engine_gpu=args.engine_gpu,
        keep_stores=args.store is not None,
        header_format=args.header_format,
        stream_pass_elems=args.stream_pass_elems,
        mem_syncs=args.mem_syncs if not args.smoke else 0,
        encode_frames=tuple(int(x) for x in args.encode_frames.split(",") if x),
        rank_blocks=args.rank_blocks,
    )


def run_world(args: argparse.Namespace, world: int, base: str) -> tuple[Config, list[dict]]:
    """Every rank of one world size (W=1 in this process, else one process per rank): their results."""
    root = args.store or tempfile.mkdtemp(prefix="publish-gpu-", dir=base)
    os.makedirs(root, exist_ok=True)
    cfg = config_for(args, world, root)
    try:
        if world == 1:
            saved = tempfile.tempdir
            try:
                return cfg, [run_rank(0, 1, cfg)]
            finally:
                tempfile.tempdir = saved
        from vllm_delta.testing.sharded import run_ranks

        backend = "gloo" if args.smoke else "nccl"
        threads = 1 if args.smoke else max(1, (os.cpu_count() or 2) // world)
        return cfg, run_ranks(_rank_entry, world, (cfg,), backend=backend, threads=threads, timeout=3600)
    finally:
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if args.smoke:
        args.model, args.steps, args.warmup, args.threads = "qwen3-tiny", 2, 1, 2
        args.codecs = "compact,chunked"
        torch.set_num_threads(1)  # tiny tensors: OpenMP threads only contend on a shared CPU
    elif not torch.cuda.is_available():
        print("needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    card = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    log = [
        f"# publish_gpu {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} card={card} "
        f"torch={torch.__version__} cpus={os.cpu_count()}",
        f"# command: python {' '.join(sys.argv)}",
    ]
    print("\n".join(log), flush=True)
    worlds = [1, 2, 4] if args.smoke else [int(w) for w in args.world.split(",")]
    summaries, status = [], 0
    base = "/dev/shm" if os.path.isdir("/dev/shm") and not args.smoke else tempfile.gettempdir()
    for world in worlds:
        gpus = torch.cuda.device_count() if not args.smoke else world
        if world > gpus:
            log.append(f"# W={world}: skipped: needs {world} GPUs, this host has {gpus}")
            print(log[-1], flush=True)
            continue
        cfg, results = run_world(args, world, base)
        n0 = len(log)
        summary = report(results, cfg, card, log)
        summaries.append({"summary": summary, "ranks": results})
        print("\n".join(log[n0:]), flush=True)
        if any(x.get("checksum_ok") is False for x in summary):
            print("MISMATCH: the engine's live checksum differs from the publisher's", file=sys.stderr)
            status = 1
    if len(summaries) > 1:
        n0 = len(log)
        by_world(summaries, card, log)
        print("\n".join(log[n0:]), flush=True)
    log.extend(final_table(summaries, card))
    print("\n".join(log[-len(final_table(summaries, card)) :]), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = args.name or "publish_gpu" + (
            "_smoke" if args.smoke else "" if worlds == [1] else f"_w{'-'.join(map(str, worlds))}"
        )
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump({"command": " ".join(sys.argv), "log": log, "runs": summaries}, f, indent=1, default=str)
        with open(os.path.join(args.out, name + ".log"), "w") as f:
            f.write("\n".join(log) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
