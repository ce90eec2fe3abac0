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
from vllm_delta.trainer.detect import FlatSnapshot
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
@pytest.mark.parametrize("backend", ["triton", "torch"])
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
    with Publisher(str(tmp_path / "s"), detect_backend=backend, chunk_elems=100_000, anchor_every=3) as pub:
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
