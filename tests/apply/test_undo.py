"""Backward updates in the apply engine (issue 36): a delta's file read backwards (old = new - d) takes the
live weights to an older version, bit-exact against the trainer's images, staged and verified like any
update; what cannot be undone (an anchor, a codec that stores new values, a broken chain) is refused
before anything is read, and nothing changes. No vLLM: plain tensors and real version files."""

from __future__ import annotations

import pytest
import torch
from apply_cases import cases, need
from test_engine import World, _equal, _sums_move

from vllm_delta.bits import bit_view, wrap_add, wrap_sub
from vllm_delta.checksums import verify_partials
from vllm_delta.errors import ChecksumMismatchError, NotSuccessorError
from vllm_delta.format import VersionFile
from vllm_delta.testing.apply_fixtures import hf_view, reference_apply, write_anchor


def _images_equal(w: World, version: int) -> None:
    """The live weights are the trainer's image of `version`, bit for bit: every target equals version 0's
    targets with the changes of versions 1..`version` written through the layout (what the engine holds
    of each HF tensor: a column box, a row shard, tied copies), and every HF tensor the layout holds
    whole reads back as the trainer's."""
    want = [t.clone() for t in w.at_zero]
    for changes in w.changes[1 : version + 1]:
        reference_apply(want, w.layout, changes)
    assert _equal(w.bits(), [bit_view(t) for t in want]), f"not version {version}"
    if w.owned:
        for name in w.layout.hf_shapes:
            assert torch.equal(bit_view(hf_view(w.layout, w.targets, name)), bit_view(w.hf[version][name])), name


def _published(w: World, tmp_path, codecs: dict[int, str]) -> dict[int, VersionFile]:
    """Versions 1.. as delta files (each coded with `codecs[v]`), the engine's targets still at version 0."""
    w.at_zero = [t.clone() for t in w.targets]
    files = {}
    for v, codec in codecs.items():
        w.step(density=0.15, seed=v)
        w.write(tmp_path / f"v{v}.safetensors", v, codec, frame_elems=31)
        files[v] = VersionFile(tmp_path / f"v{v}.safetensors")
    return files


def test_wrap_sub_undoes_wrap_add():
    gen = torch.Generator().manual_seed(0)
    for width, dtype in ((2, torch.int16), (4, torch.int32)):
        info = torch.iinfo(dtype)
        bits = torch.randint(info.min, info.max, (5000,), generator=gen, dtype=torch.int64).to(dtype)
        edges = torch.tensor([info.min, info.max, -1, 0, 1], dtype=dtype)
        bits = torch.cat([bits, edges, edges])
        diffs = torch.randint(-(1 << 20), 1 << 20, (bits.numel(),), generator=gen, dtype=torch.int64)
        diffs[-10:] = torch.tensor([1, -1, info.min, info.max, -(1 << 15)] * 2)
        assert torch.equal(wrap_sub(wrap_add(bits, diffs, width), diffs, width), bits)


@pytest.mark.parametrize("device,backend", cases())
@pytest.mark.parametrize("scenario", ["qwen3", "shards"])
def test_five_to_three_to_five_is_bit_exact(tmp_path, device, backend, scenario):
    """5 -> 3 (two deltas undone, merged in one update) -> 5 again, and 5 -> 4 (one delta: the engine's
    single-file path): every step's live weights are the trainer's image of that version, every step's
    partials verify against that version's header, and a backward update rolls back like any other."""
    need(device, backend)
    w = World(scenario, device)
    files = _published(w, tmp_path, {1: "chunked", 2: "compact", 3: "chunked", 4: "compact", 5: "chunked"})
    eng = w.engine(backend, block=64, chunk_elems=150)
    eng.patch(eng.stage([files[v] for v in range(1, 6)]))
    _images_equal(w, 5)
    at_five, sums5 = w.bits(), eng.live_sums()

    back = eng.stage([files[5], files[4]], back_to=files[3].header)
    assert _equal(w.bits(), at_five), "staging wrote to the targets"
    assert (back.undo, back.versions, back.version, back.header.version) == (True, [5, 4], 3, 3)
    if w.owned:
        verify_partials(sums5, [back.partials], files[3].header)
        with pytest.raises(ChecksumMismatchError):  # the partials lead to 3, not to 4
            verify_partials(sums5, [back.partials], files[4].header)
    eng.patch(back)
    _images_equal(w, 3)
    _sums_move(eng, sums5, back.partials)
    eng.rollback(back)
    assert _equal(w.bits(), at_five)
    eng.patch(back)

    forward = eng.stage([files[4], files[5]])
    eng.patch(forward)
    _images_equal(w, 5)
    assert _equal(w.bits(), at_five)

    one = eng.stage([files[5]], back_to=files[4].header)
    if w.owned:
        verify_partials(eng.live_sums(), [one.partials], files[4].header)
    eng.patch(one)
    _images_equal(w, 4)


@pytest.mark.parametrize("device,backend", cases())
def test_back_to_an_anchor(tmp_path, device, backend):
    """The target may be an anchor (its header only is read): 2 -> 0 with the anchor 0 as target."""
    need(device, backend)
    w = World("qwen3", device)
    anchor = write_anchor(str(tmp_path / "a0.safetensors"), 0, {n: t.cpu() for n, t in w.hf[0].items()})
    files = _published(w, tmp_path, {1: "chunked", 2: "chunked"})
    eng = w.engine(backend)
    eng.patch(eng.stage([files[1], files[2]]))
    sums = eng.live_sums()
    back = eng.stage([files[2], files[1]], back_to=VersionFile(tmp_path / "a0.safetensors").header)
    verify_partials(sums, [back.partials], anchor)
    eng.patch(back)
    _images_equal(w, 0)


def test_what_cannot_be_undone_is_refused_and_nothing_changes(tmp_path):
    w = World("identity", "cpu")
    files = _published(w, tmp_path, {1: "chunked", 2: "raw", 3: "chunked"})
    anchor = write_anchor(str(tmp_path / "a2.safetensors"), 2, {n: t.cpu() for n, t in w.hf[2].items()})
    eng = w.engine("torch")
    eng.patch(eng.stage([files[1], files[2], files[3]]))
    before, state = w.bits(), eng._state
    refused = {
        "stores new values": ([files[3], files[2]], files[1].header),  # raw: no differences
        "is an anchor": ([VersionFile(tmp_path / "a2.safetensors")], files[1].header),
        "a delta on version 2, not on 1": ([files[3]], files[1].header),
        "nothing to stage": ([], files[3].header),
    }
    for why, (undone, target) in refused.items():
        with pytest.raises((NotSuccessorError, ValueError), match=why):
            eng.stage(undone, back_to=target)
        assert _equal(w.bits(), before) and eng._state == state, why
    assert anchor.version == 2
    # what can be undone still is
    eng.patch(eng.stage([files[3]], back_to=files[2].header))
    _images_equal(w, 2)
