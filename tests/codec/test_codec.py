import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_delta import codec
from vllm_delta.errors import CodecError, PositionError

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT = {2: torch.int16, 4: torch.int32}


def bits(t):
    return t.view(INT[t.element_size()]).reshape(-1)


def round_trip(name, positions, new_bits, old_bits, numel, dtype, **kw):
    if name == "chunked":
        c = codec.ChunkedCodec(chunk_elems=128, slice_elems=256)  # many chunks and slices
    else:
        c = codec.CompactCodec(**kw) if kw else codec.get_codec(name)
    tensors, meta = c.pack(c.prepare(positions, new_bits, old_bits, numel), dtype)
    sections = c.unpack(tensors, meta, numel=numel, nnz=positions.numel(), dtype=dtype, ctx={})
    changes = c.finish(sections, numel=numel, device="cpu", ctx={})
    return changes, tensors


@st.composite
def change_sets(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    numel = int(np.prod(shape))
    kind = draw(st.sampled_from(["none", "one", "all", "random"]))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(shape, generator=g) * draw(st.sampled_from([0.02, 1.0, 1e4]))).to(dtype)
    if kind == "none":
        mask = torch.zeros(numel, dtype=torch.bool)
    elif kind == "one":
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[int(torch.randint(0, numel, (1,), generator=g))] = True
    elif kind == "all":
        mask = torch.ones(numel, dtype=torch.bool)
    else:
        mask = torch.rand(numel, generator=g) < draw(st.floats(0.001, 0.9))
    # mostly tiny moves, some sign flips and arbitrary bit patterns (escapes)
    step = torch.randint(-3, 4, (numel,), generator=g)
    wild = torch.randint(-(2 ** (8 * old.element_size() - 1)), 2 ** (8 * old.element_size() - 1), (numel,), generator=g)
    use_wild = torch.rand(numel, generator=g) < 0.1
    new_b = bits(old).to(torch.int64) + torch.where(use_wild, wild, step)
    width = 8 * old.element_size()
    new_b = (new_b + (1 << width)) % (1 << width)
    new_b = torch.where(new_b >= (1 << (width - 1)), new_b - (1 << width), new_b).to(INT[old.element_size()])
    new_b = torch.where(mask, new_b, bits(old))
    changed = (new_b != bits(old)).nonzero().reshape(-1)
    return dtype, numel, changed, new_b[changed], bits(old)[changed]


@pytest.mark.parametrize("name", ["raw", "compact", "chunked"])
@given(case=change_sets())
@settings(max_examples=60, deadline=None)
def test_round_trip_bit_exact(name, case):
    dtype, numel, pos, new, old = case
    changes, _ = round_trip(name, pos, new, old, numel, dtype)
    assert torch.equal(changes.positions, pos)
    assert torch.equal(changes.new_bits(old), new)


@given(case=change_sets(), frame=st.integers(1, 7))
@settings(max_examples=40, deadline=None)
def test_compact_many_frames(case, frame):
    dtype, numel, pos, new, old = case
    changes, tensors = round_trip("compact", pos, new, old, numel, dtype, frame_elems=frame)
    assert torch.equal(changes.positions, pos)
    assert torch.equal(changes.new_bits(old), new)


def test_gap_escapes_and_huge_logical_tensors():
    """Positions beyond 2^31 (int64 addressing) and gaps >= 65535, without allocating the tensor."""
    numel = (1 << 34) + 5
    pos = torch.tensor([0, 70_000, 70_001, (1 << 31) + 3, (1 << 33) + 7, numel - 1], dtype=torch.int64)
    old = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int16)
    new = torch.tensor([2, 1, 300, -32768, 32767, 6 + 128], dtype=torch.int16)
    for name in ("raw", "compact"):
        changes, tensors = round_trip(name, pos, new, old, numel, torch.bfloat16)
        assert torch.equal(changes.positions, pos)
        assert torch.equal(changes.new_bits(old), new)
    raw, _ = codec.RawCodec().pack(codec.RawCodec().prepare(pos, new, old, numel), torch.bfloat16)
    assert raw["idx"].dtype == torch.int64
    small, _ = codec.RawCodec().pack(codec.RawCodec().prepare(pos[:3], new[:3], old[:3], 100_000), torch.bfloat16)
    assert small["idx"].dtype == torch.int32


def test_realistic_adamw_deltas_are_small_and_exact():
    """fp32 master weights, AdamW lr 1e-6: compact reconstructs exactly in <= 1.5 B per changed element."""
    from vllm_delta.testing.models import TinyModelSpec
    from vllm_delta.testing.training import bf16_image, build_master_model, train_steps

    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2)
    model = build_master_model(spec, seed=1)
    prev = bf16_image(model)
    for _ in train_steps(model, 3, seed=1):
        cur = bf16_image(model)
        total_nnz = total_bytes = 0
        for name, t in cur.items():
            o, n = bits(prev[name]), bits(t)
            pos = (o != n).nonzero().reshape(-1)
            changes, tensors = round_trip("compact", pos, n[pos], o[pos], o.numel(), torch.bfloat16)
            assert torch.equal(changes.positions, pos)
            assert torch.equal(changes.new_bits(o[pos]), n[pos])
            total_nnz += pos.numel()
            total_bytes += sum(v.numel() * v.element_size() for v in tensors.values())
        assert 0.001 < total_nnz / sum(t.numel() for t in cur.values()) < 0.2
        assert total_bytes / total_nnz <= 1.5
        prev = cur


def _compact_payload(numel=1000):
    pos = torch.tensor([3, 10, 500], dtype=torch.int64)
    old = torch.tensor([1, 2, 3], dtype=torch.int16)
    new = torch.tensor([2, 3, 4], dtype=torch.int16)
    c = codec.get_codec("compact")
    return c, *c.pack(c.prepare(pos, new, old, numel), torch.bfloat16)


def test_compact_rejects_corruption():
    c, tensors, meta = _compact_payload()
    blob = tensors["blob"].clone()
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(CodecError):
        c.unpack({"blob": blob}, meta, numel=1000, nnz=3, dtype=torch.bfloat16, ctx={"version": 4, "tensor": "w"})
    with pytest.raises(CodecError, match="frame table"):
        c.unpack({"blob": blob[:-3]}, meta, numel=1000, nnz=3, dtype=torch.bfloat16, ctx={})
    with pytest.raises(CodecError):
        c.unpack(tensors, meta, numel=1000, nnz=4, dtype=torch.bfloat16, ctx={})
    with pytest.raises(CodecError):  # an escape table the frame does not hold
        frames = [[f[0], f[1], f[2], f[3], 1] for f in meta["frames"]]
        codec.decode("compact", tensors, {"frames": frames}, numel=1000, nnz=3, dtype=torch.bfloat16)
    # escape codes without escape entries (and the reverse) are caught after decompression
    for gaps, d8, gap_esc, diff_esc in [
        ([0xFFFF], [1], [], []),
        ([1], [1], [70000], []),
        ([1], [-128], [], []),
        ([1], [1], [], [500]),
    ]:
        sections = codec.Sections(
            {
                "gaps16": np.array(gaps, np.uint16),
                "d8": np.array(d8, np.int8),
                "gap_esc": np.array(gap_esc, np.int64),
                "diff_esc": np.array(diff_esc, np.int16),
                "frame_n": np.array([1]),
                "frame_start": np.array([0]),
            }
        )
        with pytest.raises(CodecError, match="escape"):
            c.finish(sections, numel=10**6, device="cpu", ctx={})
    with pytest.raises(CodecError):
        c.unpack({}, meta, numel=1000, nnz=3, dtype=torch.bfloat16, ctx={})


def test_compact_rejects_out_of_range_with_names():
    c, tensors, meta = _compact_payload()
    with pytest.raises(PositionError, match=r"out of range.*version 9, tensor 'w'"):
        codec.decode(
            "compact", tensors, meta, numel=400, nnz=3, dtype=torch.bfloat16, ctx={"version": 9, "tensor": "w"}
        )
    # a frame table whose second frame starts inside the first: positions would go backwards
    two = codec.CompactCodec(frame_elems=2)
    pos = torch.tensor([3, 10, 12])
    tensors, meta = two.pack(two.prepare(pos, pos.to(torch.int16), pos.to(torch.int16) - 1, 100), torch.bfloat16)
    assert codec.decode("compact", tensors, meta, numel=100, nnz=3, dtype=torch.bfloat16).positions.tolist() == [
        3,
        10,
        12,
    ]
    meta["frames"][1][2] = 2
    with pytest.raises(PositionError, match="unsorted"):
        codec.decode("compact", tensors, meta, numel=100, nnz=3, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "idx, msg",
    [([1, 5, 1000], "out of range"), ([5, 1, 7], "unsorted"), ([1, 1, 7], "duplicated"), ([-1, 2, 3], "out of range")],
)
def test_raw_rejects_bad_positions(idx, msg):
    c = codec.get_codec("raw")
    tensors = {"idx": torch.tensor(idx, dtype=torch.int32), "val": torch.ones(3, dtype=torch.bfloat16)}
    sections = c.unpack(tensors, {}, numel=1000, nnz=3, dtype=torch.bfloat16, ctx={"version": 2, "tensor": "t"})
    with pytest.raises(PositionError, match=msg):
        c.finish(sections, numel=1000, device="cpu", ctx={"version": 2, "tensor": "t"})


def test_raw_rejects_wrong_lengths_and_dtypes():
    c = codec.get_codec("raw")
    good = {"idx": torch.tensor([1, 2], dtype=torch.int32), "val": torch.ones(2, dtype=torch.bfloat16)}
    with pytest.raises(CodecError):
        c.unpack(good, {}, numel=10, nnz=3, dtype=torch.bfloat16, ctx={})
    with pytest.raises(CodecError):
        c.unpack(good, {}, numel=10, nnz=2, dtype=torch.float16, ctx={})


def test_unknown_codec():
    with pytest.raises(CodecError, match="unknown codec 'lz5'.*version 3"):
        codec.get_codec("lz5", {"version": 3})


def test_relative_values_need_the_base():
    c, tensors, meta = _compact_payload()
    changes = codec.decode("compact", tensors, meta, numel=1000, nnz=3, dtype=torch.bfloat16)
    with pytest.raises(CodecError):
        changes.new_bits(None)


# -- the chunked codec (format 3) ---------------------------------------------------------------


def _batch(specs, seed=0, width=2):
    """A Batch of tensors (numel, changed, start) with realistic and escaping differences."""
    gen = torch.Generator().manual_seed(seed)
    dt = INT[width]
    lim = 2 ** (8 * width - 1)
    pos_l, new_l, old_l, seg_l, items = [], [], [], [], []
    for t, (numel, n, start) in enumerate(specs):
        pos = torch.sort(torch.randperm(numel - start, generator=gen)[:n]).values + start
        old = torch.randint(-lim, lim, (n,), generator=gen, dtype=torch.int64)
        step = torch.where(torch.rand(n, generator=gen) < 0.5, 1, -1)
        big = torch.rand(n, generator=gen) < 0.15
        step = torch.where(big, torch.randint(-400, 400, (n,), generator=gen), step)
        step[step == 0] = 3
        wild = torch.rand(n, generator=gen) < 0.02
        step = torch.where(wild, torch.randint(-lim, lim, (n,), generator=gen), step)
        new = (old + step + 2 * lim) % (2 * lim)
        new = torch.where(new >= lim, new - 2 * lim, new)
        keep = new != old
        pos, new, old = pos[keep], new[keep].to(dt), old[keep].to(dt)
        items.append((pos, new, old, numel, start))
        pos_l.append(pos)
        new_l.append(new)
        old_l.append(old)
        seg_l.append(torch.full((pos.numel(),), t, dtype=torch.int64))
    batch = codec.Batch(
        torch.cat(pos_l),
        torch.cat(new_l),
        torch.cat(old_l),
        torch.cat(seg_l),
        [int(p.numel()) for p in pos_l],
        [s[2] for s in specs],
        [s[0] for s in specs],
    )
    return batch, items


SPECS = [(1000, 120, 0), (70000, 3, 0), (500, 0, 0), (200000, 3000, 100000), (10, 10, 0), (3_000_000, 2, 5)]


@pytest.mark.parametrize("width", [2, 4])
def test_chunked_file_of_a_batch_equals_the_file_of_its_tensors(width):
    """`prepare_batch` (the Publisher's path) and `prepare` per tensor give the same file, bit for bit,
    whatever the device slice size; every tensor decodes from it exactly."""
    batch, items = _batch(SPECS, seed=2, width=width)
    c = codec.ChunkedCodec(chunk_elems=256, slice_elems=512)
    named = [(str(t), s) for t, s in enumerate(c.prepare_batch(batch).split()) if s is not None]
    got = c.pack_file(named)
    one_by_one = [
        (str(t), c.prepare(p, n, o, numel, start)) for t, (p, n, o, numel, start) in enumerate(items) if p.numel()
    ]
    want = c.pack_file(one_by_one)
    wide = codec.ChunkedCodec(chunk_elems=256, slice_elems=1 << 20)
    other = wide.pack_file([(str(t), s) for t, s in enumerate(wide.prepare_batch(batch).split()) if s is not None])
    for out in (want, other):
        assert got.enc == out.enc and got.tensor_enc == out.tensor_enc
        assert all(torch.equal(got.payload[k], out.payload[k]) for k in got.payload)
    dtype = torch.bfloat16 if width == 2 else torch.float32
    for t, (pos, new, old, numel, start) in enumerate(items):
        if not pos.numel():
            continue
        meta = {**got.tensor_enc[str(t)], "file": got.enc}
        assert meta["start"] == start
        changes = codec.decode("chunked", got.payload, meta, numel=numel, nnz=pos.numel(), dtype=dtype)
        assert torch.equal(changes.positions, pos) and torch.equal(changes.new_bits(old), new)


def test_chunked_frames_are_standard_zstd_frames_and_hashes_agree():
    """Every frame of the blob decompresses alone with zstandard to its plane's size (what nvCOMP
    reads and writes), frames start 16-aligned, and the numpy and torch chunk hashes agree."""
    import zstandard

    from vllm_delta.checksums import chunk_hash_np, chunk_hashes, chunk_hashes_np
    from vllm_delta.codec.chunked import FileStreams

    batch, _ = _batch(SPECS, seed=4)
    c = codec.ChunkedCodec(chunk_elems=128)
    out = c.pack_file([(str(t), s) for t, s in enumerate(c.prepare_batch(batch).split()) if s is not None])
    fs = FileStreams(out.payload, out.enc, {})
    raw = fs.blob.numpy()
    for k in range(fs.layout.chunks):
        for f in range(5):
            size = int(fs.index[k, f])
            if not size:
                assert fs.raw_sizes[k, f] == 0
                continue
            a = int(fs.blob_offsets[k, f])
            assert a % 16 == 0
            frame = raw[a : a + size].tobytes()
            assert len(zstandard.ZstdDecompressor().decompress(frame, max_output_size=1 << 20)) == fs.raw_sizes[k, f]
    hashes = chunk_hashes(fs.blob, torch.from_numpy(fs.chunk_bytes))
    assert hashes.tolist() == fs.index[:, 8].tolist()
    assert chunk_hashes_np(raw, fs.chunk_bytes).tolist() == fs.index[:, 8].tolist()
    assert hashes.tolist() == [
        chunk_hash_np(raw[fs.chunk_starts[k] : fs.chunk_starts[k + 1]]) for k in range(fs.layout.chunks)
    ]


def test_chunked_beats_compact_on_realistic_deltas():
    """The chunked layout (sign/big bit planes instead of int8 differences) is smaller than
    `compact` on RL-like changes (89% one ULP); payload.py measures it on real AdamW steps."""
    from vllm_delta.testing.apply_fixtures import apply_diffs, realistic_diffs

    gen = torch.Generator().manual_seed(1)
    numel = 2_000_000
    pos = torch.nonzero(torch.rand(numel, generator=gen) < 0.015).reshape(-1)
    old = torch.randint(-16000, 16000, (pos.numel(),), generator=gen).to(torch.int16)
    new = apply_diffs(old, realistic_diffs(pos.numel(), gen, "cpu", width=2))
    sizes = {}
    for name in ("compact", "chunked"):
        tensors, _ = codec.encode(name, pos, new, old, numel, torch.bfloat16)
        sizes[name] = sum(t.numel() * t.element_size() for t in tensors.values())
    assert sizes["chunked"] < 0.97 * sizes["compact"], sizes


def test_encoding_path_is_logged_once(caplog):
    """Without nvCOMP (or with CPU tensors) the CPU path runs, and says so in one log line."""
    import logging

    from vllm_delta.codec.chunked import gpu

    gpu.reset()
    batch, _ = _batch(SPECS[:2])
    c = codec.ChunkedCodec(chunk_elems=128)
    with caplog.at_level(logging.INFO, logger="vllm_delta.codec.chunked.gpu"):
        for _ in range(3):
            c.pack_file([(str(t), s) for t, s in enumerate(c.prepare_batch(batch).split()) if s is not None])
    lines = [r.getMessage() for r in caplog.records if "chunked codec encodes" in r.getMessage()]
    assert lines == ["vllm-delta: the chunked codec encodes on the CPU (zstandard): the changes are on the CPU"]


@pytest.mark.parametrize("cuts", [[0], [1, 255, 256, 257], [100, 100, 2000, 5000], [3000]])
def test_chunked_stream_encoder_equals_prepare_batch(cuts):
    """Changes handed over in passes (the trainer's detection: one pass on the device at a time)
    give the same file, bit for bit, as the whole batch at once, wherever the passes end."""
    batch, _ = _batch(SPECS, seed=5)
    c = codec.ChunkedCodec(chunk_elems=256, slice_elems=512)
    want = c.pack_file([(str(t), s) for t, s in enumerate(c.prepare_batch(batch).split()) if s is not None])
    enc = c.stream(batch.starts)
    bounds = sorted({0, batch.positions.numel(), *[min(x, batch.positions.numel()) for x in np.cumsum(cuts)]})
    for a, b in zip(bounds, bounds[1:] + [bounds[-1]]):
        enc.add(batch.positions[a:b], batch.seg[a:b], batch.new[a:b], batch.old[a:b])
    prepared = enc.finish(batch.counts)
    got = c.pack_file([(str(t), s) for t, s in enumerate(prepared.split()) if s is not None])
    assert got.enc == want.enc and got.tensor_enc == want.tensor_enc
    assert all(torch.equal(got.payload[k], want.payload[k]) for k in want.payload)
    with pytest.raises(ValueError, match="changes encoded"):
        c.stream(batch.starts).finish(batch.counts)


@pytest.mark.parametrize("threads", [0, 3])
def test_streamed_delta_file_holds_what_assemble_delta_gives(tmp_path, threads):
    """writer.write_delta streams a chunked file (format.PayloadWriter); it reads back as the file
    assemble_delta + format.write gives: same header, same payload tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_delta import format as fmt
    from vllm_delta import writer

    g = torch.Generator().manual_seed(3)
    shapes = {"a": (300, 40), "b": (7,), "c": (5000,)}
    changes, sums = {}, {}
    for name, shape in shapes.items():
        numel = int(np.prod(shape))
        pos = torch.nonzero(torch.rand(numel, generator=g) < 0.3).reshape(-1)
        old = torch.randint(-3000, 3000, (pos.numel(),), generator=g).to(torch.int16)
        changes[name] = (pos, (old + 1).to(torch.int16), old)
        sums[name] = 11
    c = codec.ChunkedCodec(chunk_elems=128, slice_elems=256)
    dtypes = dict.fromkeys(shapes, torch.bfloat16)

    def prepared():
        return {n: writer.prepare_changes(c, shapes[n], torch.bfloat16, sums[n], changes[n]) for n in shapes}

    pool = ThreadPoolExecutor(threads) if threads else None
    of = writer.DeltaOf(version=5, base=4, base_checksum="0" * 16, created=1.0)
    timings: dict[str, float] = {}
    path = str(tmp_path / "streamed.safetensors")
    header = writer.write_delta(path, of, c, prepared(), pool=pool, timings=timings)
    ref_header, ref_payload = writer.assemble_delta(
        version=5, base=4, base_checksum="0" * 16, codec=c, tensors=prepared(), created=1.0
    )
    assert header == ref_header and set(timings) == {"pack", "write"}
    vf = fmt.VersionFile(path, expect_version=5)
    assert vf.header == ref_header
    got = vf.file_payload()
    for key, t in ref_payload.items():
        assert torch.equal(got[key.split("::", 1)[1]], t), key
    for name in shapes:
        (piece,) = vf.pieces(name)
        ch = codec.decode("chunked", piece.payload, piece.enc, numel=piece.stop, nnz=piece.nnz, dtype=dtypes[name])
        assert torch.equal(ch.positions, changes[name][0])
    if pool is not None:
        pool.shutdown()
