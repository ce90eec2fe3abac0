"""The staging decoder against the codecs' own decode: same positions and diffs, same exceptions."""

from __future__ import annotations

import copy
import dataclasses
import logging
import re

import numpy as np
import pytest
import torch
import zstandard

from vllm_delta import codec as codecs
from vllm_delta.apply.staging import Decoder, Item
from vllm_delta.codec.chunked import FileStreams, gpu
from vllm_delta.errors import CodecError, IntegrityError, PositionError
from vllm_delta.testing.apply_fixtures import apply_diffs, realistic_diffs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(device)


def _tensors(seed=0):
    """(name, numel, positions, new bits, old bits): dense, sparse with gap escapes, one element,
    diff escapes (sign flips), an fp32 tensor."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    specs = [("dense", 5000, 0.3), ("sparse", 400_000, 0.0002), ("single", 70_000, None), ("wide", 3000, 0.1)]
    for name, numel, density in specs:
        if density is None:
            pos = torch.tensor([69_999])
        else:
            pos = torch.nonzero(torch.rand(numel, generator=gen) < density).reshape(-1)
        dtype = torch.int32 if name == "wide" else torch.int16
        old = torch.randint(-2000, 2000, (pos.numel(),), generator=gen).to(dtype)
        diffs = realistic_diffs(pos.numel(), gen, "cpu", width=old.element_size())
        diffs[::50] = 1 << (8 * old.element_size() - 1)  # plenty of value escapes
        out.append((name, numel, pos, apply_diffs(old, diffs), old))
    return out


def _items(tensors, codec, frame_elems=64):
    if codec == "chunked":
        return _file_items(tensors)
    c = codecs.CompactCodec(frame_elems=frame_elems) if codec == "compact" else codecs.get_codec(codec)
    items = []
    for i, (name, numel, pos, new, old) in enumerate(tensors):
        dtype = torch.float32 if new.dtype == torch.int32 else torch.bfloat16
        parts, meta = c.pack(c.prepare(pos, new, old, numel), dtype)
        items.append(Item(index=i, name=name, numel=numel, nnz=pos.numel(), enc=meta, parts=parts, dtype=dtype))
    return items


def _file_items(tensors, chunk_elems=128):
    """The tensors as one chunked file (small chunks: many per tensor, tensors sharing chunks),
    each an Item over the file's streams, as format.VersionFile.pieces gives them."""
    c = codecs.ChunkedCodec(chunk_elems=chunk_elems, slice_elems=3 * chunk_elems)
    sections = [(name, c.prepare(pos, new, old, numel)) for name, numel, pos, new, old in tensors]
    out = c.pack_file(sections)
    return [
        Item(
            index=i,
            name=name,
            numel=numel,
            nnz=pos.numel(),
            enc={**out.tensor_enc[name], "file": out.enc},
            parts=out.payload,
            dtype=torch.float32 if new.dtype == torch.int32 else torch.bfloat16,
        )
        for i, (name, numel, pos, new, old) in enumerate(tensors)
    ]


def _decode(items, codec, device, chunk_elems=100, threads=3, timings=None):
    dec = Decoder(device, chunk_elems=chunk_elems, threads=threads)
    out = {}
    for width in (2, 4):
        group = [it for it in items if it.dtype.itemsize == width]
        for ch in dec.decode(7, codec, group, width, {} if timings is None else timings):
            for t in ch.t_idx.unique().tolist():
                m = ch.t_idx == t
                pos, vals = ch.p[m], (ch.diffs if ch.diffs is not None else ch.values)[m]
                prev = out.get(t)
                out[t] = (pos, vals) if prev is None else (torch.cat([prev[0], pos]), torch.cat([prev[1], vals]))
    dec.close()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["chunked", "compact", "raw"])
@pytest.mark.parametrize("chunk_elems", [1, 100, 1 << 20])
def test_decoder_matches_codec_decode(device, codec, chunk_elems):
    dev = _device(device)
    tensors = _tensors()
    items = _items(tensors, codec)
    got = _decode(items, codec, dev, chunk_elems)
    for it, (name, numel, pos, new, old) in zip(items, tensors):
        ref = codecs.decode(codec, it.parts, it.enc, numel=numel, nnz=it.nnz, dtype=it.dtype)
        p, vals = got[it.index]
        assert torch.equal(p.cpu(), ref.positions), name
        assert torch.equal(p.cpu(), pos), name
        if codec in ("compact", "chunked"):
            assert torch.equal(apply_diffs(old, vals.cpu().to(torch.int64)), new), name
        else:
            assert torch.equal(vals.cpu(), new), name


def _corrupt(items, what):
    items = copy.deepcopy(items)
    frames = items[0].enc["frames"]
    if what == "count":
        frames[0][1] += 1
    elif what == "table":
        frames[0] = [1, 2]
    elif what == "size":
        blob = items[0].parts["blob"]
        a, b = frames[0][0], frames[1][0]
        items[0].parts["blob"] = torch.cat([blob[a : a + b], blob[b : a + b], blob[a + b :]])
        frames[0][0], frames[1][0] = b, a
        frames[0][1], frames[1][1] = frames[1][1], frames[0][1]
        frames[0][3:], frames[1][3:] = frames[1][3:], frames[0][3:]
        frames[0][2], frames[1][2] = frames[1][2], frames[0][2]
    elif what == "order":
        frames[2][2] = frames[1][2]
    elif what == "range":
        items[0].numel = 10
    elif what == "escapes":
        frames[0][4] += 1
    elif what == "missing":
        items[0].parts = {}
    return items


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "what,exc",
    [
        ("count", CodecError),
        ("table", CodecError),
        ("size", CodecError),
        ("order", PositionError),
        ("range", PositionError),
        ("escapes", CodecError),
        ("missing", CodecError),
    ],
)
def test_corrupt_payloads_raise_like_the_codec(device, what, exc):
    dev = _device(device)
    items = _corrupt(_items(_tensors(), "compact", frame_elems=64), what)
    it = items[0]
    with pytest.raises(exc) as ref_err:
        codecs.decode(
            "compact",
            it.parts,
            it.enc,
            numel=it.numel,
            nnz=it.nnz,
            dtype=it.dtype,
            ctx={"version": 7, "tensor": it.name},
        )
    with pytest.raises(IntegrityError) as got:
        _decode(items, "compact", dev)
    assert type(got.value) is type(ref_err.value)
    assert "version 7" in str(got.value) and it.name in str(got.value)


def test_raw_positions_checked():
    tensors = _tensors()
    items = _items(tensors, "raw")
    idx = items[1].parts["idx"].clone()
    idx[3], idx[4] = idx[4].item(), idx[3].item()
    items[1].parts = {"idx": idx, "val": items[1].parts["val"]}
    with pytest.raises(PositionError, match="unsorted"):
        _decode(items, "raw", torch.device("cpu"))


def test_chunked_decoder_reads_only_the_tensors_asked_for():
    """A layout holding some tensors of a file: the others' chunks are skipped (or their elements
    dropped where they share a chunk), the rest decode exactly."""
    tensors = _tensors(seed=3)
    items = _file_items(tensors)
    keep = [items[0], items[2]]
    got = _decode(keep, "chunked", torch.device("cpu"), chunk_elems=128)
    assert sorted(got) == [0, 2]
    for it in keep:
        _, numel, pos, new, old = tensors[it.index]
        p, d = got[it.index]
        assert torch.equal(p, pos)
        assert torch.equal(apply_diffs(old, d.to(torch.int64)), new)


def _corrupt_chunked(items, what):
    """A copy of the file's items with one fault in its streams or metadata."""
    items = copy.deepcopy(items)
    payload = dict(items[0].parts)
    for it in items:
        it.parts = payload
    index = payload["index"].clone()
    if what == "byte":  # one flipped byte in a compressed frame of chunk 3
        blob = payload["blob"].clone()
        blob[int(FileStreams(payload, items[0].enc["file"], {}).chunk_starts[3]) + 5] ^= 0x40
        payload["blob"] = blob
    elif what == "count":  # the index's big-element count of chunk 1, hash kept consistent
        index[1, 5] += 1
    elif what == "escapes":
        payload["mag_esc"] = payload["mag_esc"][:-1]
    elif what == "range":
        items[0].numel = 10
    elif what == "meta":
        for it in items:
            it.enc = {**it.enc, "file": {"chunk_elems": 100, "elems": 5}}
    payload["index"] = index
    if what == "missing":
        del payload["index"]
    return items


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "what,exc",
    [
        ("byte", CodecError),
        ("count", CodecError),
        ("escapes", CodecError),
        ("range", PositionError),
        ("missing", CodecError),
        ("meta", CodecError),
    ],
)
def test_corrupt_chunked_payloads_raise_like_the_codec(device, what, exc):
    """Every fault is the same exception from the per-piece decode and from staging (CPU path here;
    the GPU path in tests/codec/test_codec_gpu.py), naming the version and a tensor; a corrupt chunk
    names the chunk."""
    dev = _device(device)
    items = _corrupt_chunked(_file_items(_tensors()), what)
    it = items[0]
    with pytest.raises(exc) as ref_err:
        codecs.decode(
            "chunked",
            it.parts,
            it.enc,
            numel=it.numel,
            nnz=it.nnz,
            dtype=it.dtype,
            ctx={"version": 7, "tensor": it.name},
        )
    with pytest.raises(IntegrityError) as got:
        _decode(items, "chunked", dev)
    assert type(got.value) is type(ref_err.value)
    assert "version 7" in str(got.value)
    assert any(i.name in str(got.value) for i in items)
    if what == "byte":
        assert "chunk 3 " in str(got.value) and "corrupt" in str(got.value)


def _chunked_version_file(tmp_path, tensors):
    """The bf16 tensors as a one-file chunked version (format 3), written and opened."""
    from vllm_delta import format as fmt
    from vllm_delta import writer

    shapes = {name: (numel,) for name, numel, *_ in tensors}
    header, payload = writer.encode_delta(
        version=7,
        base=6,
        base_checksum="0" * 16,
        codec=codecs.ChunkedCodec(chunk_elems=128, slice_elems=384),
        shapes=shapes,
        dtypes=dict.fromkeys(shapes, torch.bfloat16),
        changes={name: (pos, new, old) for name, _, pos, new, old in tensors},
        sums=dict.fromkeys(shapes, 0),
    )
    path = str(tmp_path / "v7.safetensors")
    fmt.write(path, header, payload)
    return fmt.VersionFile(path), shapes


def test_one_file_chunked_versions_stage_from_arrays_like_items(tmp_path):
    """`changed_items` reads a one-file format-3 version straight into a FileSet of FilePieces (no
    per-tensor objects, what a mixture of experts needs); they decode as the per-piece Items do."""
    from vllm_delta.apply import staging
    from vllm_delta.apply.layout import DeviceLayout, Layout

    tensors = [t for t in _tensors(5) if t[3].dtype == torch.int16]
    vf, shapes = _chunked_version_file(tmp_path, tensors)
    dl = DeviceLayout(Layout.identity({**shapes, "untouched": (9,)}), torch.device("cpu"))
    fast = staging.changed_items(vf, dl)[2]
    assert isinstance(fast, staging.FileSet) and [f.names for f in fast.files] == [[n for n, *_ in tensors]]
    slow = staging._piece_items(vf, dl)[2]  # what versions of formats 1 and 2 take
    assert isinstance(slow, list)
    assert staging.item_indices(fast) == staging.item_indices(slow)
    got = {}
    for items in (fast, slow):
        dec = Decoder(torch.device("cpu"), chunk_elems=300, threads=2)
        chunks = list(dec.decode(7, "chunked", items, 2, {}))
        got[id(items)] = (torch.cat([c.p for c in chunks]), torch.cat([c.diffs for c in chunks]))
        dec.close()
    (p1, d1), (p2, d2) = got.values()
    assert torch.equal(p1, p2) and torch.equal(d1, d2)
    assert torch.equal(p1, torch.cat([pos for _, _, pos, _, _ in tensors]))


def test_malformed_piece_metadata_in_a_one_file_version_names_the_tensor(tmp_path):
    from vllm_delta.apply import staging
    from vllm_delta.apply.layout import DeviceLayout, Layout

    """Read straight off the header (FilePieces) or piece by piece (Items), the codec's decoder
    checks each piece's metadata and names the tensor."""
    tensors = [t for t in _tensors(6) if t[3].dtype == torch.int16]
    vf, shapes = _chunked_version_file(tmp_path, tensors)
    vf.header.tensors["sparse"] = dataclasses.replace(vf.header.tensors["sparse"], enc={"start": 0})  # no "at"
    dl = DeviceLayout(Layout.identity(shapes), torch.device("cpu"))
    fast = staging.changed_items(vf, dl)[2]
    assert isinstance(fast, staging.FileSet)
    slow = staging._piece_items(vf, dl)[2]
    assert isinstance(slow, list)  # the per-piece path
    for items in (fast, slow):
        with pytest.raises(CodecError, match="lacks 'at'") as exc:
            list(Decoder(torch.device("cpu"), threads=1).decode(7, "chunked", items, 2, {}))
        assert exc.value.tensor == "sparse"


class _StandInZstd:
    """A stand-in for nvCOMP's zstd (codec/chunked/gpu.GpuZstd), made of zstandard on the CPU: no
    GPU here, and the chunked decoder's GPU path (hash check before inflating, one call per run,
    sizes checked after, the CPU fallback on a failure) is control flow that must hold without one.
    The real backend runs in tests/codec/test_codec_gpu.py (`pytest -m gpu`)."""

    version = "stand-in"

    def __init__(self, fail: str | None = None):
        self.fail, self.calls = fail, 0

    def decompress(self, src, offsets, sizes, dst, dst_offsets, dst_sizes):
        self.calls += 1
        if self.fail == "raise":
            raise RuntimeError("stand-in: out of memory")
        raw, got = src.numpy(), []
        for a, n, d, m in zip(offsets.tolist(), sizes.tolist(), dst_offsets.tolist(), dst_sizes.tolist()):
            data = zstandard.ZstdDecompressor().decompress(raw[a : a + n].tobytes(), max_output_size=m)
            dst[d : d + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            got.append(len(data) - (1 if self.fail == "short" else 0))
        return np.array(got, dtype=np.int64)


@pytest.mark.parametrize("fail", [None, "raise", "short", "corrupt"])
def test_chunked_gpu_path_control_flow_with_a_stand_in_backend(monkeypatch, caplog, fail):
    """The GPU path of the chunked staging decoder, its backend stood in for (see _StandInZstd):
    it decodes what the CPU path decodes and times "inflate"; a backend failure falls back to the
    CPU path with a warning, same result; a short frame or a corrupt chunk is a CodecError naming
    the version, a tensor and the chunk."""
    tensors = _tensors(seed=4)
    items = _file_items(tensors)
    ref = _decode(items, "chunked", torch.device("cpu"), chunk_elems=256)
    if fail == "corrupt":
        items = _corrupt_chunked(items, "byte")
    backend = _StandInZstd(fail if fail in ("raise", "short") else None)
    monkeypatch.setattr(gpu, "backend", lambda device: (backend, ""))
    timings: dict[str, float] = {}
    if fail in ("short", "corrupt"):
        with pytest.raises(CodecError) as exc:
            _decode(items, "chunked", torch.device("cpu"), chunk_elems=256, threads=2)
        want = "frame decompressed to" if fail == "short" else "chunk 3 .*corrupt"
        assert exc.value.version == 7 and exc.value.tensor in {it.name for it in items}
        assert re.search(want, str(exc.value)), str(exc.value)
        assert backend.calls == (0 if fail == "corrupt" else 1)  # a chunk's hash is checked before inflating
        return
    with caplog.at_level(logging.WARNING, logger="vllm_delta.codec.chunked.decoder"):
        got = _decode(items, "chunked", torch.device("cpu"), chunk_elems=256, threads=2, timings=timings)
    assert backend.calls >= 1
    assert sorted(got) == sorted(ref)
    for t, (p, d) in ref.items():
        assert torch.equal(got[t][0], p) and torch.equal(got[t][1], d)
    warned = [r.getMessage() for r in caplog.records if "GPU decode of version 7 failed" in r.getMessage()]
    assert ("inflate" in timings) == (fail is None)
    assert bool(warned) == (fail == "raise")


def test_a_codec_registered_without_a_decoder_stages_piece_by_piece():
    """The registry: a codec registered without a staging decoder is staged through its own
    unpack/finish, one piece at a time (PieceDecoder), to the same changes as the raw codec's own
    decoder; a name is registered once; an unknown name is a CodecError naming the version."""
    from vllm_delta.codec import registry
    from vllm_delta.codec.decoding import PieceDecoder

    name = "raw-piece-by-piece"
    if name not in registry.names():
        registry.register_codec(name, codecs.RawCodec)
    assert isinstance(registry.get_decoder(name), PieceDecoder)
    assert not isinstance(registry.get_decoder("raw"), PieceDecoder)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_codec(name, codecs.RawCodec)
    items = _items(_tensors(), "raw")
    cpu = torch.device("cpu")
    got, want = _decode(items, name, cpu), _decode(items, "raw", cpu)
    assert sorted(got) == sorted(want) == [it.index for it in items]
    for t, (p, v) in want.items():
        assert torch.equal(got[t][0], p) and torch.equal(got[t][1], v)
    with pytest.raises(CodecError, match="unknown codec 'lz5'") as exc:
        _decode(items, "lz5", cpu)
    assert exc.value.version == 7


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["chunked", "compact", "raw"])
def test_phases_wait_for_the_device_only_when_asked(device, codec, monkeypatch):
    """Staging's phase marks wait for the device only with VLLM_DELTA_STAGE_TIMING=sync (per-phase
    device times for profiling); by default the device runs behind the host. Same decode either way,
    and every phase is timed either way."""
    from vllm_delta.apply import staging

    dev = _device(device)
    tensors = _tensors(seed=2)
    items = _items(tensors, codec)
    results, waits = {}, {}
    for mode in ("", "sync"):
        monkeypatch.setenv(staging.PHASE_TIMING_ENV, mode)
        calls: list[int] = []
        real = Decoder.sync

        def counted(self, calls=calls, real=real):
            calls.append(1)
            real(self)

        monkeypatch.setattr(Decoder, "sync", counted)
        timings: dict[str, float] = {}
        results[mode] = _decode(items, codec, dev, 100, timings=timings)
        waits[mode] = len(calls)
        assert "decode" in timings
        monkeypatch.setattr(Decoder, "sync", real)
    # the one wait left by default is the end of each width's decode (pinned buffers reused after it)
    assert waits[""] <= 2 < waits["sync"], waits
    for t, (pos, vals) in results["sync"].items():
        assert torch.equal(results[""][t][0], pos) and torch.equal(results[""][t][1], vals)


def test_staging_chunk_defaults_by_device():
    """A GPU stages in chunks of 2^24 changed elements (its per-chunk host cost, measured), the CPU in
    2^23 (half the host temporaries); a chunk size the caller names is kept on either."""
    from vllm_delta.apply import staging

    assert staging.default_chunk_elems(torch.device("cuda", 0)) == staging.GPU_CHUNK_ELEMS == 1 << 24
    assert staging.default_chunk_elems(torch.device("cpu")) == staging.CHUNK_ELEMS == 1 << 23
    dec = Decoder(torch.device("cpu"))
    assert dec.chunk_elems == 1 << 23
    dec.close()
    dec = Decoder(torch.device("cpu"), chunk_elems=1000)
    assert dec.chunk_elems == 1000
    dec.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_translate_gives_whole_tensor_selections_their_target_runs(tp):
    """With the chunk's runs (tensor, count), a Selection of every element carries its runs of equal
    target on the host (what lets a fused plan skip its device-to-host wait): the same runs as the
    device's target ids, on Qwen3's layout (fused q/k/v and gate/up targets) at TP=1 and TP=2."""
    import numpy as np

    from vllm_delta.apply.layout import DeviceLayout
    from vllm_delta.codec.decoding import Runs
    from vllm_delta.testing.apply_fixtures import QWEN3, model_layout

    _, layout = model_layout(QWEN3["qwen3-tiny"], tp=tp, rank=tp - 1)
    dl = DeviceLayout(layout, torch.device("cpu"))
    gen = torch.Generator().manual_seed(tp)
    ids = torch.unique(torch.randint(0, int(dl.numels.sum()), (3000,), generator=gen))  # sorted global ids
    t_idx, p, runs = dl.split_global(ids)
    runs = Runs(runs.tensors, runs.counts).nonempty()
    with_runs = 0
    for s in dl.translate(t_idx, p, runs.tensors, runs.counts):
        if s.mask is not None:
            assert s.runs is None
            continue
        with_runs += 1
        target = s.target.numpy()
        change = np.flatnonzero(np.r_[True, target[1:] != target[:-1]])
        assert s.runs is not None
        assert s.runs.targets.tolist() == target[change].tolist()
        assert s.runs.lengths.tolist() == np.diff(np.r_[change, target.size]).tolist()
    if tp == 1:  # every tensor whole on one rank: one selection of every element (at TP=2, split tensors mask)
        assert with_runs == 1
    assert all(s.runs is None for s in dl.translate(t_idx, p, runs.tensors))  # no counts given: no runs
