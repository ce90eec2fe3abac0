import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vllm_delta
from vllm_delta import checksums as checksum_mod
from vllm_delta.checksums import combine, name_key, positional_sum, tensor_sum, to_hex

K = 0x9E3779B97F4A7C15
M = 1 << 64


def reference_sum(t: torch.Tensor) -> int:
    """docs/FORMAT.md's definition, in Python integers."""
    width = t.element_size() * 8
    ints = t.reshape(-1).view({16: torch.int16, 32: torch.int32}[width]).tolist()
    return sum(((p + 1) * K % M) * ((b & ((1 << width) - 1)) + 1) for p, b in enumerate(ints)) % M


def reference_checksum(named: dict) -> str:
    total = 0
    for name, t in named.items():
        key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1
        total = (total + key * reference_sum(t)) % M
    return f"{total:016x}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference_definition(dtype):
    torch.manual_seed(0)
    named = {"a": torch.randn(7, 13).to(dtype), "b.weight": torch.randn(300).to(dtype) * 1e4}
    assert vllm_delta.checksum(named) == reference_checksum(named)
    assert checksum_mod.checksum(named) == reference_checksum(named)


def test_chunked_sum_equals_reference(monkeypatch):
    monkeypatch.setattr(checksum_mod, "_CHUNK", 64)  # force many chunks
    t = torch.randn(1000).to(torch.bfloat16)
    assert tensor_sum(t) == reference_sum(t)


@given(st.integers(1, 200), st.integers(1, 5), st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_shard_partial_sums_add_up(numel, shards, seed):
    torch.manual_seed(seed)
    t = torch.randn(numel).to(torch.bfloat16)
    cuts = sorted(torch.randint(0, numel + 1, (shards - 1,)).tolist())
    bounds = [0, *cuts, numel]
    parts = [positional_sum(t[a:b], a) for a, b in zip(bounds, bounds[1:])]
    assert sum(parts) % M == tensor_sum(t)
    # scattered shards: explicit positions in any order
    perm = torch.randperm(numel)
    half = numel // 2
    assert (positional_sum(t[perm[:half]], perm[:half]) + positional_sum(t[perm[half:]], perm[half:])) % M == (
        tensor_sum(t)
    )
    # whole-model combination is the same over shards
    assert combine([("x", p) for p in parts]) == combine([("x", tensor_sum(t))])


@given(st.integers(1, 500), st.integers(0, 2**31), st.integers(1, 0xFFFF))
@settings(max_examples=50, deadline=None)
def test_any_single_element_change_is_detected(numel, seed, delta):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(numel, generator=g).to(torch.bfloat16)
    i = int(torch.randint(0, numel, (1,), generator=g))
    u = t.clone()
    bits = u.view(torch.int16)
    changed = ((int(bits[i]) & 0xFFFF) + delta) % 0x10000
    bits[i] = changed - 0x10000 if changed >= 0x8000 else changed
    assert not torch.equal(t.view(torch.int16), u.view(torch.int16))
    assert tensor_sum(t) != tensor_sum(u)


def test_order_names_and_swaps():
    a, b = torch.randn(50).to(torch.bfloat16), torch.randn(50).to(torch.bfloat16)
    assert vllm_delta.checksum({"a": a, "b": b}) == vllm_delta.checksum([("b", b), ("a", a)])
    assert vllm_delta.checksum({"a": a, "b": b}) != vllm_delta.checksum({"a": b, "b": a})
    swapped = a.clone()
    swapped[[3, 17]] = a[[17, 3]]
    assert not torch.equal(swapped, a)
    assert tensor_sum(swapped) != tensor_sum(a)
    assert name_key("a") % 2 == 1 and name_key("a") != name_key("b")


def test_signed_zero_and_nan_payloads_differ():
    z = torch.zeros(4, dtype=torch.bfloat16)
    nz = -z
    assert to_hex(tensor_sum(z)) != to_hex(tensor_sum(nz))


def test_rejects_non_float():
    with pytest.raises(TypeError):
        vllm_delta.checksum({"a": torch.arange(4)})


def test_the_parts_checksums_add_up_to_the_whole():
    """A multi-part version's rule (records and part files check it): each part's checksum is
    Σ_t key(t) · (partial sum of t over the rows it owns), and they add up to the whole's, mod 2^64."""
    g = torch.Generator().manual_seed(3)
    named = {"a": torch.randn(7, 5, generator=g).bfloat16(), "b": torch.randn(9, generator=g).bfloat16()}
    bounds = {"a": [0, 3, 7], "b": [0, 4, 9]}  # two parts: rows [0, 3) and [3, 7) of a, ...
    parts = []
    for i in range(2):
        partials = []
        for name, t in named.items():
            r0, r1 = bounds[name][i], bounds[name][i + 1]
            row = t[0].numel() if t.dim() > 1 else 1
            partials.append((name, positional_sum(t[r0:r1], r0 * row)))
        parts.append(to_hex(combine(partials)))
    assert checksum_mod.sum_of_parts(parts) == vllm_delta.checksum(named) == reference_checksum(named)
    assert checksum_mod.sum_of_parts(["ffffffffffffffff", "0000000000000002"]) == "0000000000000001"  # wraps
    assert checksum_mod.sum_of_parts([]) == "0000000000000000"


def test_stored_checksums_are_16_lower_case_hex_digits():
    assert checksum_mod.is_hex("0123456789abcdef")
    for bad in ["0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0", "0x23456789abcdef", 12, None]:
        assert not checksum_mod.is_hex(bad), bad


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=(1 << 64) - 1), min_size=0, max_size=40))
def test_combine_arrays_is_combine(values):
    """The publisher's uint64-array combine (no Python int per tensor) equals the definition, values at
    and above 2^63 included (where int64 would be negative)."""
    import numpy as np

    names = [f"model.layers.{i}.mlp.experts.{i % 7}.up_proj.weight" for i in range(len(values))]
    got = checksum_mod.combine_arrays(checksum_mod.name_keys(names), np.array(values, dtype=np.uint64))
    assert got == combine(zip(names, values))
