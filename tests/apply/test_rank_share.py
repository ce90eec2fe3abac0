"""Each tensor-parallel rank decodes only its share (issue 26 item 1), and a multi-part version stages
like one file (issue 25 item 2), at the engine level on the CPU.

A rank's layout (`apply_fixtures.tp_layout`: vLLM's split of Qwen3 over 2 ranks) holds some rows of
the tensors split by rows (the vocabulary, q/k/v, gate/up) and every row of those split by columns
(o_proj, down_proj, norms). The chunked file records each chunk's first position (`first`), so a
rank's decoder skips the chunks holding only other ranks' rows. Every rank's writes are bit-exact
against the torch reference, the ranks' checksum partials add up to the version's sums, and the
decoded elements are counted (`StagedUpdate.decoded`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from vllm_delta import format as fmt
from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.apply.layout import hf_2d
from vllm_delta.bits import bit_view
from vllm_delta.checksums import verify_partials
from vllm_delta.codec.chunked import decoder, gpu
from vllm_delta.errors import ChecksumMismatchError, CodecError
from vllm_delta.testing.apply_fixtures import (
    Qwen3MoeSpec,
    Qwen3Spec,
    hf_sums,
    model_layout,
    random_changes,
    targets_of,
    write_delta,
    write_delta_parts,
)

# 2 layers of hidden 256, 4 heads of 64 and 2 KV heads, intermediate 512, vocab 500 (padded to 512):
# 1.44M elements; at 3% every tensor spans 8-30 chunks of 128 elements, as a real model's do at 65536
SPEC = Qwen3Spec("share", 256, 2, 4, 2, 64, 512, 500, False)
# experts of 256 x 128, one KV head (k and v replicated on both ranks)
MOE = Qwen3MoeSpec("share-moe", 128, 1, 2, 1, 64, 8, 256, 300, False)
CHUNK = 128  # elements per chunk (writers: 65536): a small model gets many chunks
DENSITY = 0.03
# What a rank must decode at TP=2, as a share of the changed elements: half of what is split by rows,
# all of what is split by columns or replicated (SPEC: 0.64; MOE: 0.67), plus the chunks straddling two
# ranks' rows
SHARE = {"share": 0.72, "share-moe": 0.80}


def _hf(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    _, layout = model_layout(spec)
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in layout.hf_shapes.items()}


def _apply(old: dict[str, torch.Tensor], changes: dict) -> dict[str, torch.Tensor]:
    new = {}
    for name, t in old.items():
        flat = bit_view(t).reshape(-1).clone()
        pos, nb, _ = changes[name]
        flat[pos] = nb
        new[name] = flat.view(t.dtype).reshape(t.shape)
    return new


def _version(tmp_path, spec, parts: int, *, seed: int = 0, drop_first: bool = False):
    """(old tensors, new tensors, the version opened): one file (parts=1) or `parts` part files."""
    old = _hf(spec, seed)
    changes = random_changes(old, DENSITY, seed=seed + 1)
    new = _apply(old, changes)
    if parts == 1:
        path = os.path.join(tmp_path, f"v1-{seed}.safetensors")
        write_delta(
            path,
            version=1,
            base=0,
            codec="chunked",
            shapes=dict(model_layout(spec)[1].hf_shapes),
            changes=changes,
            sums=hf_sums(new),
            chunk_elems=CHUNK,
        )
        paths = [path]
    else:
        paths = [os.path.join(tmp_path, f"v1-{seed}-p{k}.safetensors") for k in range(parts)]
        write_delta_parts(paths, version=1, base=0, new=new, changes=changes, chunk_elems=CHUNK)
    if drop_first:  # a file written before each chunk's first position was recorded
        for path in paths:
            vf = fmt.VersionFile(path)
            payload = {k: vf._tensor(k).clone() for k in vf._keys if not k.endswith("::first")}
            header = vf.header
            vf.close()
            fmt.write(path, header, payload)
    files = [fmt.VersionFile(p) for p in paths]
    vf = files[0] if parts == 1 else fmt.Version(files)
    return old, new, changes, vf


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(device)


def _engine(spec, tp: int, rank: int, hf: dict[str, torch.Tensor], device=None, **kw) -> ApplyEngine:
    shapes, layout = model_layout(spec, tp, rank)
    dev = device or torch.device("cpu")
    return ApplyEngine(targets_of(layout, shapes, hf, dev), layout, dev, threads=2, **kw)


def _assert_holds(engine: ApplyEngine, spec, tp: int, rank: int, hf: dict[str, torch.Tensor]) -> None:
    shapes, layout = model_layout(spec, tp, rank)
    want = targets_of(layout, shapes, hf)
    for name, t in zip(engine.target_names, engine.targets):
        assert torch.equal(bit_view(t).cpu(), bit_view(want[name])), name


def _held_elements(spec, tp: int, rank: int, changes: dict) -> int:
    """Changed elements the rank's layout holds (a lower bound of what it must decode)."""
    _, layout = model_layout(spec, tp, rank)
    total = 0
    for name, segs in layout.segments.items():
        pos = changes[name][0]
        _, cols = hf_2d(layout.hf_shapes[name])
        r, c = pos // cols, pos % cols
        held = torch.zeros_like(pos, dtype=torch.bool)
        for s in segs:
            held |= (r >= s.row0) & (r < s.row0 + s.rows) & (c >= s.col0) & (c < s.col0 + s.cols)
        total += int(held.sum())
    return total


def test_tp_layouts_tile_every_tensor_once():
    """The fixture's TP layouts: every element held by some rank and owned by exactly one."""
    for spec in (SPEC, MOE):
        _, full = model_layout(spec)
        owned = {n: torch.zeros(hf_2d(s), dtype=torch.int64) for n, s in full.hf_shapes.items()}
        held = {n: torch.zeros(hf_2d(s), dtype=torch.bool) for n, s in full.hf_shapes.items()}
        for rank in range(2):
            _, layout = model_layout(spec, 2, rank)
            assert layout.hf_shapes == full.hf_shapes
            for name, segs in layout.segments.items():
                for s in segs:
                    box = (slice(s.row0, s.row0 + s.rows), slice(s.col0, s.col0 + s.cols))
                    held[name][box] = True
                    owned[name][box] += int(s.owner)
        for name in full.hf_shapes:
            assert bool(held[name].all()) and bool((owned[name] == 1).all()), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("spec", [SPEC, MOE], ids=["dense", "moe"])
def test_each_rank_decodes_its_share_bit_exact(tmp_path, parts, spec, device, monkeypatch):
    """TP=1 decodes every changed element; each TP=2 rank decodes fewer, at least those it holds,
    writes exactly the reference, and the ranks' partials add up to the version's sums (on a GPU:
    nvCOMP where it is installed, the Triton planes, a part's short chunk decoded padded; every gap
    skipped, as on the CPU, so that the skipping itself is what runs there)."""
    dev = _device(device)
    monkeypatch.setattr(decoder, "GPU_SKIP_MIN_ELEMS", 1)
    old, new, changes, vf = _version(tmp_path, spec, parts)
    nnz = vf.header.nnz
    one = _engine(spec, 1, 0, old, dev)
    staged = one.stage([vf])
    assert staged.decoded == nnz
    verify_partials(hf_sums(old), [staged.partials], vf.header)
    one.patch(staged)
    _assert_holds(one, spec, 1, 0, new)
    partials, decoded = [], []
    for rank in range(2):
        engine = _engine(spec, 2, rank, old, dev)
        staged = engine.stage([vf])
        partials.append(staged.partials)
        decoded.append(staged.decoded)
        engine.patch(staged)
        _assert_holds(engine, spec, 2, rank, new)
        assert _held_elements(spec, 2, rank, changes) <= staged.decoded <= SHARE[spec.name] * nnz, (rank, decoded, nnz)
    verify_partials(hf_sums(old), partials, vf.header)


def test_short_gaps_are_decoded_in_one_gpu_call(tmp_path, monkeypatch):
    """On the GPU path a gap of skipped chunks shorter than GPU_SKIP_MIN_ELEMS is decoded rather than
    skipped (each run costs an nvCOMP call and a decode): a TP=2 rank then inflates its file in one
    call, decodes the other rank's chunks between its own, and still writes exactly its rows; with every gap skipped the
    same rank makes one call per run of its chunks. (nvCOMP stood in for by zstandard on the CPU.)"""
    from test_staging import _StandInZstd

    backend = _StandInZstd()
    monkeypatch.setattr(gpu, "backend", lambda device: (backend, ""))
    old, new, _, vf = _version(tmp_path, SPEC, 1, seed=5)
    seen, default = {}, decoder.GPU_SKIP_MIN_ELEMS
    for skip_min in (default, 1):
        monkeypatch.setattr(decoder, "GPU_SKIP_MIN_ELEMS", skip_min)
        partials = []
        for rank in range(2):
            engine = _engine(SPEC, 2, rank, old)
            calls = backend.calls
            staged = engine.stage([vf])
            seen[skip_min, rank] = (backend.calls - calls, staged.decoded)
            engine.patch(staged)
            _assert_holds(engine, SPEC, 2, rank, new)
            partials.append(staged.partials)
        verify_partials(hf_sums(old), partials, vf.header)
    for rank in range(2):
        calls, decoded = seen[1, rank]
        assert calls > 1, seen  # every gap skipped: a call per run of the rank's chunks
        # gaps filled: one call, more decoded (the chunks before the first and after the last needed stay skipped)
        filled_calls, filled = seen[default, rank]
        assert filled_calls == 1 and decoded < filled <= vf.header.nnz, seen


def test_parts_decode_in_one_run_and_one_gpu_call(tmp_path, monkeypatch):
    """The parts of a version are one sequence of chunks: the GPU path (its nvCOMP stood in for by
    zstandard, tests/apply/test_staging.py) inflates every part's chunks in ONE call and decodes
    them in one fused run; the result equals the one-file version's."""
    from test_staging import _StandInZstd

    backend = _StandInZstd()
    monkeypatch.setattr(gpu, "backend", lambda device: (backend, ""))
    results = {}
    for parts in (1, 3):
        old, new, _, vf = _version(tmp_path, SPEC, parts, seed=3)
        shapes, layout = model_layout(SPEC)
        engine = ApplyEngine(targets_of(layout, shapes, old), layout, torch.device("cpu"), chunk_elems=1 << 20)
        calls = backend.calls
        staged = engine.stage([vf])
        assert backend.calls - calls == 1, parts  # one nvCOMP call for every part's chunks
        assert staged.timings["inflate"] > 0
        engine.patch(staged)
        _assert_holds(engine, SPEC, 1, 0, new)
        results[parts] = staged.partials
    assert results[1] == results[3]


@pytest.mark.parametrize("planes", ["torch", "triton"])
def test_padded_runs_across_parts_decode_bit_exact(tmp_path, monkeypatch, planes):
    """What a GPU does with the parts of a version, here on the CPU: one run over every part's chunks,
    each part's short last chunk padded to a whole chunk's room with zeros and decoded with the rest in
    one fused decode (the Triton kernel under TRITON_INTERPRET=1, or the torch planes), the padding
    dropped; the same writes as the one-file version, on every rank."""
    from vllm_delta.codec.chunked import decode, decoder, kernels

    if planes == "triton" and not kernels.available(torch.device("cpu")):
        pytest.skip("the Triton kernels run on the CPU under TRITON_INTERPRET=1 only")
    monkeypatch.setattr(decoder, "PAD_DEVICES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(decode, "default_backend", lambda dev: planes)
    old, new, _, vf = _version(tmp_path, SPEC, 3, seed=7)
    assert all(f.header.enc["elems"] % CHUNK for f in vf.parts)  # every part ends in a short chunk
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        shapes, layout = model_layout(SPEC, tp, rank)
        engine = ApplyEngine(targets_of(layout, shapes, old), layout, torch.device("cpu"), chunk_elems=1 << 20)
        engine.patch(engine.stage([vf]))
        _assert_holds(engine, SPEC, tp, rank, new)


def test_files_without_first_positions_decode_every_chunk(tmp_path):
    """A chunked file written before `first` existed: a rank cannot start a tensor's gap chain
    mid-tensor, so it decodes every chunk of the tensors it holds; the result is the same."""
    old, new, changes, vf = _version(tmp_path, SPEC, 1, drop_first=True)
    assert "first" not in vf.file_payload()
    engine = _engine(SPEC, 2, 1, old)
    staged = engine.stage([vf])
    assert staged.decoded == vf.header.nnz  # every tensor has rows on rank 1: all its chunks
    engine.patch(staged)
    _assert_holds(engine, SPEC, 2, 1, new)


def _with_first(vf: fmt.VersionFile, path: str, change) -> fmt.VersionFile:
    payload = {k: vf._tensor(k).clone() for k in vf._keys}
    first = payload["::first"]
    change(first)
    fmt.write(path, vf.header, payload)
    return fmt.VersionFile(path)


def test_a_wrong_first_position_never_reaches_the_weights(tmp_path):
    """`first` lies outside the chunk hashes: a wrong entry is caught where the chunk before it is
    decoded (CodecError naming the tensor and the chunk), where it breaks the order of its tensor's
    positions (when the plan is made), and, where every entry a rank starts from is wrong alike (no
    decoded chunk contradicts them), by the checksum verification before anything is written."""
    old, _, _, vf = _version(tmp_path, SPEC, 1)
    first = vf.file_payload()["first"].numpy().copy()
    embed = vf.header.tensors["model.embed_tokens.weight"]
    a, b = embed.enc["at"], embed.enc["at"] + embed.nnz
    # rank 1 holds vocab rows 256..499: it starts the embedding's gap chain at chunk k1, skipping those before
    k1 = _chunks_decoded_from(vf, _engine(SPEC, 2, 1, old), "model.embed_tokens.weight")[0]
    kb = (b - 1) // CHUNK  # the embedding's last chunk
    assert a < k1 * CHUNK < kb * CHUNK
    one = _with_first(vf, str(tmp_path / "one.safetensors"), lambda f: f.__setitem__(k1, f[k1] + 1))
    with pytest.raises(CodecError, match=f"chunk {k1} .*first position differs") as exc:
        _engine(SPEC, 2, 0, old).stage([one])  # rank 0 decodes chunk k1 - 1: k1's first position is known
    assert exc.value.tensor == "model.embed_tokens.weight"
    with pytest.raises(CodecError, match=f"chunk {k1 + 1} .*first position differs"):
        _engine(SPEC, 2, 1, old).stage([one])  # rank 1 starts from it: chunk k1 + 1 disagrees
    later = slice(k1, kb + 1)
    shifted = _with_first(vf, str(tmp_path / "shifted.safetensors"), lambda f: f.__setitem__(later, f[later] + 1))
    staged = _engine(SPEC, 2, 1, old).stage([shifted])  # rank 1's positions are all one too far
    partials = [_engine(SPEC, 2, 0, old).stage([vf]).partials, staged.partials]
    with pytest.raises(ChecksumMismatchError) as mismatch:
        verify_partials(hf_sums(old), partials, shifted.header)
    assert mismatch.value.tensor == "model.embed_tokens.weight"
    backwards = _with_first(vf, str(tmp_path / "backwards.safetensors"), lambda f: f.__setitem__(k1 + 1, f[k1]))
    with pytest.raises(CodecError, match=f"chunk {k1}: its first position .* not below the next"):
        _engine(SPEC, 2, 1, old).stage([backwards])
    assert np.array_equal(vf.file_payload()["first"].numpy(), first)


def _chunks_decoded_from(vf: fmt.VersionFile, engine: ApplyEngine, name: str) -> list[int]:
    """The chunks of tensor `name` a rank's decoder reads (from its plan)."""
    from vllm_delta.apply.staging import Decoder, _Host, changed_items
    from vllm_delta.codec.chunked.decoder import ChunkedDecoder

    dec = Decoder(torch.device("cpu"), threads=1)
    pieces = changed_items(vf, engine.dlayout)[2]
    plan = ChunkedDecoder().plan(1, pieces, 2, _Host(dec, {}))
    entry = vf.header.tensors[name]
    a, b = entry.enc["at"] // CHUNK, (entry.enc["at"] + entry.nnz - 1) // CHUNK
    out = sorted({g for run in plan.units for g in range(run.g0, run.g1) if a <= g <= b})
    dec.close()
    return out
