"""Staging a multi-part mixture-of-experts version reads the device back a fixed number of times, not
once per decoded chunk (issue 35 item 2), bit-exact.

On a GPU every read of a device value by the host (`bool(t)`, `.item()`, `.tolist()`, `.cpu()`,
`nonzero`, `unique`, ...) waits for the device's queue to drain: a wait per decoded chunk keeps the host
from queueing the next chunk's work while the device runs. The chunked decoder folds every check of a
sub-run into a device flag and reads all the flags once, at the end (`_Sequence.finish`); a fused plan of
whole tensors takes its runs from the host. On the CPU those reads are counted (a TorchFunctionMode),
and staging the same version in 4x the device chunks must read the same number of times. The decoder's
GPU path runs here with nvCOMP stood in for by zstandard (test_staging._StandInZstd).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_rank_share import MOE, _assert_holds, _engine, _version
from test_staging import _StandInZstd
from torch.overrides import TorchFunctionMode

from vllm_delta.codec.chunked import decode as chunked_decode
from vllm_delta.codec.chunked import decoder, gpu
from vllm_delta.errors import CodecError

# what makes the host wait for a GPU's queue (.numpy() is left out: on a GPU it is not allowed, and the
# host buffers staging reads through it are host memory there)
READS = frozenset(
    {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "nonzero", "argwhere"}
    | {"unique", "unique_consecutive", "masked_select", "bincount"}
)


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.mark.parametrize("path", ["cpu", "gpu-path"])
def test_staging_reads_the_device_a_fixed_number_of_times(tmp_path, monkeypatch, path):
    """A 3-part MoE version at TP=1 staged in device chunks of 256 and of 1024 changed elements (the
    file's chunks hold 128): 4x the decoded sub-runs, the same number of host reads; the writes are
    bit-exact either way. The engine writes through fused plans, as on a GPU (the Triton scatter,
    interpreted: the torch backend's unfused gather reads per chunk, by design, on the CPU only)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("fused plans on the CPU run the Triton kernels under TRITON_INTERPRET=1 only")
    if path == "gpu-path":
        monkeypatch.setattr(gpu, "backend", lambda device: (_StandInZstd(), ""))
    old, new, _, vf = _version(tmp_path, MOE, 3)
    subruns: list[int] = []
    real = chunked_decode.decode_planes

    def counted(*a, **k):
        subruns.append(1)
        return real(*a, **k)

    monkeypatch.setattr(decoder, "decode_planes", counted)
    reads, runs = {}, {}
    for chunk_elems in (1024, 256):
        engine = _engine(MOE, 1, 0, old, chunk_elems=chunk_elems, backend="triton")
        subruns.clear()
        with HostReads() as mode:
            staged = engine.stage([vf])
        reads[chunk_elems], runs[chunk_elems] = mode.calls, len(subruns)
        assert staged.decoded == vf.header.nnz
        engine.patch(staged)
        _assert_holds(engine, MOE, 1, 0, new)
        engine.close()
    assert runs[256] >= 3 * runs[1024] > 0, runs
    assert reads[256] == reads[1024], reads  # nothing read back per sub-run
    assert sum(reads[256].values()) <= 16, reads


def test_a_deferred_check_still_names_the_chunk_and_writes_nothing(tmp_path, monkeypatch):
    """A sub-run whose checks fail is found when the flags are read (after every unit), decoded again
    from its bytes checking as it goes, and raises the error naming it; nothing is staged."""
    old, _, _, vf = _version(tmp_path, MOE, 3)
    real = chunked_decode._decode
    calls = {"n": 0}

    def corrupt_third(v, elem0, spans, carry, check, backend):
        calls["n"] += 1
        if calls["n"] == 3 and not check.eager:  # the third sub-run: a position past its tensor
            out, checks = real(v, elem0, spans, carry, check, backend)
            check.flag = torch.ones((), dtype=torch.bool)
            return out, checks
        return real(v, elem0, spans, carry, check, backend)

    monkeypatch.setattr(chunked_decode, "_decode", corrupt_third)
    named = []

    def recheck(v, elem0, spans, carry, ctx_of):
        named.append(elem0)
        raise CodecError("named", version=1, tensor="t")

    monkeypatch.setattr(decoder, "recheck", recheck)
    engine = _engine(MOE, 1, 0, old, chunk_elems=256)
    before = [t.clone() for t in engine.targets]
    with pytest.raises(CodecError, match="named"):
        engine.stage([vf])
    assert len(named) == 1 and calls["n"] > 3  # later sub-runs were decoded before the flags were read
    assert all(torch.equal(a, b) for a, b in zip(before, engine.targets))
    engine.close()


def test_a_tp2_rank_stages_a_rank_block_file_without_a_wait_per_chunk(tmp_path, monkeypatch):
    """At TP=2 the tensors split over the ranks take a mask per chunk (a device-to-host wait each) unless
    the decoder knows every element of a run lies in the rank's share: a file laid out by rank blocks
    tells it (Runs.held). Staged in 4x the device chunks, a rank's host reads stay the same with rank
    blocks (and grow without them); the writes are bit-exact either way."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("fused plans on the CPU run the Triton kernels under TRITON_INTERPRET=1 only")
    from test_rank_blocks import _versions

    from vllm_delta.testing.apply_fixtures import Qwen3Spec

    spec = Qwen3Spec("waits", 256, 2, 4, 4, 64, 512, 512, False)  # 4 KV heads, a vocabulary that splits by 8
    old, new, _, vfs = _versions(tmp_path, spec, 1)
    reads: dict[str, dict[int, int]] = {"blocks": {}, "plain": {}}
    for kind, vf in vfs.items():
        for chunk_elems in (1024, 256):
            engine = _engine(spec, 2, 1, old, chunk_elems=chunk_elems, backend="triton")
            with HostReads() as mode:
                staged = engine.stage([vf])
            reads[kind][chunk_elems] = mode.total
            engine.patch(staged)
            _assert_holds(engine, spec, 2, 1, new)
            engine.close()
    assert reads["blocks"][256] == reads["blocks"][1024], reads
    assert reads["plain"][256] > reads["plain"][1024], reads
