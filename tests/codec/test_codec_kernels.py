"""The chunked codec's Triton kernels (codec/chunked/kernels.py) against its torch reference, bit for bit.

On the CPU the kernels run under TRITON_INTERPRET=1 (the Makefile's test target sets it; the tests
skip without it or without Triton); `pytest -m gpu` runs the same comparisons on CUDA at sizes that
fill the card."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_delta.codec import chunked
from vllm_delta.codec.base import Batch, segment_ids
from vllm_delta.codec.chunked import kernels

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(
    not kernels.available(CPU), reason="Triton kernels on the CPU need Triton and TRITON_INTERPRET=1"
)
INT = {2: torch.int16, 4: torch.int32}


def make_batch(
    seed: int,
    counts: list[int],
    numels: list[int],
    width: int = 2,
    device: torch.device = CPU,
    big_share: float = 0.15,
    wild_share: float = 0.02,
    far: bool = True,
) -> Batch:
    """Changes of several tensors end to end: sorted positions (some gaps >= 65535 when `far`),
    mostly +-1 differences, some larger, a few arbitrary bit patterns (value escapes)."""
    g = torch.Generator().manual_seed(seed)
    positions, new, old = [], [], []
    starts = []
    for n, numel in zip(counts, numels):
        start = int(torch.randint(0, max(1, numel // 8), (1,), generator=g)) if numel > 1 else 0
        starts.append(start)
        span = numel - start
        if far and n > 2 and span > 200_000:  # a hole of 70,000 elements in the middle: one gap escape
            lo = torch.randperm(span // 2 - 70_000, generator=g)[: n // 2]
            hi = torch.randperm(span - span // 2, generator=g)[: n - n // 2] + span // 2
            pos = torch.cat([lo.sort().values, hi.sort().values]) + start
        else:
            pos = torch.randperm(span, generator=g)[:n].sort().values + start
        positions.append(pos.to(torch.int64))
        lim = 1 << (8 * width - 1)
        o = torch.randint(-lim, lim, (n,), generator=g, dtype=torch.int64)
        step = torch.where(torch.rand(n, generator=g) < 0.5, 1, -1)
        big = torch.rand(n, generator=g) < big_share
        step = torch.where(big, torch.randint(-200, 201, (n,), generator=g), step)
        step = torch.where(step == 0, 1, step)
        wild = torch.rand(n, generator=g) < wild_share
        step = torch.where(wild, torch.randint(-lim, lim, (n,), generator=g), step)
        nb = o + step
        nb = (nb + (1 << (8 * width))) % (1 << (8 * width))
        nb = torch.where(nb >= lim, nb - (1 << (8 * width)), nb)
        nb = torch.where(nb == o, o + 1, nb)  # a change changes something (wraps stay in range below)
        nb = torch.where(nb >= lim, nb - (1 << (8 * width)), nb)
        new.append(nb.to(INT[width]))
        old.append(o.to(INT[width]))
    cnt = torch.tensor([p.numel() for p in positions], dtype=torch.int64)
    total = int(cnt.sum())
    return Batch(
        positions=torch.cat(positions).to(device),
        new=torch.cat(new).to(device),
        old=torch.cat(old).to(device),
        seg=segment_ids(cnt, total).to(device),
        counts=cnt.tolist(),
        starts=starts,
        numels=numels,
    )


def frames(planes: chunked.Planes) -> tuple[np.ndarray, np.ndarray]:
    """What a file stores of some planes: the CPU compressor's blob and index (every frame's bytes)."""
    host = chunked.Planes(
        layout=planes.layout,
        buf=planes.buf.cpu(),
        n_big=planes.n_big.cpu(),
        n_gap_esc=planes.n_gap_esc.cpu(),
        n_mag_esc=planes.n_mag_esc.cpu(),
        gap_esc=planes.gap_esc.cpu(),
        mag_esc=planes.mag_esc.cpu(),
    )
    return chunked.compress_cpu(host)


def assert_same_planes(a: chunked.Planes, b: chunked.Planes) -> None:
    """Every byte a frame covers, every count and escape: equal (the bytes between frames are not data)."""
    assert a.layout == b.layout
    for name in ("n_big", "n_gap_esc", "n_mag_esc", "gap_esc", "mag_esc"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    va, vb = chunked.plane_views(a), chunked.plane_views(b)
    for name in ("lo", "hi", "sign", "big"):
        assert torch.equal(getattr(va, name).cpu(), getattr(vb, name).cpu()), name
    mag_a, mag_b = va.mag.cpu(), vb.mag.cpu()
    for k, nb in enumerate(a.n_big.cpu().tolist()):
        assert torch.equal(mag_a[k, :nb], mag_b[k, :nb]), f"mag codes of chunk {k}"
    blob_a, index_a = frames(a)
    blob_b, index_b = frames(b)
    assert np.array_equal(index_a, index_b) and np.array_equal(blob_a, blob_b)


CASES = [
    # (seed, counts, numels, width, chunk_elems)
    (0, [1], [1], 2, 128),
    (1, [300, 0, 5, 2000], [5000, 7, 9, 300_000], 2, 128),
    (2, [4096], [400_000], 2, 256),
    (3, [777, 1234], [3000, 250_000], 4, 128),
    (4, [129, 1, 1, 1, 900], [130, 1, 2, 3, 250_000], 2, 128),
]


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_triton_encoder_is_the_torch_encoder(case):
    seed, counts, numels, width, chunk = case
    batch = make_batch(seed, counts, numels, width)
    ref = chunked.encode_planes(batch, chunk, 4 * chunk, backend="torch")
    got = chunked.encode_planes(batch, chunk, 4 * chunk, backend="triton")
    assert ref.gap_esc.numel() or ref.mag_esc.numel() or seed == 0  # the cases exercise escapes
    assert_same_planes(got, ref)


@needs_kernels
def test_triton_encoder_continues_a_batch():
    """A batch cut at a chunk boundary and encoded in two calls (the second with the first's last
    element as context) gives the planes of one call, on both backends."""
    batch = make_batch(5, [900, 700, 1500], [4000, 300_000, 9000])
    cut = 1280  # a multiple of the chunk size, inside the second tensor
    ref = chunked.encode_planes(batch, 128, 512, backend="torch")

    def half(a, b):
        return Batch(
            positions=batch.positions[a:b],
            new=batch.new[a:b],
            old=batch.old[a:b],
            seg=batch.seg[a:b],
            counts=[],
            starts=batch.starts,
            numels=[],
        )

    ctx = (batch.positions[cut - 1 : cut], batch.seg[cut - 1 : cut])
    for backend in ("torch", "triton"):
        first = chunked.encode_planes(half(0, cut), 128, 512, backend=backend)
        second = chunked.encode_planes(half(cut, batch.positions.numel()), 128, 512, context=ctx, backend=backend)
        va, vb, vr = chunked.plane_views(first), chunked.plane_views(second), chunked.plane_views(ref)
        assert torch.equal(torch.cat([va.lo, vb.lo]), vr.lo)
        assert torch.equal(torch.cat([va.hi, vb.hi]), vr.hi)
        assert torch.equal(torch.cat([va.sign, vb.sign]), vr.sign)
        assert torch.equal(torch.cat([first.n_big, second.n_big]), ref.n_big)
        assert torch.equal(torch.cat([first.gap_esc, second.gap_esc]), ref.gap_esc)
        assert torch.equal(torch.cat([first.mag_esc, second.mag_esc]), ref.mag_esc)


@needs_kernels
def test_stream_encoder_on_triton_writes_the_same_file():
    """The codec with the Triton encoder, fed in passes, writes the file of the torch encoder fed at once."""
    batch = make_batch(6, [500, 3000, 20, 2500], [1000, 300_000, 64, 200_000])
    ref_codec = chunked.ChunkedCodec(chunk_elems=128, slice_elems=256, encode_backend="torch")
    tri_codec = chunked.ChunkedCodec(chunk_elems=128, slice_elems=256, encode_backend="triton")
    ref = ref_codec.prepare_batch(batch).pack()
    stream = tri_codec.stream(batch.starts)
    for a, b in [(0, 333), (333, 2000), (2000, 2001), (2001, batch.positions.numel())]:
        stream.add(batch.positions[a:b], batch.seg[a:b], batch.new[a:b], batch.old[a:b])
    got = stream.finish(batch.counts).pack()
    assert got.enc == ref.enc
    for key, _, _ in chunked.PAYLOAD_LAYOUT:  # every part, each chunk's first position included
        assert torch.equal(got.payload[key], ref.payload[key]), key


def test_encode_backend_is_checked():
    batch = make_batch(7, [10], [100])
    with pytest.raises(ValueError, match="planes backend"):
        chunked.encode_planes(batch, 128, 256, backend="cuda")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", [2, 4])
def test_triton_encoder_on_cuda(width):
    dev = torch.device("cuda")
    batch = make_batch(8, [200_000, 3, 1_500_000, 50_000], [20_000_000, 5, 150_000_000, 5_000_000], width, dev)
    ref = chunked.encode_planes(batch, chunked.CHUNK_ELEMS, chunked.SLICE_ELEMS, backend="torch")
    got = chunked.encode_planes(batch, chunked.CHUNK_ELEMS, chunked.SLICE_ELEMS, backend="triton")
    assert ref.gap_esc.numel() and ref.mag_esc.numel()
    assert_same_planes(got, ref)


def test_segment_ids_helper_matches_batches():
    """The test batches are what detection gives: tensor indices non-decreasing, positions rising within."""
    b = make_batch(9, [50, 60], [1000, 300_000])
    seg, pos = b.seg, b.positions
    assert bool((seg[1:] >= seg[:-1]).all())
    same = seg[1:] == seg[:-1]
    assert bool((pos[1:][same] > pos[:-1][same]).all())


@needs_kernels
def test_hash_kernel_is_the_checksum_definition():
    from vllm_delta.checksums import chunk_hashes

    g = torch.Generator().manual_seed(10)
    sizes = np.array([16, 0, 4096, 8, 65536 + 16, 48], dtype=np.int64)
    blob = torch.randint(0, 256, (int(sizes.sum()),), generator=g, dtype=torch.uint8)
    assert torch.equal(kernels.chunk_hashes(blob, sizes), chunk_hashes(blob, torch.from_numpy(sizes)))
    assert kernels.chunk_hashes(blob[:0], np.zeros(0, dtype=np.int64)).numel() == 0


@needs_kernels
def test_compact_frames_pads_with_zeros_and_drops_slot_garbage():
    g = torch.Generator().manual_seed(11)
    cap, got = 64, np.array([1, 64, 17, 32, 5], dtype=np.int64)
    slots = torch.randint(1, 256, (got.size * cap,), generator=g, dtype=torch.uint8)  # garbage everywhere
    padded = -(-got // 16) * 16
    out = kernels.compact_frames(slots, cap, got, padded)
    want = []
    for i, (n, p) in enumerate(zip(got, padded)):
        frame = slots[i * cap : i * cap + n]
        want += [frame, torch.zeros(int(p - n), dtype=torch.uint8)]
    assert torch.equal(out, torch.cat(want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hash_and_compact_kernels_on_cuda():
    from vllm_delta.checksums import chunk_hashes

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(12)
    sizes = np.random.default_rng(0).integers(0, 20_000, 3000) // 16 * 16
    blob = torch.randint(0, 256, (int(sizes.sum()),), generator=g, dtype=torch.uint8, device=dev)
    assert torch.equal(kernels.chunk_hashes(blob, sizes), chunk_hashes(blob, torch.from_numpy(sizes)))
    cap, got = 70_000, np.random.default_rng(1).integers(1, 70_000, 1500)
    slots = torch.randint(1, 256, (got.size * cap,), generator=g, dtype=torch.uint8, device=dev)
    padded = -(-got // 16) * 16
    out = kernels.compact_frames(slots, cap, got, padded)
    rows = slots.view(-1, cap).clone()
    col = torch.arange(cap, device=dev)
    rows.masked_fill_(col[None, :] >= torch.from_numpy(got).to(dev)[:, None], 0)
    assert torch.equal(out, rows[col[None, :] < torch.from_numpy(padded).to(dev)[:, None]])


def _decode_both(planes: chunked.Planes, batch: Batch, views: chunked.PlaneViews | None = None):
    """Decode a batch's planes with both backends; (torch's Decoded or error, Triton's)."""
    counts = np.array(batch.counts, dtype=np.int64)
    at = np.concatenate([[0], np.cumsum(counts)[:-1]])
    numels = np.array(batch.numels, dtype=np.int64)
    spans = chunked.Spans.of(at, counts, batch.starts, numels, np.arange(counts.size))
    out = []
    for backend in ("torch", "triton"):
        v = views if views is not None else chunked.plane_views(planes)
        try:
            out.append(chunked.decode_planes(v, 0, spans, chunked.Carry(), lambda i: {"tensor": f"t{i}"}, backend))
        except Exception as exc:  # noqa: BLE001 - compared below
            out.append(exc)
    return out


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_triton_decoder_is_the_torch_decoder(case):
    seed, counts, numels, width, chunk = case
    batch = make_batch(seed, counts, numels, width)
    planes = chunked.encode_planes(batch, chunk, 4 * chunk, backend="torch")
    ref, got = _decode_both(planes, batch)
    assert torch.equal(ref.positions, batch.positions)
    for name in ("positions", "diffs", "span"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.first == ref.first and np.array_equal(got.counts, ref.counts)


@needs_kernels
@pytest.mark.parametrize("fault", ["big", "gap_escapes", "mag_escapes", "mag_escape_value", "gap_escape_value"])
def test_triton_decoder_flags_what_the_torch_decoder_flags(fault):
    """A corrupt index count or escape table: both backends raise the same error (the Triton path's
    flag sends the run through torch's checks, which name the chunk)."""
    batch = make_batch(1, [300, 0, 5, 2000], [5000, 7, 9, 300_000])
    planes = chunked.encode_planes(batch, 128, 512, backend="torch")
    v = chunked.plane_views(planes)
    if fault == "big":
        v = v._replace(n_big=v.n_big.clone().index_add_(0, torch.tensor([3]), torch.tensor([1])))
    elif fault == "gap_escapes":
        k = int(planes.n_gap_esc.nonzero()[0])
        v = v._replace(n_gap_esc=v.n_gap_esc.clone().index_add_(0, torch.tensor([k]), torch.tensor([-1])))
    elif fault == "mag_escapes":
        k = int(planes.n_mag_esc.nonzero()[0])
        v = v._replace(n_mag_esc=v.n_mag_esc.clone().index_add_(0, torch.tensor([k]), torch.tensor([1])))
    elif fault == "mag_escape_value":
        v = v._replace(mag_esc=v.mag_esc.clone().index_fill_(0, torch.tensor([0]), 3))
    else:
        v = v._replace(gap_esc=v.gap_esc.clone().index_fill_(0, torch.tensor([0]), -5))
    ref, got = _decode_both(planes, batch, v)
    assert isinstance(ref, Exception) and type(got) is type(ref) and str(got) == str(ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_decoder_on_cuda():
    dev = torch.device("cuda")
    batch = make_batch(13, [200_000, 3, 1_500_000, 50_000], [20_000_000, 5, 150_000_000, 5_000_000], 2, dev)
    planes = chunked.encode_planes(batch, chunked.CHUNK_ELEMS, chunked.SLICE_ELEMS, backend="triton")
    ref, got = _decode_both(planes, batch)
    assert torch.equal(ref.positions, batch.positions)
    for name in ("positions", "diffs", "span"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
