"""The one-launch staging of a decoded unit (apply/stage_unit.py) against the engine's general path, bit for
bit: the fused plan (every field), the arranged new and old bits and the checksum partials; the Triton
kernel (interpreted on the CPU: TRITON_INTERPRET=1, as `make test` runs) and the torch reference. Then
whole stagings with the path on and off, and the chunks it must leave to the general path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_engine import World

from vllm_delta.apply import stage_unit
from vllm_delta.apply.emit import StageRun
from vllm_delta.apply.engine import ApplyEngine, StagedUpdate
from vllm_delta.apply.layout import Layout, Segment
from vllm_delta.bits import INT_DTYPE, bit_view
from vllm_delta.codec.decoding import Chunk, Runs
from vllm_delta.format import VersionFile
from vllm_delta.testing.apply_fixtures import Qwen3Spec, model_layout, qwen3_layout, reference_apply

pytestmark = pytest.mark.skipif(
    stage_unit.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="fused plans on the CPU run the Triton kernels under TRITON_INTERPRET=1 only",
)
SPEC = Qwen3Spec("unit", 32, 2, 4, 2, 8, 48, 80, False)  # fused qkv and gate_up, an untied head


def _qwen3_engine(block: int, device: str = "cpu") -> ApplyEngine:
    shapes, layout = qwen3_layout(SPEC)
    gen = torch.Generator().manual_seed(0)
    targets = {n: torch.randn(s, generator=gen).to(device=device, dtype=torch.bfloat16) for n, s in shapes.items()}
    return ApplyEngine(targets, layout, device, backend="triton", block=block)


def _reordered_engine(block: int, device: str = "cpu") -> ApplyEngine:
    """A fused target whose HF tensors come in another order than its rows (k, v, q -> q k v), beside
    fp32 tensors, and a replica this rank does not own."""
    targets = {
        "qkv": torch.randn(16, 8).to(torch.bfloat16),
        "f": torch.randn(40, 5),
        "g": torch.randn(7),
        "r": torch.randn(30).to(torch.bfloat16),
    }
    hf = {"k": (4, 8), "v": (4, 8), "q": (8, 8), "f": (40, 5), "g": (7,), "r": (30,)}
    segs = {
        "q": [Segment(0, 0, 8, 0, 8, 0, 8)],
        "k": [Segment(0, 0, 4, 0, 8, 64, 8)],
        "v": [Segment(0, 0, 4, 0, 8, 96, 8)],
        "f": [Segment(1, 0, 40, 0, 5, 0, 5)],
        "g": [Segment(2, 0, 7, 0, 1, 0, 1)],
        "r": [Segment(3, 0, 30, 0, 1, 0, 1, owner=False)],
    }
    targets = {k: t.to(device) for k, t in targets.items()}
    return ApplyEngine(targets, Layout(list(targets), hf, segs), device, backend="triton", block=block)


def _chunk(engine: ApplyEngine, names: list[str], seed: int, kind: str, mid: bool = False, held=None) -> Chunk:
    """Random changes of `names` (layout order) as one decoded chunk; `mid`: the first tensor's part
    starts and the last one's ends inside the tensor (a unit cut mid-tensor); `held`: positions only in
    the rank's share, and the decoder says so (Runs.held), else anywhere."""
    dl = engine.dlayout
    gen = torch.Generator().manual_seed(seed)
    ts, ps = [], []
    for k, name in enumerate(names):
        t, numel = dl.index[name], int(dl.numels[dl.index[name]])
        lo = numel // 3 if mid and k == 0 else int(dl.need_lo[t]) if held else 0
        hi = numel - numel // 4 if mid and k == len(names) - 1 else int(dl.need_hi[t]) if held else numel
        m = max(1, int((hi - lo) * 0.4))
        ps.append(torch.randperm(hi - lo, generator=gen)[:m].sort().values + lo)
        ts.append(t)
    p = torch.cat(ps)
    width = engine.flats[engine.layout.segments[names[0]][0].target].element_size()
    lim = 1 << (8 * width - 1)
    bits = torch.randint(-lim, lim, (p.numel(),), generator=gen, dtype=torch.int64).to(INT_DTYPE[width])
    t_idx = torch.repeat_interleave(torch.tensor(ts), torch.tensor([x.numel() for x in ps]))
    runs = Runs(np.array(ts, dtype=np.int64), np.array([x.numel() for x in ps], dtype=np.int64))
    if held is not None:
        runs = Runs(runs.tensors, runs.counts, np.full(len(ts), held))
    return Chunk(t_idx, p, bits if kind != "values" else None, bits if kind == "values" else None, runs)


def _emit(engine: ApplyEngine, chunk: Chunk, fast: bool, undo: bool) -> tuple[StageRun, int]:
    run = StageRun(engine, StagedUpdate(versions=[1], header=None, undo=undo))  # type: ignore[arg-type]
    width = chunk.values.element_size() if chunk.values is not None else chunk.diffs.element_size()
    if fast:
        engine.unit_kernel = True
        assert run._emit_unit(width, chunk.p, chunk.runs.nonempty(), chunk, 0.0)
    else:
        engine.unit_kernel = False
        run.emit(width, chunk.t_idx, chunk.p, chunk.runs, chunk)
    return run, width


def _assert_same_outputs(a: StageRun, b: StageRun, width: int) -> None:
    oa, ob = a.outs[width], b.outs[width]
    assert len(oa.plans) == len(ob.plans) == 1
    pa, pb = oa.plans[0], ob.plans[0]
    assert np.array_equal(pa.bounds, pb.bounds) and pa.bounds.dtype == pb.bounds.dtype
    for f in ("block_base", "rel", "slots"):
        x, y = getattr(pa, f), getattr(pb, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f
    assert (pa.count, pa.block, pa.target_base) == (pb.count, pb.block, pb.target_base)
    assert pa.base is pb.base and all(x is y for x, y in zip(pa.targets, pb.targets))
    assert torch.equal(oa.new[0], ob.new[0]) and torch.equal(oa.old[0], ob.old[0])
    assert torch.equal(a.sums, b.sums)


CASES = {  # engine, HF tensors of one chunk (layout order)
    "qwen3-qkv-gate-up": (
        _qwen3_engine,
        [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkvo"]
        + [f"model.layers.0.mlp.{x}_proj.weight" for x in ("gate", "up", "down")],
    ),
    "qwen3-norms-and-next-layer": (
        _qwen3_engine,
        ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"]
        + [f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"],
    ),
    "reordered-fused-rows": (_reordered_engine, ["k", "v", "q"]),
    "fp32": (_reordered_engine, ["f", "g"]),
    "not-owned": (_reordered_engine, ["r"]),
}


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "torch"])
@pytest.mark.parametrize("kind", ["diffs", "undo", "values"])
@pytest.mark.parametrize("mid", [False, True], ids=["whole", "mid"])
@pytest.mark.parametrize("case", list(CASES))
def test_unit_is_the_general_path(case, mid, kind, reference, monkeypatch):
    make, names = CASES[case]
    engine = make(32)
    if reference:
        monkeypatch.setattr(stage_unit, "available", lambda device: False)
    chunk = _chunk(engine, names, seed=len(case) + 7 * mid, kind=kind, mid=mid)
    undo = kind == "undo"
    fast, width = _emit(engine, chunk, True, undo)
    slow, _ = _emit(engine, chunk, False, undo)
    _assert_same_outputs(fast, slow, width)
    if case == "not-owned":
        assert not fast.sums.any()
    else:
        assert fast.sums.any()


@pytest.mark.parametrize("block", [32, 1024])
def test_unit_with_blocks_of_several_runs_and_default_blocks(block):
    """Blocks that hold the ends of several HF tensors of one target (q, k, v), and the engine's default
    block, where a whole unit is a few blocks."""
    engine = _qwen3_engine(block)
    names = [f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"]
    chunk = _chunk(engine, names, seed=3, kind="diffs", mid=True)
    fast, width = _emit(engine, chunk, True, False)
    slow, _ = _emit(engine, chunk, False, False)
    _assert_same_outputs(fast, slow, width)


@pytest.mark.parametrize("held", [None, False, True])
def test_a_tp2_rank_takes_the_unit_kernel_only_where_it_needs_no_mask(held):
    """Rank 1 of 2: q, k, v split by rows, o_proj by columns. Row shards need a mask unless the decoder says
    every element is in the rank's rows (Runs.held: then the unit kernel, the same outputs); a column
    split, or a tied copy, always takes the general path."""
    shapes, layout = model_layout(SPEC, tp=2, rank=1)
    gen = torch.Generator().manual_seed(1)
    targets = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    engine = ApplyEngine(targets, layout, "cpu", backend="triton", block=32)
    rows = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    cols = ["model.layers.0.self_attn.o_proj.weight"]
    for names, fast in ((rows, held is True), (cols, False)):
        chunk = _chunk(engine, names, seed=5, kind="diffs", held=held)
        runs = chunk.runs.nonempty()
        assert (engine.dlayout.whole_runs(runs.tensors, runs.counts, runs.held) is not None) == fast, names
        slow, width = _emit(engine, chunk, False, False)
        run = StageRun(engine, StagedUpdate(versions=[1], header=None))  # type: ignore[arg-type]
        assert run._emit_unit(width, chunk.p, runs, chunk, 0.0) == fast
        if fast:
            _assert_same_outputs(run, slow, width)
        elif held is None:  # positions anywhere: the rank's elements only, whichever path
            engine.unit_kernel = True
            again = StageRun(engine, StagedUpdate(versions=[1], header=None))  # type: ignore[arg-type]
            again.emit(width, chunk.t_idx, chunk.p, chunk.runs, chunk)
            _assert_same_outputs(again, slow, width)


def _assert_same_staged(a, b) -> None:
    assert a.partials == b.partials and (a.nnz, a.bytes) == (b.nnz, b.bytes) and len(a.plans) == len(b.plans)
    for pa, pb, na, nb, oa, ob in zip(a.plans, b.plans, a.new_bits, b.new_bits, a.old_bits, b.old_bits):
        assert np.array_equal(pa.bounds, pb.bounds)
        for f in ("block_base", "rel", "slots"):
            x, y = getattr(pa, f), getattr(pb, f)
            assert x.dtype == y.dtype and torch.equal(x, y), f
        assert (pa.count, pa.block, pa.target_base) == (pb.count, pb.block, pb.target_base)
        assert torch.equal(na, nb) and torch.equal(oa, ob)


@pytest.mark.parametrize("scenario,codec", [("qwen3", "chunked"), ("identity", "raw"), ("shards", "compact")])
def test_stage_with_and_without_the_unit_kernel(tmp_path, scenario, codec, monkeypatch):
    """Versions 1 and 2 staged and patched, then 2 undone: each staged with the unit kernel on and off (the
    same live weights), the same staged updates; the one patched (the kernel's) writes the reference's
    weights. On the shards layout (column boxes, a transposed target, tied copies, a replica) only the
    chunks of whole tensors with one owner take it; the rest stay on the general path, as correct."""
    w = World(scenario, "cpu")
    files = []
    for v in (1, 2):
        w.step(density=0.1, seed=v)
        w.write(tmp_path / f"v{v}.safetensors", v, codec, frame_elems=37)
        files.append(VersionFile(tmp_path / f"v{v}.safetensors"))
    want = [t.clone() for t in w.targets]
    taken: list[bool] = []
    real = stage_unit.stage_chunk

    def counted(*a, **k):
        out = real(*a, **k)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(stage_unit, "stage_chunk", counted)
    eng = w.engine("triton", block=128, chunk_elems=500, unit_kernel=True)
    assert eng.unit_kernel and not w.engine("triton", unit_kernel=False).unit_kernel
    steps = [([f], None) for f in files] + ([] if codec == "raw" else [([files[1]], files[0].header)])
    for todo, back_to in steps:
        staged = {}
        for fast in (False, True):
            eng.unit_kernel = fast
            staged[fast] = eng.stage(todo, back_to=back_to)
        _assert_same_staged(staged[True], staged[False])
        eng.patch(staged[True])
    for changes in w.changes[1 : 2 if codec != "raw" else 3]:
        reference_apply(want, w.layout, changes)
    assert all(torch.equal(x, bit_view(y)) for x, y in zip(w.bits(), want))
    assert (False if scenario == "shards" else True) in taken, taken


def test_the_switch(monkeypatch):
    w = World("identity", "cpu")
    assert w.engine("triton").unit_kernel and not w.engine("torch", unit_kernel=True).unit_kernel
    monkeypatch.setenv(stage_unit.ENV, "0")
    assert not w.engine("triton").unit_kernel and w.engine("triton", unit_kernel=True).unit_kernel
