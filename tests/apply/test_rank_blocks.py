"""Chunks cut where the ranks are (issue 35 item 3): a chunked file laid out by rank blocks
(codec/chunked/blocks.py) lets each tensor-parallel rank decode only the regions of its share, bit-exact.

The same changes written with rank blocks and without (one file, and a version of 2 parts) are staged at
TP=1, 2 and 4 on vLLM's split of Qwen3 and of a Qwen3-MoE (`apply_fixtures.tp_layout`): every rank writes
exactly the reference, the ranks' partials add up to the version's sums, and the changed elements each
rank decodes (`StagedUpdate.decoded`) are those of its blocks: at most its held elements plus the whole
tensors of region 0 plus the blocks its rows straddle (the padded vocabulary), and fewer than without
rank blocks. The file's `spans` and regions are checked against the header (CodecError, nothing staged).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_rank_share import MOE, SPEC, _apply, _assert_holds, _engine, _held_elements, _hf

from vllm_delta import format as fmt
from vllm_delta.checksums import verify_partials
from vllm_delta.codec.chunked import blocks as rb
from vllm_delta.errors import CodecError
from vllm_delta.testing.apply_fixtures import hf_sums, model_layout, random_changes, write_delta, write_delta_blocks

CHUNK = 128
DENSITY = 0.03


def _versions(tmp_path, spec, parts: int, seed: int = 0):
    """(old, new, changes, {"blocks": version, "plain": version}) of the same changes."""
    old = _hf(spec, seed)
    changes = random_changes(old, DENSITY, seed=seed + 1)
    new = _apply(old, changes)
    paths = [os.path.join(tmp_path, f"b-{seed}-{k}.safetensors") for k in range(parts)]
    write_delta_blocks(paths, version=1, base=0, new=new, changes=changes, chunk_elems=CHUNK, passes=3)
    plain = os.path.join(tmp_path, f"p-{seed}.safetensors")
    shapes = dict(model_layout(spec)[1].hf_shapes)
    write_delta(
        plain, version=1, base=0, codec="chunked", shapes=shapes, changes=changes, sums=hf_sums(new), chunk_elems=CHUNK
    )
    files = [fmt.VersionFile(p) for p in paths]
    return (
        old,
        new,
        changes,
        {"blocks": files[0] if parts == 1 else fmt.Version(files), "plain": fmt.VersionFile(plain)},
    )


def _whole_elements(spec, changes: dict) -> int:
    """Changed elements of the tensors region 0 holds whole (every rank decodes them)."""
    _, layout = model_layout(spec)
    return sum(int(changes[n][0].numel()) for n, s in layout.hf_shapes.items() if rb.split_kind(n, s) == rb.WHOLE)


def _chunks_needed(vf, spec, tp: int, rank: int) -> int:
    """An upper bound of the changed elements a rank decodes, from the file's regions and spans and the
    rank's layout, computed here independently of the decoder: every chunk of region 0 that holds a
    tensor the rank holds, and of region 1 + b every chunk holding block b of a tensor whose rows
    (columns) the rank holds any of (the CPU path skips every other chunk)."""
    from vllm_delta.codec.chunked.regions import file_spans

    _, layout = model_layout(spec, tp, rank)
    total = 0
    for part in vf.parts if isinstance(vf, fmt.Version) else [vf]:
        h, payload = part.header, part.file_payload()
        regions = np.asarray(h.enc["regions"])
        spans = file_spans(payload, h.enc, {})
        names = h.tensors.names
        pieces = []  # (region, at, nnz) of the pieces the rank needs
        for i, name in enumerate(names):
            segs = [s for s in layout.segments.get(name, ()) if s.rows and s.cols]
            at = h.tensors.arrays().at[i]
            if segs and at >= 0:
                pieces.append((0, int(at), int(h.tensors.nnz[i])))
        for t, kind, b, n, at in spans.tolist():
            segs = [s for s in layout.segments.get(names[t], ()) if s.rows and s.cols]
            shape = h.tensors.shapes[t]
            size = shape[0] if kind == rb.ROWS else shape[1]
            lo = min((s.row0 if kind == rb.ROWS else s.col0) for s in segs) if segs else 0
            hi = max((s.row0 + s.rows if kind == rb.ROWS else s.col0 + s.cols) for s in segs) if segs else 0
            b0, b1 = int(rb.edge(b, size, rb.RANK_BLOCKS)), int(rb.edge(b + 1, size, rb.RANK_BLOCKS))
            if kind == rb.ROWS and part.header.part is not None:  # the part's rows of the block
                r0, r1 = part.header.part.rows[names[t]]
                b0, b1 = max(b0, r0), min(b1, r1)
            if segs and b0 < hi and b1 > lo:
                pieces.append((b + 1, at, n))
        chunks = {(r, k) for r, at, n in pieces for k in range(at // CHUNK, (at + n - 1) // CHUNK + 1)}
        total += sum(min(CHUNK, int(regions[r]) - k * CHUNK) for r, k in chunks)
    return total


def _straddled(spec, tp: int, rank: int, changes: dict) -> int:
    """Changed elements of the blocks that a rank's rows (columns) hold only part of: decoded, not held."""
    _, layout = model_layout(spec, tp, rank)
    total = 0
    for name, segs in layout.segments.items():
        shape = layout.hf_shapes[name]
        kind = rb.split_kind(name, shape)
        if kind == rb.WHOLE or not segs:
            continue
        n = shape[0] if kind == rb.ROWS else shape[1]
        lo = min(s.row0 if kind == rb.ROWS else s.col0 for s in segs)
        hi = max(s.row0 + s.rows if kind == rb.ROWS else s.col0 + s.cols for s in segs)
        pos = changes[name][0]
        at = pos // shape[1] if kind == rb.ROWS else pos % shape[1]
        block = at * rb.RANK_BLOCKS // n
        for b in range(rb.RANK_BLOCKS):
            b0, b1 = int(rb.edge(b, n, rb.RANK_BLOCKS)), int(rb.edge(b + 1, n, rb.RANK_BLOCKS))
            if b0 < hi and b1 > lo and not (lo <= b0 and b1 <= hi):
                total += int(((block == b) & ((at < lo) | (at >= hi))).sum())
    return total


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("spec", [SPEC, MOE], ids=["dense", "moe"])
def test_each_rank_decodes_only_its_blocks_bit_exact(tmp_path, spec, parts):
    old, new, changes, vfs = _versions(tmp_path, spec, parts)
    vf, plain = vfs["blocks"], vfs["plain"]
    assert vf.header.format_version == fmt.ARRAYS_FORMAT_VERSION and "blocks" in (
        vf.parts[0].header.enc if parts > 1 else vf.header.enc
    )
    nnz, whole = vf.header.nnz, _whole_elements(spec, changes)
    one = _engine(spec, 1, 0, old)
    staged = one.stage([vf])
    assert staged.decoded == nnz
    one.patch(staged)
    _assert_holds(one, spec, 1, 0, new)
    for tp in (2, 4) if spec.heads % 4 == 0 else (2,):  # the MoE fixture has 2 heads
        partials = []
        for rank in range(tp):
            engine = _engine(spec, tp, rank, old)
            staged = engine.stage([vf])
            held = _held_elements(spec, tp, rank, changes)
            need = _chunks_needed(vf, spec, tp, rank)  # within a block, chunks of rows it lacks are skipped too
            assert held <= staged.decoded <= need, (tp, rank, held, staged.decoded, need)
            # beyond what it holds: region 0's whole tensors, blocks its rows straddle (the padded
            # vocabulary, replicated KV heads) and their chunks' neighbours
            assert staged.decoded <= 1.15 * (held + whole + _straddled(spec, tp, rank, changes)), (tp, rank)
            without = engine.stage([plain]).decoded
            assert staged.decoded < without, (tp, rank, staged.decoded, without)
            if tp == 2:  # the issue's bar for a rank's staging at TP=2: 0.6 of TP=1's (here: of its decoding)
                assert staged.decoded <= 0.6 * nnz, (rank, staged.decoded / nnz, without / nnz)
            partials.append(staged.partials)
            engine.patch(staged)
            _assert_holds(engine, spec, tp, rank, new)
        verify_partials(hf_sums(old), partials, vf.header)


def test_a_file_with_rank_blocks_replays_and_reads_piece_by_piece(tmp_path):
    """The per-piece reader (replay, materialize) reads a split tensor's blocks in position order."""
    from vllm_delta.codec import get_codec

    old, new, changes, vfs = _versions(tmp_path, SPEC, 1)
    vf = vfs["blocks"]
    codec = get_codec("chunked")
    for name, t in old.items():
        (piece,) = vf.pieces(name) or [None]
        if piece is None:
            assert not changes[name][0].numel()
            continue
        ctx = {"version": 1, "tensor": name}
        sec = codec.unpack(piece.payload, piece.enc, numel=t.numel(), nnz=piece.nnz, dtype=t.dtype, ctx=ctx)
        got = codec.finish(sec, numel=t.numel(), device="cpu", ctx=ctx)
        pos, nb, ob = changes[name]
        assert torch.equal(got.positions, pos), name
        assert torch.equal(got.new_bits(ob.view(torch.int16)).view(torch.int16), nb.view(torch.int16)), name


def test_the_regions_take_contiguous_chunks_and_short_chunks_only_at_their_ends(tmp_path):
    _, _, _, vfs = _versions(tmp_path, MOE, 1)
    vf = vfs["blocks"]
    enc = vf.header.enc
    regions = np.asarray(enc["regions"])
    assert len(regions) == rb.RANK_BLOCKS + 1 and int(regions.sum()) == enc["elems"] == vf.header.nnz
    index = vf.file_payload()["index"]
    assert index.shape[0] == int((-(-regions // CHUNK)).sum())  # each region: its chunks, the last short


@pytest.mark.parametrize(
    "damage, message",
    [
        ("regions", "regions"),
        ("spans_nnz", "spans hold"),
        ("spans_kind", "malformed spans"),
        ("spans_order", "malformed spans"),
    ],
)
def test_damaged_blocks_are_a_codec_error_and_nothing_is_staged(tmp_path, damage, message):
    old, _, _, vfs = _versions(tmp_path, SPEC, 1)
    path = vfs["blocks"].path
    src = fmt.VersionFile(path)
    header, payload = src.header, {k: src._tensor(k).clone() for k in src._keys}
    spans = payload["::spans"]
    if damage == "regions":
        header.enc = {
            **header.enc,
            "regions": [*header.enc["regions"][:-2], header.enc["regions"][-2] + 1, header.enc["regions"][-1] - 1],
        }
    elif damage == "spans_nnz":
        spans[0, 3] += 1
    elif damage == "spans_kind":
        spans[0, 1] = 7
    else:
        spans[[0, -1]] = spans[[-1, 0]]
    bad = os.path.join(tmp_path, "bad.safetensors")
    fmt.write(bad, header, payload)
    engine = _engine(SPEC, 2, 0, old)
    before = [t.clone() for t in engine.targets]
    with pytest.raises(CodecError, match=message):
        engine.stage([fmt.VersionFile(bad)])
    assert all(torch.equal(a, b) for a, b in zip(before, engine.targets))
