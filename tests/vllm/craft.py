"""Hand-made versions for the error tests: valid deltas, and deltas broken in one precise way."""

from __future__ import annotations

import os
import tempfile

import torch

from vllm_delta.bits import int_view
from vllm_delta.checksums import MASK64, positional_sum, tensor_sum
from vllm_delta.format import write
from vllm_delta.reconstruct import replay
from vllm_delta.store import DeltaStore
from vllm_delta.writer import encode_anchor, encode_delta


def publish_delta(
    store_path: str,
    base: int,
    version: int,
    *,
    tensor: str,
    positions: list[int],
    codec: str = "compact",
    wrong_checksum: bool = False,
) -> dict:
    """A delta on `base` moving `positions` of `tensor` one ULP up. `wrong_checksum` records a per-tensor
    checksum that does not match the payload (a publisher bug or tampering). Returns its record as a dict."""
    store = DeltaStore(store_path)
    _, tensors = replay(store, base, progress=False)
    base_checksum = store.record(base).checksum
    sums = {n: tensor_sum(t) for n, t in tensors.items()}
    old_img = tensors[tensor]
    flat_old = int_view(old_img).reshape(-1)
    pos = torch.tensor(sorted(positions), dtype=torch.int64)
    numel = flat_old.numel()
    in_range = pos[pos < numel]
    old = flat_old[in_range]
    new = (old.to(torch.int32) + 1).to(torch.int16)
    if in_range.numel() != pos.numel():  # out-of-range positions: only the raw codec can even write them
        old = torch.cat([old, torch.zeros(pos.numel() - in_range.numel(), dtype=torch.int16)])
        new = torch.cat([new, torch.ones(pos.numel() - in_range.numel(), dtype=torch.int16)])
    sums[tensor] = (
        sums[tensor]
        + positional_sum(new[: in_range.numel()], in_range)
        - positional_sum(old[: in_range.numel()], in_range)
    ) & MASK64
    if wrong_checksum:
        sums[tensor] = (sums[tensor] + 12345) & MASK64
    header, payload = encode_delta(
        version=version,
        base=base,
        base_checksum=base_checksum,
        codec=codec,
        shapes={n: tuple(t.shape) for n, t in tensors.items()},
        dtypes={n: t.dtype for n, t in tensors.items()},
        changes={tensor: (pos, new, old)},
        sums=sums,
    )
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    write(path, header, payload)
    rec = store.writer.commit_file(header, path, move=True)
    return {"version": rec.version, "file": os.path.join(store_path, rec.file), "checksum": rec.checksum}


def publish_delta_adding(store_path: str, base: int, version: int, *, extra: dict[str, torch.Tensor]) -> dict:
    """A delta on `base` that leaves every tensor unchanged and adds `extra` (bf16) tensors the base
    does not have: a trainer publishing a tensor the served model has no parameter for."""
    store = DeltaStore(store_path)
    _, tensors = replay(store, base, progress=False)
    sums = {n: tensor_sum(t) for n, t in tensors.items()}
    changes = {}
    for name, t in extra.items():
        new = int_view(t.to(torch.bfloat16)).reshape(-1)
        changes[name] = (torch.arange(new.numel(), dtype=torch.int64), new, torch.zeros_like(new))
        sums[name] = tensor_sum(t.to(torch.bfloat16))
    header, payload = encode_delta(
        version=version,
        base=base,
        base_checksum=store.record(base).checksum,
        codec="compact",
        shapes={**{n: tuple(t.shape) for n, t in tensors.items()}, **{n: tuple(t.shape) for n, t in extra.items()}},
        dtypes={**{n: t.dtype for n, t in tensors.items()}, **{n: torch.bfloat16 for n in extra}},
        changes=changes,
        sums=sums,
    )
    return _publish(store, header, payload)


def publish_anchor(store_path: str, version: int, tensors: dict[str, torch.Tensor]) -> dict:
    """An anchor holding exactly `tensors` (bf16), e.g. the weights of a differently shaped model."""
    images = {n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()}
    header, payload = encode_anchor(version, images, {n: tensor_sum(t) for n, t in images.items()})
    return _publish(DeltaStore(store_path), header, payload)


def _publish(store: DeltaStore, header, payload) -> dict:
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    write(path, header, payload)
    rec = store.writer.commit_file(header, path, move=True)
    return {"version": rec.version, "checksum": rec.checksum}


def truncate(path: str, keep: int = 100) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def flip_tail_bytes(path: str, n: int = 8) -> None:
    """Damage the end of the file (the last tensor's payload) without changing its size."""
    with open(path, "r+b") as f:
        f.seek(-n, os.SEEK_END)
        data = f.read(n)
        f.seek(-n, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in data))
