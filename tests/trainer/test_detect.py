"""Flat-buffer change detection (detect.FlatSnapshot) and its Triton kernels, against torch.

CPU runs the kernels under TRITON_INTERPRET=1 (as `make test` does); the `gpu` cases run them on CUDA.
The batched codec prepare (`prepare_batch`) must give the same sections as `prepare` tensor by tensor.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_delta import codec as codecs
from vllm_delta.store import DeltaStore
from vllm_delta.trainer import kernels
from vllm_delta.trainer.detect import Detected, FlatSnapshot
from vllm_delta.trainer.options import DetectOptions, PublisherOptions
from vllm_delta.trainer.shard import Owned

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if name == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU only under TRITON_INTERPRET=1")
    if kernels.triton is None:
        pytest.skip("no Triton")
    return torch.device(name)


def special_floats(n: int, gen: torch.Generator) -> torch.Tensor:
    """Random float32 bit patterns plus NaNs (both signs, any payload), infinities, zeros, denormals
    and exact bf16 rounding ties."""
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    x[:50] = float("nan")
    x[50:60] = float("inf")
    x[60:70] = -float("inf")
    x[70:80] = 0.0
    x[80:90] = -0.0
    x[90:100] = torch.tensor(1e-40)
    ties = (torch.randint(0, 2**16, (500,), generator=gen, dtype=torch.int64) << 16) | 0x8000
    x[100:600] = ties.to(torch.int32).view(torch.float32)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_conversion_is_torchs(device, source):
    dev = _device(device)
    gen = torch.Generator().manual_seed(1)
    if source == torch.float32:
        x = special_floats(20000, gen)
    else:
        x = torch.randint(-(2**15), 2**15, (20000,), generator=gen, dtype=torch.int32).to(torch.int16).view(source)
    x = x.to(dev)
    want = x.to(torch.bfloat16).view(torch.int16)
    addr = kernels.ChunkAddressing([(x, 0, x.numel(), 0)], dev)
    got = kernels.gather_image(addr, torch.arange(x.numel(), device=dev))
    assert torch.equal(got, want)
    snap = want.clone()
    snap[::7] += 1
    mask = torch.empty(x.numel(), dtype=torch.int8, device=dev)
    kernels.mask_(addr, snap, mask)
    assert torch.equal(mask.bool(), snap != want)


def _owned(dev: torch.device, dtypes=(torch.float32,)) -> list[Owned]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(300, 7), (5,), (1000,), (), (64, 64), (3, 2)]
    out = []
    for i, shape in enumerate(shapes):
        t = (torch.randn(shape, generator=gen) * 0.02).to(dtypes[i % len(dtypes)]).to(dev)
        rows = shape[0] if shape else 1
        r0 = 1 if rows > 2 else 0  # some tensors are owned from a row offset (a shard)
        flat = t.reshape(-1)
        size = flat.numel() // rows if shape else 1
        out.append(Owned(f"t{i}", flat[r0 * size :], shape, r0, rows))
    return out


def _step(owned: list[Owned], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for o in owned:
        noise = torch.randn(o.source.shape, generator=gen).to(o.source.device) * 3e-5
        o.source.add_(noise.to(o.source.dtype))


@pytest.mark.slow  # the Triton kernels interpreted on the CPU: seconds each (make test-fast leaves it out)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16)], ids=["fp32", "mixed"])
@pytest.mark.parametrize("chunk_elems", [1000, 1 << 20])
def test_backends_detect_the_same_changes(device, dtypes, chunk_elems):
    dev = _device(device)
    owned = _owned(dev, dtypes)
    snaps = {b: FlatSnapshot(chunk_elems=chunk_elems, backend=b) for b in ("torch", "triton")}
    anchors = {b: s.anchor(owned) for b, s in snaps.items()}
    assert anchors["torch"].sums == anchors["triton"].sums
    for step in range(3):
        _step(owned, step)
        got = {b: s.changes(owned) for b, s in snaps.items()}
        a, b = got["torch"], got["triton"]
        assert sum(a.counts) > 0
        assert a.counts == b.counts and a.sums == b.sums
        for field in ("positions", "new", "old", "seg"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert torch.equal(snaps["torch"].bits, snaps["triton"].bits)
    # the snapshot holds exactly the current image
    image = torch.cat([o.source.to(torch.bfloat16).view(torch.int16).reshape(-1) for o in owned])
    assert torch.equal(snaps["triton"].bits, image)
    # positions are global: the owned rows' offset is added
    assert int(a.positions[a.seg == 0].min()) >= owned[0].start


def test_detection_checksums_match_the_definition():
    from vllm_delta.checksums import MASK64, positional_sum

    owned = _owned(torch.device("cpu"))
    snap = FlatSnapshot(chunk_elems=777, backend="torch")
    before = snap.anchor(owned).sums
    for o, s in zip(owned, before):
        assert s == positional_sum(o.source.to(torch.bfloat16), o.start)
    _step(owned, 5)
    found = snap.changes(owned)
    for o, s0, d in zip(owned, before, found.sums):
        assert (s0 + d) & MASK64 == positional_sum(o.source.to(torch.bfloat16), o.start)


@pytest.mark.parametrize("codec", ["compact", "raw"])
def test_prepare_batch_equals_prepare(codec):
    gen = torch.Generator().manual_seed(2)
    c = codecs.CompactCodec(frame_elems=50) if codec == "compact" else codecs.get_codec(codec)
    specs = [(1000, 120, 0), (70000, 3, 0), (500, 0, 0), (200000, 300, 100000), (10, 10, 0), (3_000_000, 2, 5)]
    pos_l, new_l, old_l, seg_l, items = [], [], [], [], []
    for t, (numel, n, start) in enumerate(specs):
        pos = torch.sort(torch.randperm(numel - start, generator=gen)[:n]).values + start
        old = torch.randint(-30000, 30000, (n,), generator=gen, dtype=torch.int32).to(torch.int16)
        new = old + torch.randint(-200, 200, (n,), generator=gen, dtype=torch.int32).to(torch.int16)
        new[::7] = torch.randint(-30000, 30000, (new[::7].numel(),), generator=gen, dtype=torch.int32).to(torch.int16)
        items.append((pos, new, old, numel, start))
        pos_l.append(pos)
        new_l.append(new)
        old_l.append(old)
        seg_l.append(torch.full((n,), t, dtype=torch.int64))
    batch = codecs.Batch(
        torch.cat(pos_l),
        torch.cat(new_l),
        torch.cat(old_l),
        torch.cat(seg_l),
        [s[1] for s in specs],
        [s[2] for s in specs],
        [s[0] for s in specs],
    )
    for (pos, new, old, numel, start), sec in zip(items, c.prepare_batch(batch).split()):
        if not pos.numel():
            assert sec is None
            continue
        want = c.pack(c.prepare(pos, new, old, numel, start), torch.bfloat16)
        got = c.pack(sec, torch.bfloat16)
        assert got[1] == want[1]
        assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])
        changes = codecs.decode(codec, got[0], got[1], numel=numel, nnz=pos.numel(), dtype=torch.bfloat16)
        assert torch.equal(changes.positions, pos) and torch.equal(changes.new_bits(old), new)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "triton-chunked", "torch"])
def test_publisher_on_cuda_replays_bit_exact(tmp_path, backend):
    """The whole publish path on a GPU (side stream, kernels, batched prepare, pinned copies)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from vllm_delta import Publisher, checksum, replay

    gen = torch.Generator(device="cuda").manual_seed(0)
    params = {
        f"w{i}": torch.randn(shape, generator=gen, device="cuda") * 0.02
        for i, shape in enumerate([(1000, 300), (77,), (4096, 129), ()])
    }
    params["w1"][:3] = float("nan")
    images = {}
    with Publisher(
        str(tmp_path / "s"),
        anchor_every=3,
        options=PublisherOptions(detect=DetectOptions(backend=backend, chunk_elems=100_000)),
    ) as pub:
        for v in range(5):
            if v:
                for t in params.values():
                    t.add_(torch.randn(t.shape, generator=gen, device="cuda") * 2e-5)
            info = pub.publish(params, version=v)
            images[v] = {n: t.to(torch.bfloat16).cpu() for n, t in params.items()}
            assert info.checksum == checksum(images[v])
    store = DeltaStore(str(tmp_path / "s"))
    for v, want in images.items():
        _, got = replay(store, v)
        assert all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want), v


# -- the bitmask path (kernels.bitmask_ / compact_, FlatSnapshot._changes_bitmask) ----------------------


def _tensors(dev: torch.device, sizes, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    """Separately allocated flat tensors of special floats (NaN, inf, ±0, denormals, ties)."""
    gen = torch.Generator().manual_seed(seed)
    pool = special_floats(max(sizes) + 600, gen)
    out = []
    for n in sizes:
        x = pool[torch.randperm(pool.numel(), generator=gen)[:n]]
        out.append(x.to(dtype).to(dev) if dtype != torch.float32 else x.to(dev))
    return out


def _move(tensors: list[torch.Tensor], density: float, seed: int) -> int:
    """Change the bf16 image of about `density` of the elements (plus sign flips of zeros, NaN payload
    changes, which keep the image, and ties); returns how many elements were written."""
    gen = torch.Generator().manual_seed(seed)
    written = 0
    for x in tensors:
        pick = torch.rand(x.numel(), generator=gen) < density
        idx = pick.nonzero().reshape(-1).to(x.device)
        if not idx.numel():
            continue
        v = x[idx].float()
        kind = torch.randint(0, 6, (idx.numel(),), generator=gen).to(x.device)
        v = torch.where(kind == 0, -v, v)  # ±0 flips, sign changes
        v = torch.where(kind == 1, v * 1.5 + 1e-3, v)
        v = torch.where(kind == 2, torch.full_like(v, float("nan")), v)
        v = torch.where(kind == 3, v + v.abs() * 2**-8, v)  # one bf16 ULP or a tie
        v = torch.where(kind == 4, torch.full_like(v, float("inf")), v)
        x[idx] = v.to(x.dtype)
        written += idx.numel()
    return written


def _as_owned(tensors: list[torch.Tensor], starts=None) -> list[Owned]:
    out = []
    for i, x in enumerate(tensors):
        r0 = 0 if starts is None else starts[i]
        out.append(Owned(f"t{i}", x, (r0 + x.numel(),), r0, r0 + x.numel()))
    return out


def _compare(owned: list[Owned], snaps: dict[str, FlatSnapshot]) -> Detected:
    """Every snapshot's `changes` equals the "torch" one's, bit for bit (int16 bit views, int64
    positions); the snapshots end equal; the bitmask path ran where expected. Returns torch's."""
    got = {b: s.changes(owned) for b, s in snaps.items()}
    ref = got.pop("torch")
    for b, g in got.items():
        assert g.counts == ref.counts and g.sums == ref.sums, b
        for field in ("positions", "new", "old", "seg"):
            assert getattr(g, field).dtype == getattr(ref, field).dtype, (b, field)
            assert torch.equal(getattr(g, field), getattr(ref, field)), (b, field)
        assert torch.equal(snaps[b].bits, snaps["torch"].bits), b
        assert ("words" in snaps[b]._scratch) == snaps[b].bitmask, b  # the path under test ran
    return ref


@pytest.mark.parametrize("device", DEVICES)
def test_bitmask_kernel_words_and_counts(device):
    dev = _device(device)
    xs = _tensors(dev, [200, 0, 64, 33, 1000])
    snap = torch.cat([x.to(torch.bfloat16).view(torch.int16) for x in xs])
    gen = torch.Generator().manual_seed(3)
    flip = (torch.rand(snap.numel(), generator=gen) < 0.3).to(dev)
    snap = torch.where(flip, snap ^ 1, snap)
    offs = [0]
    for x in xs:
        offs.append(offs[-1] + x.numel())
    table = kernels.DetectTable([(x, offs[i], x.numel(), 5) for i, x in enumerate(xs)], dev, block=64)
    assert table.ok and table.n_blocks == 4 + 0 + 1 + 1 + 16
    words = torch.full((table.n_blocks * 2,), -7, dtype=torch.int32, device=dev)  # poisoned
    counts = torch.full((table.n_blocks,), -7, dtype=torch.int32, device=dev)
    kernels.bitmask_(table, 0, table.n_blocks, snap, words, counts)
    # the reference: per block, its flags padded to 64, packed 32 to a word (bit j = element 32k + j)
    want_words, want_counts = [], []
    for i, x in enumerate(xs):
        f = flip[offs[i] : offs[i + 1]].cpu()
        for a in range(0, x.numel(), 64):
            blk = torch.zeros(64, dtype=torch.int64)
            blk[: min(64, x.numel() - a)] = f[a : a + 64].long()
            w = (blk.view(2, 32) << torch.arange(32)).sum(1)
            want_words += [int(v) - (1 << 32) if v >= 1 << 31 else int(v) for v in w]
            want_counts.append(int(blk.sum()))
    assert words.cpu().tolist() == want_words
    assert counts.cpu().tolist() == want_counts
    assert table.first.cpu().tolist() == [0, 4, 4, 5, 6, 22]


@pytest.mark.slow  # the Triton kernels interpreted on the CPU: seconds each (make test-fast leaves it out)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.01, 0.5, 1.0])
def test_bitmask_path_equals_torch(device, density, monkeypatch):
    """Uneven tensors (empty ones, sizes not multiples of 32 or of the block), two publishes in a row;
    the passes and chunks end inside tensors."""
    dev = _device(device)
    monkeypatch.setattr(kernels, "DETECT_BLOCK", 256)
    sizes = [1000, 0, 31, 256, 4096, 1, 513, 0, 2000]
    xs = _tensors(dev, sizes, seed=int(density * 1000))
    owned = _as_owned(xs, starts=[0, 0, 7, 0, 0, 3, 0, 0, 100])
    snaps = {
        "torch": FlatSnapshot(backend="torch", chunk_elems=1500),
        "triton": FlatSnapshot(backend="triton"),
        "split": FlatSnapshot(backend="triton", fused=False, pass_elems=1000),  # 4-block passes, 2 launches
        "chunked": FlatSnapshot(backend="triton-chunked", chunk_elems=1500),  # the int8-mask path
    }
    for s in snaps.values():
        s.anchor(owned)
    assert snaps["triton"]._detect_table(owned, dev).aligned is False  # odd sizes: unaligned flat offsets
    for step in range(2):
        n = _move(xs, density, seed=10 * step + 1)
        found = sum(_compare(owned, snaps).counts)
        assert found <= n
        if density >= 0.5:
            assert found > n // 3
    image = torch.cat([x.to(torch.bfloat16).view(torch.int16) for x in xs])
    assert torch.equal(snaps["triton"].bits, image)


@pytest.mark.slow  # the Triton kernels interpreted on the CPU: seconds each (make test-fast leaves it out)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
def test_bitmask_path_aligned_blocks(device, source, monkeypatch):
    """Sizes that are multiples of 16 and separately allocated sources: the 16-byte-load variant,
    full and partial blocks, several passes."""
    dev = _device(device)
    monkeypatch.setattr(kernels, "DETECT_BLOCK", 512)
    xs = _tensors(dev, [1024, 16, 512 + 48, 512, 0, 2048 + 16], dtype=source, seed=4)
    owned = _as_owned(xs)
    snaps = {
        "torch": FlatSnapshot(backend="torch"),
        "triton": FlatSnapshot(backend="triton"),
        "passes": FlatSnapshot(backend="triton", pass_elems=1024),
    }
    for s in snaps.values():
        s.anchor(owned)
    table = snaps["triton"]._detect_table(owned, dev)
    assert table.ok and table.aligned
    for step, density in enumerate([0.01, 0.3, 0.0, 1.0]):
        _move(xs, density, seed=step)
        _compare(owned, snaps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32])
def test_bitmask_path_edge_bits(device, source, monkeypatch):
    """Every element changes (the snapshot's low bit flipped), then NaN payloads of both signs, ±0
    and infinities written over random bit patterns: the positions and bits the image gives, exactly."""
    dev = _device(device)
    monkeypatch.setattr(kernels, "DETECT_BLOCK", 64)
    gen = torch.Generator().manual_seed(7)
    sizes = [130, 64, 1, 0, 97]
    width = 16 if source != torch.float32 else 32
    xs = []
    for n in sizes:  # random bit patterns of the source dtype: many NaNs with payloads, denormals, ±0
        bits = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1) - 1, (n,), generator=gen, dtype=torch.int64)
        int_dtype = torch.int16 if width == 16 else torch.int32
        xs.append(bits.to(int_dtype).view(source).to(dev))
    owned = _as_owned(xs, starts=[0, 3, 0, 0, 11])
    snaps = {
        "torch": FlatSnapshot(backend="torch", chunk_elems=100),
        "triton": FlatSnapshot(backend="triton"),
        "chunked": FlatSnapshot(backend="triton-chunked", chunk_elems=100),
    }
    for s in snaps.values():
        s.anchor(owned)
    image = torch.cat([x.to(torch.bfloat16).view(torch.int16) for x in xs])
    for s in snaps.values():
        assert s.bits is not None
        s.bits.bitwise_xor_(1)
    found = _compare(owned, snaps)  # all change
    assert sum(found.counts) == sum(sizes) and torch.equal(found.new, image) and torch.equal(found.old, image ^ 1)
    assert torch.equal(snaps["triton"].bits, image)
    assert sum(_compare(owned, snaps).counts) == 0  # no change

    # NaNs with payloads (both signs), ±0, ±inf (bf16: 0x7F80, 0xFF80; fp16: 0x7C00, 0xFC00), ±denormals
    specials = [0x7FC1, 0x7F81, 0x7FFF, -0x0001, -0x007F, 0x0000, -0x8000, 0x7F80, -0x0080, 0x7C00, -0x0400, 1, -0x7FFF]
    if width == 16:
        pool = torch.tensor(specials, dtype=torch.int16).view(source)
    else:  # the same high halves with a low half: NaN payloads, rounding; then exact ±0 and ±inf
        pool = (torch.tensor(specials, dtype=torch.int32) << 16 | 0x1234).view(torch.float32)
        pool = torch.cat([pool, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    offsets = torch.tensor([0, *sizes], device=dev).cumsum(0)[:-1]
    starts = torch.tensor([o.start for o in owned], device=dev)
    for step in range(2):
        for x in xs:
            pick = (torch.rand(x.numel(), generator=gen) < 0.4).nonzero().reshape(-1)
            vals = pool[torch.randint(0, pool.numel(), (pick.numel(),), generator=gen)]
            x[pick.to(dev)] = vals.to(dev)
        new_image = torch.cat([x.to(torch.bfloat16).view(torch.int16) for x in xs])
        want = (new_image != image).nonzero().reshape(-1)
        found = _compare(owned, snaps)
        assert torch.equal(offsets[found.seg] + found.positions - starts[found.seg], want), step
        assert torch.equal(found.new, new_image[want]) and torch.equal(found.old, image[want]), step
        assert torch.equal(snaps["triton"].bits, new_image), step
        image = new_image


def test_backend_names(monkeypatch):
    monkeypatch.delenv("VLLM_DELTA_DETECT_BACKEND", raising=False)
    assert FlatSnapshot(backend="triton").bitmask and FlatSnapshot().bitmask
    chunked = FlatSnapshot(backend="triton-chunked")
    assert chunked.backend == "triton" and not chunked.bitmask
    monkeypatch.setenv("VLLM_DELTA_DETECT_BACKEND", "triton-chunked")
    assert not FlatSnapshot().bitmask
    with pytest.raises(ValueError, match="triton-chunked"):
        FlatSnapshot(backend="cuda")
    # the kernels make bf16 images only: fp16 images take the torch path (by default) or are refused
    monkeypatch.delenv("VLLM_DELTA_DETECT_BACKEND")
    assert not FlatSnapshot(torch.float16)._use_triton(torch.device("cuda"))
    if kernels.triton is not None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(ValueError, match="bf16 images only"):
            FlatSnapshot(torch.float16, backend="triton")._use_triton(torch.device("cpu"))


@pytest.mark.slow  # the Triton kernels interpreted on the CPU: seconds each (make test-fast leaves it out)
def test_publisher_backends_publish_the_same_versions(tmp_path):
    """The Publisher on CPU (kernels interpreted): the bitmask path, the chunked path and torch publish
    the same versions (kinds, change counts, checksums, replayed bits)."""
    _device("cpu")
    from vllm_delta import Publisher, replay

    gen = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(s, generator=gen) * 0.02 for i, s in enumerate([(40, 30), (7,), (129, 5), ()])}
    params["w1"][:3] = float("nan")
    seen: dict[str, list] = {}
    for backend in ("torch", "triton", "triton-chunked"):
        ps = {n: t.clone() for n, t in params.items()}
        g = torch.Generator().manual_seed(1)
        root = str(tmp_path / backend)
        with Publisher(
            root, anchor_every=3, options=PublisherOptions(detect=DetectOptions(backend=backend, chunk_elems=1000))
        ) as pub:
            assert pub.snapshot.bitmask is (backend != "triton-chunked")  # "torch" never runs the kernels
            infos = []
            for v in range(4):
                for t in ps.values():
                    t.add_(torch.randn(t.shape, generator=g) * 2e-5)
                infos.append(pub.publish(ps, version=v))
            assert ("words" in pub.snapshot._scratch) is (backend == "triton")  # the bitmask path ran
        store = DeltaStore(root)
        images = [{n: t.view(torch.int16) for n, t in replay(store, v)[1].items()} for v in range(4)]
        seen[backend] = [[(i.kind, i.base, i.nnz, i.checksum) for i in infos], images]
    want_infos, want_images = seen.pop("torch")
    assert [k for k, *_ in want_infos] == ["anchor", "delta", "delta", "anchor"] and want_infos[1][2] > 0
    for backend, (infos, images) in seen.items():
        assert infos == want_infos, backend
        for v, (got, want) in enumerate(zip(images, want_images)):
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), (backend, v)


@pytest.mark.slow  # the Triton kernels interpreted on the CPU: seconds each (make test-fast leaves it out)
@pytest.mark.parametrize("device", DEVICES)
def test_bitmask_path_default_block_and_shards(device):
    """The default block on the sharded fixture (row offsets, a 0-d tensor), as the Publisher calls it."""
    dev = _device(device)
    owned = _owned(dev)
    snaps = {"torch": FlatSnapshot(backend="torch"), "triton": FlatSnapshot(backend="triton")}
    for s in snaps.values():
        s.anchor(owned)
    for step in range(2):
        _step(owned, step)
        assert sum(_compare(owned, snaps).counts) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.01, 0.3])
@pytest.mark.parametrize("fused", [True, False])
def test_bitmask_path_large_on_cuda(density, fused):
    """Millions of elements in the default block (many full blocks, aligned and not) on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = [(4096, 1024), (4096,), (1024, 4096), (151, 4096), (12288, 512)]
    xs = [torch.randn(s, generator=gen, device=dev).mul_(0.02).reshape(-1) for s in shapes]
    odd = torch.randn(3_000_001, generator=gen, device=dev)[1:]  # a view 4 bytes off: unaligned
    for case in (xs, [*xs, odd]):
        owned = _as_owned(case)
        snaps = {"torch": FlatSnapshot(backend="torch"), "triton": FlatSnapshot(backend="triton", fused=fused)}
        for s in snaps.values():
            s.anchor(owned)
        assert snaps["triton"]._detect_table(owned, dev).aligned is (case is xs)
        for _ in range(3):
            for x in case:
                pick = torch.rand(x.numel(), generator=gen, device=dev) < density
                x.add_(torch.where(pick, x.abs() * 2**-7 + 1e-6, torch.zeros_like(x)))
            assert sum(_compare(owned, snaps).counts) > 0


@pytest.mark.slow  # the Triton kernels interpreted on the CPU: seconds each (make test-fast leaves it out)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["bitmask", "chunked"])
def test_changes_handed_on_pass_by_pass_make_the_same_file(device, path, monkeypatch):
    """`changes(consume=...)` (the Publisher with the chunked codec): the passes' changes, encoded as
    they come, give the same file as the changes all at once; the counts and sums are the same; and
    the device never holds more than one pass's changes."""

    dev = _device(device)
    monkeypatch.setattr(kernels, "DETECT_BLOCK", 256)
    sizes = [1000, 0, 31, 256, 4096, 1, 513, 0, 2000]
    xs = _tensors(dev, sizes, seed=3)
    owned = _as_owned(xs, starts=[0, 0, 7, 0, 0, 3, 0, 0, 100])
    backend = "triton" if path == "bitmask" else "triton-chunked"
    # 4 blocks a pass when handed on: many passes
    snaps = {k: FlatSnapshot(backend=backend, chunk_elems=1500, stream_pass_elems=1024) for k in ("stream", "whole")}
    for s in snaps.values():
        s.anchor(owned)
    c = codecs.ChunkedCodec(chunk_elems=128, slice_elems=256)
    for step in range(2):
        _move(xs, 0.3, seed=step + 5)
        seen: list[int] = []
        enc = c.stream([o.start for o in owned])

        def consume(pos, seg, new, old, enc=enc, seen=seen):
            seen.append(int(pos.numel()))
            enc.add(pos, seg, new, old)

        streamed = snaps["stream"].changes(owned, consume=consume)
        whole = snaps["whole"].changes(owned)
        assert streamed.positions.numel() == 0 and streamed.counts == whole.counts and streamed.sums == whole.sums
        assert (len(seen) > 2) if path == "bitmask" else (len(seen) == 1)
        assert sum(seen) == sum(whole.counts)
        batch = codecs.Batch(
            whole.positions, whole.new, whole.old, whole.seg, whole.counts, [o.start for o in owned], [0] * len(owned)
        )
        want = c.pack_file([(str(t), s) for t, s in enumerate(c.prepare_batch(batch).split()) if s is not None])
        got = c.pack_file([(str(t), s) for t, s in enumerate(enc.finish(streamed.counts).split()) if s is not None])
        assert got.tensor_enc == want.tensor_enc
        assert all(torch.equal(got.payload[k], want.payload[k]) for k in want.payload)
