"""Fused scatter/gather kernels against the torch reference (grouped plans, index_copy_): bit-exact."""

from __future__ import annotations

import pytest
import torch
from apply_cases import cases, need

from vllm_delta.apply import plans as P
from vllm_delta.apply import scatter as S


def _targets(device, sizes, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype).to(device) for n in sizes]


def _pairs(sizes, k, seed, device, interleave=False):
    """k unique (target, offset) pairs, shuffled (any order), or interleaved between targets."""
    gen = torch.Generator().manual_seed(seed)
    ids, offs = [], []
    for t, n in enumerate(sizes):
        m = min(k, n)
        ids.append(torch.full((m,), t, dtype=torch.int64))
        offs.append(torch.randperm(n, generator=gen)[:m])
    ids, offs = torch.cat(ids), torch.cat(offs)
    perm = (
        torch.randperm(ids.numel(), generator=gen)
        if not interleave
        else torch.argsort(
            torch.cat([torch.arange(x.numel()) for x in torch.split(ids, [min(k, n) for n in sizes])]), stable=True
        )
    )
    return ids[perm].to(device), offs[perm].to(device)


def _bits(t):
    return P.flat_bits(t).clone()


@pytest.mark.parametrize("device,backend", cases())
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_scatter_gather_match_reference(device, backend, block, interleave, dtype):
    need(device, backend)
    sizes = [1000, 37, 5000, 1]
    ref = _targets(device, sizes, dtype)
    got = [t.clone() for t in ref]
    ids, offs = _pairs(sizes, 300, seed=block, device=device, interleave=interleave)
    gen = torch.Generator().manual_seed(1)
    new = torch.randint(-(2**15), 2**15, (ids.numel(),), generator=gen).to(P.flat_bits(ref[0]).dtype).to(device)

    want_old = torch.empty_like(new)
    for t in range(len(sizes)):
        m = ids == t
        want_old[m] = P.flat_bits(ref[t])[offs[m]]
    grouped = P.build_plan(ref, ids, offs)
    assert torch.equal(S.gather(grouped), grouped.arrange(want_old))
    S.scatter_(grouped, grouped.arrange(new))

    plan = P.build_fused_plan(got, ids, offs, block=block)
    assert plan.nnz == ids.numel() and plan.size % block == 0
    assert plan.rel.dtype == torch.int32
    old = S.gather(plan, backend)
    # same old bits, element by element (plan orders differ: compare in caller order)
    assert torch.equal(old[plan.slots], want_old)
    assert torch.equal(old[plan.rel < 0], torch.zeros_like(old[plan.rel < 0]))  # padding gathers 0
    S.scatter_(plan, plan.arrange(new), backend)
    for a, b in zip(ref, got):
        assert torch.equal(_bits(a), _bits(b))
    # rollback through the same kernel restores the previous bits exactly
    S.scatter_(plan, old, backend)
    base = _targets(device, sizes, dtype)
    for a, b in zip(base, got):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("device,backend", cases())
def test_int64_offsets_path(device, backend):
    need(device, backend)
    sizes = [3000, 200]
    ref = _targets(device, sizes)
    got = [t.clone() for t in ref]
    ids, offs = _pairs(sizes, 150, seed=3, device=device)
    new = torch.arange(ids.numel(), dtype=torch.int16, device=device)
    S.scatter_(g := P.build_plan(ref, ids, offs), g.arrange(new))
    plan = P.build_fused_plan(got, ids, offs, block=32, rel_dtype=torch.int64)
    assert plan.rel.dtype == torch.int64
    S.scatter_(plan, plan.arrange(new), backend)
    for a, b in zip(ref, got):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("device,backend", cases())
def test_concatenated_plans(device, backend):
    need(device, backend)
    sizes = [500, 800, 90]
    ref = _targets(device, sizes)
    got = [t.clone() for t in ref]
    ids, offs = _pairs(sizes, 80, seed=5, device=device)
    new = torch.randint(-100, 100, (ids.numel(),), dtype=torch.int16).to(device)
    S.scatter_(g := P.build_plan(ref, ids, offs), g.arrange(new))
    base = min(range(3), key=lambda i: got[i].data_ptr())
    cut = [0, 70, 71, ids.numel()]
    parts = [P.build_fused_plan(got, ids[a:b], offs[a:b], block=16, base_index=base) for a, b in zip(cut, cut[1:])]
    plan = P.cat_plans(parts)
    bits = torch.cat([p.arrange(new[a:b]) for p, a, b in zip(parts, cut, cut[1:])])
    S.scatter_(plan, bits, backend)
    for a, b in zip(ref, got):
        assert torch.equal(_bits(a), _bits(b))


def test_out_of_range_and_bad_args():
    t = [torch.zeros(10, dtype=torch.bfloat16)]
    with pytest.raises(IndexError):
        P.build_fused_plan(t, torch.tensor([0]), torch.tensor([10]))
    with pytest.raises(IndexError):
        P.build_fused_plan(t, torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError):
        P.build_fused_plan(t, torch.tensor([0]), torch.tensor([0]), block=12)
    plan = P.build_fused_plan(t, torch.tensor([0]), torch.tensor([3]), block=16)
    with pytest.raises(ValueError):
        S.scatter_(plan, torch.zeros(3, dtype=torch.int16), "torch")
    with pytest.raises(ValueError):
        P.build_fused_plan(
            [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)], torch.tensor([0, 1]), torch.tensor([0, 0])
        )
    empty = P.build_fused_plan(t, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert empty.size == 0 and empty.nnz == 0
    S.scatter_(empty, torch.zeros(0, dtype=torch.int16), "torch")


@pytest.mark.parametrize("device,backend", [c for c in cases() if "torch" not in c.id])
def test_gather_at(device, backend):
    need(device, backend)
    ts = _targets(device, [100, 300, 7])
    b, deltas = P.address_base([P.flat_bits(t) for t in ts])
    ids = torch.tensor([2, 0, 1, 1, 2, 0])
    offs = torch.tensor([6, 99, 0, 299, 0, 5])
    addr = (torch.tensor(deltas)[ids] + offs).to(device)
    got = S.gather_at(P.flat_bits(ts[b]), addr, backend)
    want = torch.stack([P.flat_bits(ts[i])[o] for i, o in zip(ids.tolist(), offs.tolist())])
    assert torch.equal(got, want)


def _huge(device):
    n = (1 << 31) + (1 << 20)
    try:
        return torch.empty(n, dtype=torch.bfloat16, device=device)  # CPU: untouched pages cost nothing
    except (RuntimeError, MemoryError) as exc:
        pytest.skip(f"can't allocate a 2^31+ element tensor here: {exc}")


@pytest.mark.parametrize("device,backend", cases())
def test_targets_over_2_31_elements(device, backend):
    """Real int64 addressing: a target of more than 2^31 elements, written near and past 2^31."""
    need(device, backend)
    big = _huge(device)
    small = torch.zeros(64, dtype=torch.bfloat16, device=device)
    flat = P.flat_bits(big)
    n = flat.numel()
    # block 1: offsets clustered above 2^31 (int32 relative offsets, int64 block base);
    # block 2: one block spanning more than 2^31 elements (int64 relative offsets).
    clustered = torch.tensor([(1 << 31) + 5, (1 << 31) - 3, (1 << 31) + 70000, n - 1])
    spread = torch.tensor([0, 17, (1 << 31) + 12345, n - 2])
    for offs, wide in ((clustered, False), (spread, True)):
        ids = torch.cat([torch.zeros(offs.numel(), dtype=torch.int64), torch.ones(2, dtype=torch.int64)])
        offs_all = torch.cat([offs, torch.tensor([0, 63])])
        plan = P.build_fused_plan([big, small], ids.to(device), offs_all.to(device), block=16)
        assert (plan.rel.dtype == torch.int64) == wide
        neighbours = torch.stack([flat[o - 1] for o in offs.tolist()] + [flat[offs[0] + 1]]).clone()
        new = torch.arange(1, ids.numel() + 1, dtype=torch.int16, device=device) * 7
        old = S.gather(plan, backend)
        S.scatter_(plan, plan.arrange(new), backend)
        got = torch.stack([flat[o] for o in offs.tolist()] + [P.flat_bits(small)[0], P.flat_bits(small)[63]])
        assert torch.equal(got, new)
        after = torch.stack([flat[o - 1] for o in offs.tolist()] + [flat[offs[0] + 1]])
        assert torch.equal(after, neighbours)
        S.scatter_(plan, old, backend)
        assert torch.equal(S.gather(plan, backend), old)
    del big


@pytest.mark.parametrize("interleave", [False, True])
def test_fused_plan_from_host_runs_is_the_plan_found_on_the_device(interleave):
    """The engine hands fused_plan the runs of equal target ids from the chunk's tensors (host
    arrays): the plan is the one found on the device, field by field, with no device-to-host wait."""
    import numpy as np

    from vllm_delta.apply.layout import TargetRuns

    sizes = [1000, 37, 5000, 1]
    got = _targets("cpu", sizes)
    ids, offs = _pairs(sizes, 300, seed=2, device="cpu", interleave=interleave)
    if not interleave:  # sorted by target, as a decoded chunk's elements are: long runs
        order = torch.argsort(ids, stable=True)
        ids, offs = ids[order], offs[order]
    found = P.build_fused_plan(got, ids, offs, block=16)
    change = np.flatnonzero(np.r_[True, ids.numpy()[1:] != ids.numpy()[:-1]])
    lengths = np.diff(np.r_[change, ids.numel()])
    split = np.repeat(lengths, 2) // 2  # each run cut in two: the host's runs are merged again
    split[1::2] = lengths - split[0::2]
    runs = TargetRuns.merged(np.repeat(ids.numpy()[change], 2), split)
    flats = [P.flat_bits(t) for t in got]
    b, tbase = P.address_base(flats)
    given = P.fused_plan(flats, flats[b], tbase, torch.tensor(tbase), ids, offs, block=16, runs=runs)
    device = P.fused_plan(flats, flats[b], tbase, torch.tensor(tbase), ids, offs, block=16)
    assert np.array_equal(given.bounds, device.bounds)
    for field in ("block_base", "rel", "slots"):
        assert torch.equal(getattr(given, field), getattr(device, field)), field
    assert given.count == device.count == ids.numel()
    with pytest.raises(ValueError, match="runs given hold"):
        P.fused_plan(
            flats,
            flats[b],
            tbase,
            torch.tensor(tbase),
            ids,
            offs,
            block=16,
            runs=TargetRuns.merged(runs[0], runs[1] + 1),
        )
    assert np.array_equal(found.bounds[:, 0], device.bounds[:, 0])


def test_target_runs_merge_adjacent_runs_of_one_target_and_drop_empty_ones():
    import numpy as np

    from vllm_delta.apply.layout import TargetRuns

    r = TargetRuns.merged(np.array([3, 3, 1, 1, 3, 2, 2]), np.array([2, 5, 0, 4, 1, 0, 6]))
    assert r.targets.tolist() == [3, 1, 3, 2] and r.lengths.tolist() == [7, 4, 1, 6]
    empty = TargetRuns.merged(np.array([1]), np.array([0]))
    assert empty.targets.size == 0 and empty.lengths.size == 0
