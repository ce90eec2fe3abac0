#!/usr/bin/env python
"""How the chunked codec's GPU steps scale with the size of a call (issue 17: choosing batch sizes).

On one synthetic version shaped like Qwen3-8B at 1% (`--changes`, default 81.9M changed elements of
bf16 tensors, gaps with the density's mean, AdamW-like differences), on one GPU:

* encode: the planes by the Triton kernel and by the torch reference, the whole batch at once and as
  the trainer's detection hands them over (passes of `--pass-changes`, `StreamEncoder`);
* compress: every frame with nvCOMP, at several frames per call (`gpu.FRAMES_PER_CALL`);
* write: `ChunkedBatch.write_to` into memory (compress + compact + hash + device-to-host copy), at
  several sizes of the copies (`chunked.write.COPY_PIECE_BYTES`), from one part and from the trainer's
  passes (merged), and into a file on /dev/shm (format.PayloadWriter, 16 writer threads);
* inflate: nvCOMP decompression of the file's frames, at several chunks per call;
* decode: the planes back to gaps and differences, Triton kernel against torch, 128 chunks a run.

Prints a table last (ms, median of `--reps`); writes DIR/codec_calls.{log,json}.

    python benchmarks/codec_calls.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_delta.codec import chunked  # noqa: E402
from vllm_delta.codec.base import Batch, MemorySink, segment_ids  # noqa: E402
from vllm_delta.codec.chunked import gpu, write  # noqa: E402
from vllm_delta.format import PayloadWriter, VersionHeader  # noqa: E402
from vllm_delta.testing.apply_fixtures import apply_diffs, realistic_diffs  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def make_batch(n: int, density: float, tensors: int, dev: torch.device) -> Batch:
    gen = torch.Generator(device=dev).manual_seed(0)
    gaps = torch.empty(n, device=dev).exponential_(density, generator=gen).floor_().to(torch.int64)
    counts = torch.full((tensors,), n // tensors, dtype=torch.int64)
    counts[-1] += n - int(counts.sum())
    seg = segment_ids(counts.to(dev), n)
    pos = torch.cumsum(gaps + 1, 0) - 1
    first = torch.cumsum(counts, 0) - counts
    pos -= pos[first.to(dev)][seg]  # each tensor's positions from 0
    old = torch.randint(-16000, 16000, (n,), generator=gen, device=dev).to(torch.int16)
    new = apply_diffs(old, realistic_diffs(n, gen, dev, 2))
    return Batch(positions=pos, new=new, old=old, seg=seg, counts=counts.tolist(), starts=[0] * tensors, numels=[])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=81_920_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--pass-changes", type=int, default=10_240_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument(
        "--smoke", action="store_true", help="a small version on the CPU (TRITON_INTERPRET=1): the steps run"
    )
    args = ap.parse_args()
    if args.smoke:
        args.changes, args.pass_changes, args.reps = 300_000, 100_000, 1
    elif not torch.cuda.is_available():
        print("needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0) if not args.smoke else torch.device("cpu")
    be, why = gpu.backend(dev)
    card = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    log = [f"# codec_calls {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} card={card}"]
    log.append(f"# command: python {' '.join(sys.argv)}")
    rows: list[tuple[str, str, float]] = []

    def note(step: str, config: str, ms: float) -> None:
        rows.append((step, config, ms))
        print(f"{step:>8} {config:>28} {ms:9.2f}", flush=True)

    batch = make_batch(args.changes, args.density, 400, dev)
    c = chunked.ChunkedCodec()
    backends = ("triton", "torch") if dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else ("torch",)
    encode_steps(args, batch, c, backends, note)
    planes = chunked.encode_planes(batch)
    if be is None:
        log.append(f"nvCOMP not available: {why}")
    else:
        nvcomp_steps(args, batch, c, planes, be, dev, note)
    decode_steps(args, batch, planes, backends, note)
    log.append(f"# {card}: {args.changes / 1e6:.1f}M changes, density {args.density}; ms, median of {args.reps}")
    log.append(f"{'step':>8} {'configuration':>28} {'ms':>9}")
    log += [f"{s:>8} {cfg:>28} {ms:9.2f}" for s, cfg, ms in rows]
    print("\n".join(log), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "codec_calls.log"), "w") as f:
            f.write("\n".join(log) + "\n")
        with open(os.path.join(args.out, "codec_calls.json"), "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


def streamed(args, batch: Batch, c: chunked.ChunkedCodec) -> chunked.ChunkedBatch:
    """The batch as the trainer's detection hands it over: passes of `--pass-changes`."""
    s = c.stream([0] * 400)
    for a in range(0, args.changes, args.pass_changes):
        b = min(args.changes, a + args.pass_changes)
        s.add(batch.positions[a:b], batch.seg[a:b], batch.new[a:b], batch.old[a:b])
    return s.finish(batch.counts)


def encode_steps(args, batch: Batch, c: chunked.ChunkedCodec, backends, note) -> None:
    """encode: the planes, each backend, the whole batch at once and pass by pass."""
    for backend in backends:
        note(
            "encode",
            f"{backend}, one batch",
            timed(lambda b=backend: chunked.encode_planes(batch, backend=b), args.reps),
        )

        def passes(backend=backend):
            os.environ[chunked.PLANES_ENV] = backend
            out = streamed(args, batch, c)
            os.environ.pop(chunked.PLANES_ENV, None)
            return out

        note("encode", f"{backend}, passes", timed(passes, args.reps))


def nvcomp_steps(args, batch: Batch, c: chunked.ChunkedCodec, planes, be, dev: torch.device, note) -> None:
    """compress (frames per call), write (into memory, copy sizes, merged passes; into a file), then
    inflate and hash the file's chunks."""
    counts = torch.stack([planes.n_big, planes.n_gap_esc, planes.n_mag_esc], 1).cpu().numpy()
    offsets, sizes = planes.layout.frames(counts[:, 0])
    used = sizes.reshape(-1) > 0
    off, size = offsets.reshape(-1)[used], sizes.reshape(-1)[used]
    saved = gpu.FRAMES_PER_CALL
    for fpc in (640, 1280, 2560, 5120, 10240, 40960):
        gpu.FRAMES_PER_CALL = fpc
        note(
            "compress",
            f"{fpc} frames/call",
            timed(lambda: gpu.compress_frames(be, planes.buf, off, size), args.reps),
        )
    gpu.FRAMES_PER_CALL = saved
    prepared = chunked.ChunkedBatch(c, batch.counts, batch.starts, [planes])
    saved_piece = write.COPY_PIECE_BYTES
    for mb in (2, 8, 32):
        write.COPY_PIECE_BYTES = mb << 20
        note("write", f"memory, {mb} MB copies", timed(lambda: prepared.write_to(MemorySink()), args.reps))
    write.COPY_PIECE_BYTES = saved_piece
    parts = streamed(args, batch, c)
    note("write", f"memory, {len(parts.parts)} parts merged", timed(lambda: parts.write_to(MemorySink()), args.reps))
    pool = ThreadPoolExecutor(16)
    tmp = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    header = VersionHeader(version=1, kind="delta", tensors={}, checksum="0" * 16, base=0, base_checksum="0" * 16)
    header.codec, header.format_version, header.enc = "chunked", 3, prepared.file_enc()

    def to_file() -> None:
        path = os.path.join(tmp, "f.safetensors")
        with PayloadWriter(path, header, chunked.PAYLOAD_LAYOUT, pool) as out:
            parts.write_to(out)
        os.unlink(path)

    note("write", "file (/dev/shm), 16 threads", timed(to_file, args.reps))
    pool.shutdown()
    inflate_steps(args, prepared, be, dev, note)


def inflate_steps(args, prepared: chunked.ChunkedBatch, be, dev: torch.device, note) -> None:
    """inflate: nvCOMP decompression of the file's frames at several chunks per call; the chunk hashes."""
    sink = MemorySink()
    prepared.write_to(sink)
    payload = {k: v for k, v in sink.payload().items()}
    streams = chunked.FileStreams(payload, prepared.file_enc(), {})
    blob = payload["blob"].to(dev)
    k_all = streams.layout.chunks
    for per in (128, 512, 1024, 4096, k_all):

        def inflate(per=per):
            for k0 in range(0, k_all, per):
                k1 = min(k_all, k0 + per)
                lay = streams.range_layout(k0, k1)
                out = torch.empty(lay.size, dtype=torch.uint8, device=dev)
                d_off, d_size = lay.frames(streams.index[k0:k1, chunked.COL_BIG])
                s_off = streams.blob_offsets[k0:k1]
                s_size = streams.index[k0:k1, : chunked.N_PLANES]
                u = d_size.reshape(-1) > 0
                be.decompress(
                    blob,
                    s_off.reshape(-1)[u],
                    s_size.reshape(-1)[u],
                    out,
                    d_off.reshape(-1)[u],
                    d_size.reshape(-1)[u],
                )

        note("inflate", f"{min(per, k_all)} chunks/call", timed(inflate, args.reps))
    note("hash", "all chunks", timed(lambda: gpu.hashes(blob, streams.chunk_bytes), args.reps))


def decode_steps(args, batch: Batch, planes, backends, note) -> None:
    """decode: the planes back to gaps and differences, each backend, 128 chunks a run."""
    views = chunked.plane_views(planes)
    spans = chunked.Spans.of(
        np.concatenate([[0], np.cumsum(batch.counts)[:-1]]),
        batch.counts,
        [0] * 400,
        [1 << 40] * 400,
        np.arange(400),
    )
    per = 128
    k_all = planes.layout.chunks
    for backend in backends:

        def decode(backend=backend):
            carry = chunked.Carry()
            for k0 in range(0, k_all, per):
                k1 = min(k_all, k0 + per)
                g0, m0 = int(planes.n_gap_esc[:k0].sum()), int(planes.n_mag_esc[:k0].sum())
                g1, m1 = int(planes.n_gap_esc[:k1].sum()), int(planes.n_mag_esc[:k1].sum())
                sub = views.sub(k0, k1, ((g0, g1), (m0, m1)))
                chunked.decode_planes(sub, k0 * planes.layout.chunk_elems, spans, carry, lambda i: {}, backend)

        note("decode", f"{backend}, {per} chunks/run", timed(decode, args.reps))


if __name__ == "__main__":
    sys.exit(main())
