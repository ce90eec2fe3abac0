"""ApplyEngine end to end: real version files -> stage -> verify -> commit -> rollback, bit-exact against
the torch reference (`reference_apply`), for every layout kind, codec and backend."""

from __future__ import annotations

import pytest
import torch
from apply_cases import cases, need

from vllm_delta.apply import engine as engine_mod
from vllm_delta.apply import plans
from vllm_delta.apply import scatter as scatter_ops
from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.apply.layout import Layout, Segment, hf_2d
from vllm_delta.bits import bit_view
from vllm_delta.checksums import MASK64, verify_partials
from vllm_delta.errors import ChecksumMismatchError, NotSuccessorError
from vllm_delta.format import VersionFile
from vllm_delta.testing.apply_fixtures import (
    QWEN3,
    apply_diffs,
    hf_sums,
    hf_view,
    qwen3_layout,
    random_changes,
    reference_apply,
    write_anchor,
    write_delta,
)

# -- scenarios: (targets {name: (shape, dtype)}, Layout, HF dtypes, every element owned once?) -------


def _identity():
    shapes = {"a": (37, 53), "b": (100,), "c": (20, 30), "d": (3, 4, 5)}
    dtypes = {"a": torch.bfloat16, "b": torch.bfloat16, "c": torch.float32, "d": torch.bfloat16}
    layout = Layout.identity(shapes)
    return {n: (s, dtypes[n]) for n, s in shapes.items()}, layout, dtypes, True


def _qwen3():
    targets, layout = qwen3_layout(QWEN3["qwen3-tiny"])
    return (
        {n: (s, torch.bfloat16) for n, s in targets.items()},
        layout,
        dict.fromkeys(layout.hf_shapes, torch.bfloat16),
        True,
    )


def _shards():
    """Column box, row shard, transposed (strided) target, fused rows, tied copies, a replica."""
    targets = {
        "w_cols": ((40, 32), torch.bfloat16),  # HF w (40, 64), columns [16, 48)
        "v_rows": ((25, 8), torch.bfloat16),  # HF v (50, 8), rows [10, 35)
        "t_T": ((16, 24), torch.bfloat16),  # HF t (24, 16), stored transposed
        "qk": ((12, 8), torch.bfloat16),  # HF q (8, 8) + k (4, 8), fused rows
        "emb": ((30, 8), torch.bfloat16),  # HF emb (30, 8), tied: emb and head
        "head": ((30, 8), torch.bfloat16),
        "n": ((8,), torch.float32),  # HF n (8,), replicated: not the owner here
    }
    hf = {"w": (40, 64), "v": (50, 8), "t": (24, 16), "q": (8, 8), "k": (4, 8), "emb": (30, 8), "n": (8,)}
    segs = {
        "w": [Segment(0, 0, 40, 16, 32, 0, 32)],
        "v": [Segment(1, 10, 25, 0, 8, 0, 8)],
        "t": [Segment(2, 0, 24, 0, 16, 0, 1, 24)],
        "q": [Segment(3, 0, 8, 0, 8, 0, 8)],
        "k": [Segment(3, 0, 4, 0, 8, 64, 8)],
        "emb": [Segment(4, 0, 30, 0, 8, 0, 8), Segment(5, 0, 30, 0, 8, 0, 8, owner=False)],
        "n": [Segment(6, 0, 8, 0, 1, 0, 1, owner=False)],
    }
    dtypes = dict.fromkeys(hf, torch.bfloat16)
    dtypes["n"] = torch.float32
    return targets, Layout(targets=list(targets), hf_shapes=hf, segments=segs), dtypes, False


SCENARIOS = {"identity": _identity, "qwen3": _qwen3, "shards": _shards}


class World:
    """HF weights of versions 0, 1, 2... and the local targets holding version 0."""

    def __init__(self, scenario: str, device: str, seed: int = 0):
        tspecs, self.layout, self.dtypes, self.owned = SCENARIOS[scenario]()
        gen = torch.Generator().manual_seed(seed)
        self.device = device
        # local targets: random background, then the HF values written through every segment
        self.targets = [
            (torch.randn(shape, generator=gen) * 0.02).to(dtype).to(device) for shape, dtype in tspecs.values()
        ]
        self.hf = [
            {
                n: (torch.randn(s, generator=gen) * 0.02).to(self.dtypes[n]).to(device)
                for n, s in self.layout.hf_shapes.items()
            }
        ]
        full = {}
        for n, t in self.hf[0].items():
            bits = bit_view(t).reshape(-1)
            full[n] = (torch.arange(bits.numel(), device=device), bits)
        reference_apply(self.targets, self.layout, full)
        self.changes = [None]

    def step(self, density=0.08, seed=1):
        prev = self.hf[-1]
        ch = random_changes(prev, density, seed=seed)
        new = {}
        for n, t in prev.items():
            bits = bit_view(t.clone()).reshape(-1)
            pos, nb, _ = ch[n]
            bits[pos] = nb
            new[n] = bits.view(t.dtype).reshape(t.shape)
        self.hf.append(new)
        self.changes.append(ch)
        return ch

    def engine(self, backend, **kw):
        return ApplyEngine(
            dict(zip(self.layout.targets, self.targets)), self.layout, self.device, backend=backend, **kw
        )

    def bits(self):
        return [bit_view(t).clone() for t in self.targets]

    def expected(self, *changes):
        out = [t.clone() for t in self.targets]
        for ch in changes:
            reference_apply(out, self.layout, ch)
        return [bit_view(t) for t in out]

    def write(self, path, version, codec, frame_elems=None):
        return write_delta(
            str(path),
            version=version,
            base=version - 1,
            codec=codec,
            shapes=self.layout.hf_shapes,
            changes=self.changes[version],
            dtype=self.dtypes,
            sums=hf_sums(self.hf[version]),
            frame_elems=frame_elems,
            chunk_elems=128 if frame_elems else None,
        )


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _sums_move(engine, before, partials):
    after = engine.live_sums()
    for name in after:
        assert (before[name] + partials.get(name, 0)) & MASK64 == after[name], name


@pytest.mark.parametrize("device,backend", cases())
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("codec", ["chunked", "compact", "raw"])
def test_stage_commit_rollback(tmp_path, device, backend, scenario, codec):
    need(device, backend)
    w = World(scenario, device)
    ch = w.step()
    header = w.write(tmp_path / "v1.safetensors", 1, codec, frame_elems=37)
    eng = w.engine(backend, block=32, chunk_elems=200)
    before, sums0 = w.bits(), eng.live_sums()
    staged = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
    assert _equal(w.bits(), before), "staging wrote to the targets"
    assert staged.backend == backend and staged.nnz > 0 and staged.bytes > 0
    assert {"read", "decode", "translate", "gather", "plan", "total"} <= set(staged.timings)
    if w.owned:
        verify_partials(sums0, [staged.partials], header)
    ms = eng.patch(staged)
    assert ms >= 0 and staged.written
    assert _equal(w.bits(), w.expected(ch))
    _sums_move(eng, sums0, staged.partials)
    eng.rollback(staged)
    assert _equal(w.bits(), before)
    assert eng.live_sums() == sums0
    # the same staged update can be committed again after its rollback
    eng.patch(staged)
    assert _equal(w.bits(), w.expected(ch))


@pytest.mark.parametrize("device,backend", cases())
def test_checksum_mismatch_detected(tmp_path, device, backend):
    need(device, backend)
    w = World("identity", device)
    w.step()
    header = w.write(tmp_path / "v1.safetensors", 1, "compact")
    eng = w.engine(backend)
    sums0 = eng.live_sums()
    staged = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
    sums0["a"] += 1
    with pytest.raises(ChecksumMismatchError):
        verify_partials(sums0, [staged.partials], header)


@pytest.mark.parametrize("device,backend", cases())
@pytest.mark.parametrize("scenario", ["qwen3", "shards"])
def test_chain_in_one_update(tmp_path, device, backend, scenario):
    """Several deltas (mixed codecs) staged together == applied one after the other."""
    need(device, backend)
    w = World(scenario, device)
    files = []
    for v, codec in ((1, "chunked"), (2, "raw"), (3, "compact")):
        w.step(density=0.2, seed=v)
        w.write(tmp_path / f"v{v}.safetensors", v, codec, frame_elems=29)
        files.append(VersionFile(tmp_path / f"v{v}.safetensors"))
    eng = w.engine(backend, block=64, chunk_elems=150)
    before, sums0 = w.bits(), eng.live_sums()
    staged = eng.stage(files)
    assert staged.versions == [1, 2, 3]
    if w.owned:
        verify_partials(sums0, [staged.partials], files[-1].header)
    eng.patch(staged)
    assert _equal(w.bits(), w.expected(w.changes[1], w.changes[2], w.changes[3]))
    _sums_move(eng, sums0, staged.partials)
    eng.rollback(staged)
    assert _equal(w.bits(), before)


@pytest.mark.parametrize("device,backend", cases())
def test_anchor_then_delta(tmp_path, device, backend):
    need(device, backend)
    w = World("qwen3", device)
    w.step(seed=1)
    w.step(seed=2)
    write_anchor(str(tmp_path / "a2.safetensors"), 2, {n: t.cpu() for n, t in w.hf[2].items()})
    w.step(seed=3)
    w.write(tmp_path / "v3.safetensors", 3, "compact")
    eng = w.engine(backend, block=16)
    files = [VersionFile(tmp_path / "a2.safetensors"), VersionFile(tmp_path / "v3.safetensors")]
    sums0 = eng.live_sums()
    staged = eng.stage(files)
    verify_partials(sums0, [staged.partials], files[-1].header)
    eng.patch(staged)
    for name in w.layout.hf_shapes:
        assert torch.equal(bit_view(hf_view(w.layout, w.targets, name)), bit_view(w.hf[3][name])), name


@pytest.mark.parametrize("device,backend", cases())
@pytest.mark.parametrize("fail_at", [1, 2])
def test_failure_mid_commit_restores_everything(tmp_path, device, backend, fail_at, monkeypatch):
    """bf16 + fp32 targets: two plans. The scatter of plan `fail_at` writes, then raises."""
    need(device, backend)
    w = World("identity", device)
    w.step(density=0.3)
    w.write(tmp_path / "v1.safetensors", 1, "compact")
    eng = w.engine(backend, block=16)
    staged = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
    assert len(staged.plans) == 2
    before = w.bits()
    real, calls = scatter_ops.scatter_, []

    def flaky(plan, bits, backend=None):
        calls.append(plan)
        real(plan, bits, backend)
        if len(calls) == fail_at:
            raise RuntimeError("injected")

    monkeypatch.setattr(engine_mod.scatter_ops, "scatter_", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        eng.patch(staged)
    assert not staged.written
    assert _equal(w.bits(), before)
    monkeypatch.setattr(engine_mod.scatter_ops, "scatter_", real)
    eng.patch(staged)
    assert _equal(w.bits(), w.expected(w.changes[1]))


@pytest.mark.parametrize("device,backend", cases())
def test_stale_stage_refused(tmp_path, device, backend):
    need(device, backend)
    w = World("identity", device)
    w.step(seed=1)
    w.write(tmp_path / "v1.safetensors", 1, "compact")
    eng = w.engine(backend)
    a = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
    b = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
    eng.patch(a)
    with pytest.raises(NotSuccessorError):
        eng.patch(b)
    eng.rollback(a)
    eng.patch(b)  # staged against the state that is live again
    assert _equal(w.bits(), w.expected(w.changes[1]))
    eng.rollback(b)
    assert _equal(w.bits(), w.expected())


@pytest.mark.parametrize("device,backend", cases())
def test_rollback_after_another_writer(tmp_path, device, backend):
    """The vLLM helper may write a staged update through vLLM's own path, then roll back with ours."""
    need(device, backend)
    w = World("qwen3", device)
    w.step()
    w.write(tmp_path / "v1.safetensors", 1, "compact")
    eng = w.engine(backend)
    before = w.bits()
    staged = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
    reference_apply(w.targets, w.layout, w.changes[1])  # "another writer"
    eng.rollback(staged)
    assert _equal(w.bits(), before)
    # the per-target view of a plan (either form) addresses exactly the staged elements
    eng.patch(staged)
    for plan, new in zip(staged.plans, staged.new_bits):
        n = 0
        for t, offs, slots in plan.local_elements():
            assert torch.equal(plans.flat_bits(w.targets[t])[offs], new[slots])
            n += offs.numel()
        assert n == plan.nnz
    eng.rollback(staged)
    assert _equal(w.bits(), before)


def test_cpu_default_backend_is_torch_grouped():
    w = World("identity", "cpu")
    eng = ApplyEngine(dict(zip(w.layout.targets, w.targets)), w.layout, "cpu")
    assert eng.backend == "torch" and not eng.fused


@pytest.mark.gpu
def test_gpu_default_backend_and_side_stream(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    w = World("qwen3", "cuda")
    w.step()
    w.write(tmp_path / "v1.safetensors", 1, "compact")
    eng = ApplyEngine(dict(zip(w.layout.targets, w.targets)), w.layout)
    assert eng.backend == scatter_ops.available_backends("cuda")[0] and eng.fused
    staged = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
    assert staged.memory["device_held_bytes"] == staged.bytes
    eng.patch(staged)
    assert _equal(w.bits(), w.expected(w.changes[1]))


def test_hf_view_roundtrip():
    w = World("shards", "cpu")
    for name in ("w", "t", "q", "k"):
        r, c = hf_2d(w.layout.hf_shapes[name])
        seg = w.layout.segments[name][0]
        got = hf_view(w.layout, w.targets, name).reshape(r, c)
        want = w.hf[0][name].reshape(r, c)
        sl = (slice(seg.row0, seg.row0 + seg.rows), slice(seg.col0, seg.col0 + seg.cols))
        assert torch.equal(bit_view(got[sl]), bit_view(want[sl])), name
    assert torch.equal(
        apply_diffs(torch.tensor([32767], dtype=torch.int16), torch.tensor([1])),
        torch.tensor([-32768], dtype=torch.int16),
    )


def test_a_version_of_another_dtype_is_refused_even_at_the_same_element_size(tmp_path):
    """float16 bits written into bf16 parameters would pass an element-size check, and the checksum (over
    bits) would agree with the version's header: the engine compares real dtypes."""
    from vllm_delta.errors import ShapeMismatchError

    shapes = {"w": (8, 16), "n": (16,)}
    targets = {"w": torch.zeros(8, 16, dtype=torch.bfloat16), "n": torch.ones(16, dtype=torch.bfloat16)}
    engine = ApplyEngine(targets, Layout.identity(shapes), torch.device("cpu"))
    anchor = {"w": torch.randn(8, 16).to(torch.float16), "n": torch.ones(16, dtype=torch.float16)}
    path = str(tmp_path / "f16.safetensors")
    header = write_anchor(path, 1, anchor)
    with pytest.raises(ShapeMismatchError, match=r"dtype F16 .* tensor 'w'"):
        engine.check_header(header)
    with pytest.raises(ShapeMismatchError, match="dtype F16"):
        engine.stage([VersionFile(path)])
    assert torch.equal(targets["w"], torch.zeros(8, 16, dtype=torch.bfloat16))  # nothing written


@pytest.mark.parametrize("device,backend", cases())
def test_stage_phases_wait_for_the_device_only_when_asked(tmp_path, device, backend, monkeypatch):
    """The engine's phase spans wait for its stream only with VLLM_DELTA_STAGE_TIMING=sync; the same
    staged bits and partials either way, every phase timed either way."""
    from vllm_delta.apply import staging

    need(device, backend)
    w = World("qwen3", device)
    w.step()
    w.write(tmp_path / "v1.safetensors", 1, "chunked", frame_elems=37)
    out = {}
    for mode in ("", "sync"):
        monkeypatch.setenv(staging.PHASE_TIMING_ENV, mode)
        eng = w.engine(backend, block=32, chunk_elems=200)
        assert eng.phase_waits == (mode == "sync")
        calls: list[int] = []
        real = eng.sync_stream
        monkeypatch.setattr(eng, "sync_stream", lambda calls=calls, real=real: (calls.append(1), real())[1])
        staged = eng.stage([VersionFile(tmp_path / "v1.safetensors")])
        assert {"decode", "translate", "gather", "partials", "plan", "total"} <= set(staged.timings)
        out[mode] = (len(calls), staged.partials, [b.clone() for b in staged.new_bits])
    assert out[""][0] == 1 < out["sync"][0]  # by default: the one wait before the partials are read
    assert out[""][1] == out["sync"][1]
    assert all(torch.equal(a, b) for a, b in zip(out[""][2], out["sync"][2]))
