"""The upload of a format-5 delta (issue 35: versions built from arrays): the same version as format 4,
byte for byte in its payload and field for field in its table, with no `PreparedTensor`, `Sections` or
per-tensor dict made on the way."""

from __future__ import annotations

import torch
from safetensors import safe_open

import vllm_delta
from vllm_delta import Publisher, replay
from vllm_delta.codec import base as codec_base
from vllm_delta.codec.chunked.blocks import RANK_BLOCKS
from vllm_delta.codec.chunked.regions import has_blocks
from vllm_delta.format import ARRAYS_FORMAT_VERSION, COLUMNS_FORMAT_VERSION
from vllm_delta.store import DeltaStore
from vllm_delta.trainer.options import PublisherOptions, UploadOptions


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    shapes = {f"model.layers.{i // 8}.mlp.experts.{i % 8}.up_proj.weight": (16, 8) for i in range(40)}
    shapes |= {"model.norm.weight": (8,), "scale": (), "model.embed_tokens.weight": (64, 8)}
    return {n: torch.randn(s, generator=gen) * 0.05 for n, s in shapes.items()}


def _publish(root: str, header_format: int, steps: int = 3, **upload) -> tuple[DeltaStore, list[int]]:
    weights = _weights()
    gen = torch.Generator().manual_seed(7)
    versions = []
    options = PublisherOptions(upload=UploadOptions(header_format=header_format, **upload))
    with Publisher(root, anchor_every=100, options=options) as pub:
        for step in range(steps + 1):
            if step:
                for t in weights.values():
                    hit = torch.rand(t.shape, generator=gen) < 0.2
                    t.add_(hit * 1e-2 * torch.randn(t.shape, generator=gen))
            versions.append(pub.publish(weights).version)
    return DeltaStore(root), versions


def test_format_5_writes_the_version_format_4_does(tmp_path):
    """Without rank blocks, byte for byte in the payload (with them: the next test)."""
    five, versions = _publish(str(tmp_path / "f5"), 5, rank_blocks=0)
    four, _ = _publish(str(tmp_path / "f4"), 4)
    for v in versions[1:]:
        with five.open(v) as a, four.open(v) as b:
            assert (a.header.format_version, b.header.format_version) == (ARRAYS_FORMAT_VERSION, COLUMNS_FORMAT_VERSION)
            assert a.header.checksum == b.header.checksum and a.header.enc == b.header.enc
            assert dict(a.header.tensors.items()) == dict(b.header.tensors.items())
        (pa,), (pb,) = five.local_paths(v), four.local_paths(v)
        with safe_open(pa, "pt") as fa, safe_open(pb, "pt") as fb:
            assert sorted(fa.keys()) == sorted(fb.keys())
            assert all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())
    _, got = replay(five, versions[-1])
    _, want = replay(four, versions[-1])
    assert vllm_delta.checksum(got) == vllm_delta.checksum(want) == five.record(versions[-1]).checksum


def test_rank_blocks_are_opt_in_and_replay_to_the_same_weights(tmp_path):
    """`UploadOptions(rank_blocks=8)` lays each version out by rank blocks (the file says so); the default
    writes one stream. Both replay to the publisher's checksum at every version."""
    plain, versions = _publish(str(tmp_path / "plain"), 5)
    blocks, _ = _publish(str(tmp_path / "blocks"), 5, rank_blocks=RANK_BLOCKS)
    for v in versions[1:]:
        with plain.open(v) as a, blocks.open(v) as b:
            assert not has_blocks(a.header.enc) and has_blocks(b.header.enc), (a.header.enc, b.header.enc)
            assert a.header.checksum == b.header.checksum
        for store in (plain, blocks):
            _, got = replay(store, v)
            assert vllm_delta.checksum(got) == store.record(v).checksum == plain.record(v).checksum


def test_a_format_5_upload_makes_no_object_per_tensor(tmp_path, monkeypatch):
    """Counted on the upload thread's path: `Sections` (the codec's per-tensor host form) and
    `PreparedTensor` (the writer's) are never made for a format-5 delta; format 4 makes one of each per
    tensor."""
    from vllm_delta import writer

    made = {"sections": 0, "prepared": 0}
    real_sections, real_prepared = codec_base.Sections.__init__, writer.PreparedTensor.__init__

    def sections(self, *a, **k):
        made["sections"] += 1
        real_sections(self, *a, **k)

    def prepared(self, *a, **k):
        made["prepared"] += 1
        real_prepared(self, *a, **k)

    monkeypatch.setattr(codec_base.Sections, "__init__", sections)
    monkeypatch.setattr(writer.PreparedTensor, "__init__", prepared)
    _publish(str(tmp_path / "f5"), 5)
    assert made == {"sections": 0, "prepared": 0}
    _publish(str(tmp_path / "f4"), 4, steps=1)
    assert made["prepared"] >= len(_weights()) and made["sections"] > 0


class _StandInCompress:
    """nvCOMP's compression stood in for by zstandard (no GPU here): what `gpu.compress_frames` calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def compress(self, buf, offsets, sizes):
        import numpy as np
        import zstandard

        self.calls.append(len(sizes))
        frames = [zstandard.ZstdCompressor().compress(buf[a : a + n].numpy().tobytes()) for a, n in zip(offsets, sizes)]
        cap = -(-max(map(len, frames)) // 16) * 16
        slots = torch.zeros(len(frames) * cap, dtype=torch.uint8)
        for i, f in enumerate(frames):
            slots[i * cap : i * cap + len(f)] = torch.frombuffer(bytearray(f), dtype=torch.uint8)
        return slots, cap, np.array([len(f) for f in frames], dtype=np.int64)


def test_gpu_encode_frames_bounds_each_compression_call_and_writes_the_same_bytes():
    """`UploadOptions(gpu_encode_frames=N)`: at most N frames per compression call (each call's output
    slots and nvCOMP's temporary space are what the publish holds beyond the planes), the same
    compressed bytes as one call of every frame."""
    import numpy as np

    from vllm_delta.codec.chunked import gpu

    gen = torch.Generator().manual_seed(0)
    buf = (torch.rand(10 * 4096, generator=gen) < 0.1).to(torch.uint8)
    offsets, sizes = np.arange(10, dtype=np.int64) * 4096, np.full(10, 4096, dtype=np.int64)
    whole, bounded = _StandInCompress(), _StandInCompress()
    blob, got = gpu.compress_frames(whole, buf, offsets, sizes)
    blob3, got3 = gpu.compress_frames(bounded, buf, offsets, sizes, per_call=3)
    assert whole.calls == [10] and bounded.calls == [3, 3, 3, 1]
    assert torch.equal(blob, blob3) and np.array_equal(got, got3)


def test_gpu_encode_frames_is_this_publisher_s_own(tmp_path):
    """The option sets the frames on this Publisher's copy of the codec (the registry's instance is the
    process's), refuses a codec that does not encode on the GPU, and a bad value fails where it is built."""
    import pytest

    from vllm_delta.codec import get_codec

    options = PublisherOptions(upload=UploadOptions(gpu_encode_frames=512))
    with Publisher(str(tmp_path / "a"), options=options) as pub:
        assert pub.codec.encode_frames == 512 and get_codec("chunked").encode_frames is None
    with pytest.raises(ValueError, match="gpu_encode_frames"):
        Publisher(str(tmp_path / "b"), codec="compact", options=options)
    assert not (tmp_path / "b").exists()  # refused before anything is created
    with pytest.raises(ValueError, match="gpu_encode_frames"):
        UploadOptions(gpu_encode_frames=0)


def test_a_table_from_an_array_of_sums_equals_the_one_from_a_mapping():
    """The Publisher hands the format-5 table its whole-tensor checksums as a uint64 array in the tensor
    set's order (no dict per version); a mapping gives the same table, and an array of another length is
    refused."""
    import numpy as np
    import pytest

    from vllm_delta.writer import TableTemplate

    shapes = {"a": (4, 3), "b": (5,), "c": (2, 2)}
    template = TableTemplate.of(shapes, torch.bfloat16, [("a", 0, 4), ("c", 0, 2)])
    sums = {"a": (1 << 64) - 3, "b": 7, "c": 1 << 63}
    at, start = np.array([0, 1], dtype=np.int64), np.array([0, 12], dtype=np.int64)
    from_map = template.table(sums, [3, 1], at, start)
    from_array = template.table(np.array(list(sums.values()), dtype=np.uint64), [3, 1], at, start)
    assert from_map.checksums == from_array.checksums and from_map.nnz == from_array.nnz
    assert from_map.checksums[0] == f"{(1 << 64) - 3:016x}"
    with pytest.raises(ValueError, match="not one per tensor"):
        template.table(np.zeros(2, dtype=np.uint64), [3, 1], at, start)
