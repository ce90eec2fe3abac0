"""Replay a store's chain (anchor + deltas) into full tensors, checked against every checksum.

Used by `vllm-delta materialize` to write an HF-loadable safetensors directory, and by anyone who
needs the exact weights of a version without a server.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from .apply.engine import ApplyEngine, verify_partials
from .apply.layout import Layout
from .checksum import tensor_sum, to_hex
from .errors import ChecksumMismatchError, NotSuccessorError
from .format import VersionFile
from .store import DeltaStore

SHARD_BYTES = 5 << 30


def check_anchor(vf: VersionFile, tensors: dict[str, torch.Tensor]) -> None:
    for name, entry in vf.header.tensors.items():
        got = to_hex(tensor_sum(tensors[name]))
        if got != entry.checksum:
            raise ChecksumMismatchError(
                f"anchor tensor has checksum {got}, header says {entry.checksum}", version=vf.version, tensor=name
            )


def check_successor(vf: VersionFile, held_version: int, held_checksum: str) -> None:
    h = vf.header
    if h.base != held_version:
        raise NotSuccessorError(f"delta applies to version {h.base}, not {held_version}", version=h.version)
    if h.base_checksum != held_checksum:
        raise NotSuccessorError(
            f"delta's base checksum {h.base_checksum} differs from version {held_version}'s {held_checksum}",
            version=h.version,
        )


def replay(store: DeltaStore, version: int | str = "latest", *, progress: bool = False) -> tuple[int, dict]:
    """(version, {HF name: tensor}) of `version`, bit-exact, every checksum verified on the way."""
    target = store.resolve(version)
    chain = store.chain(target)
    bar = tqdm(chain, desc=f"replay v{target}", unit="version", disable=not progress)
    anchor = store.open(chain[0].version)
    tensors = {name: anchor.dense(name).clone() for name in anchor.header.tensors}
    check_anchor(anchor, tensors)
    held, sums = anchor.header, {n: int(e.checksum, 16) for n, e in anchor.header.tensors.items()}
    engine = ApplyEngine(tensors, Layout.identity({n: tuple(t.shape) for n, t in tensors.items()}), device="cpu")
    bar.update(1)
    for rec in chain[1:]:
        vf = store.open(rec.version)
        check_successor(vf, held.version, held.checksum)
        staged = engine.stage([vf])
        verify_partials(sums, [staged.partials], vf.header)
        engine.commit(staged)
        held, sums = vf.header, {n: int(e.checksum, 16) for n, e in vf.header.tensors.items()}
        bar.update(1)
    bar.close()
    return target, tensors


def materialize(store: DeltaStore, version: int | str, out_dir: str, *, progress: bool = True) -> str:
    """Write version `version` as an HF safetensors directory (plus stored assets) at `out_dir`.

    Everything is written to a temporary sibling directory first; `out_dir` appears only complete,
    and a failure leaves it untouched."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    target, tensors = replay(store, version, progress=progress)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".materialize-", dir=parent)
    try:
        _write_shards(tmp, tensors, {"format": "pt", "vllm_delta_version": str(target)})
        for name in store.assets():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(store.get_asset(name))
        if os.path.exists(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_shards(directory: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
