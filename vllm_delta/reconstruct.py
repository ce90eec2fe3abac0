"""Replay a store's chain (anchor + deltas) into full tensors, checked against every checksum.

One tensor at a time (`iter_version`): the host memory of a replay is one tensor beyond the
memory-mapped version files. Used by the "delta" load format of the vLLM plugin, by
`vllm-delta materialize` (an HF-loadable safetensors directory) and by anyone who needs the exact
weights of a version without a server.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from . import codec as codecs
from .bits import int_view
from .checksums import combine, tensor_sum, to_hex
from .errors import ChecksumMismatchError, FormatError, ShapeMismatchError
from .format import VersionHeader, VersionLike
from .store import DeltaStore, VersionRecord

SHARD_BYTES = 5 << 30


def open_chain(store: DeltaStore, version: int, *, records: list[VersionRecord] | None = None) -> list[VersionLike]:
    """The versions to replay for `version` (one file or several parts each), anchor first, each
    checked against its record (`records`: the chain as the caller read and checked it)."""
    chain = records if records is not None else store.chain(version)
    files = [store.open(rec.version, record=rec) for rec in chain]
    if files[0].header.kind != "anchor":
        raise FormatError("a chain must start with an anchor", version=files[0].version)
    return files


def replay_tensor(files: list[VersionLike], name: str) -> torch.Tensor:
    """One tensor at the last file's version: the anchor's values with every delta applied in order."""
    anchor = files[0]
    entry = files[-1].header.tensors.get(name)
    if entry is None or name not in anchor.header.tensors:
        raise FormatError("tensor missing from the chain", version=files[-1].version, tensor=name)
    out = anchor.dense(name).clone()
    flat = int_view(out).reshape(-1)
    for vf in files[1:]:
        e = vf.header.tensors.get(name)
        if e is None:
            raise FormatError("delta does not list the tensor", version=vf.version, tensor=name)
        if list(e.shape) != list(out.shape):
            raise ShapeMismatchError(f"shape {e.shape} != {list(out.shape)}", version=vf.version, tensor=name)
        if not e.nnz:
            continue
        ctx = {"version": vf.version, "tensor": name}
        for piece in vf.pieces(name):  # one per part that changed the tensor; disjoint positions
            changes = codecs.decode(
                vf.header.codec or "",
                piece.payload,
                piece.enc,
                numel=e.numel,
                nnz=piece.nnz,
                dtype=e.torch_dtype,
                ctx=ctx,
            )
            codecs.check_piece(changes.positions, piece.start, piece.stop, ctx)
            flat[changes.positions] = changes.new_bits(flat[changes.positions])
    got = to_hex(tensor_sum(out))
    if got != entry.checksum:
        raise ChecksumMismatchError(
            f"replayed tensor has checksum {got}, the header records {entry.checksum}",
            version=files[-1].version,
            tensor=name,
        )
    return out


def verify_payload(vf: VersionLike) -> None:
    """Check one version's payload on its own, without its base: an anchor's tensors against their
    checksums, a delta's pieces decoded (the compact codec's zstd frames carry content checksums) with
    every position in its part's rows. What a copy can check of a file whose record has no sha256."""
    header = vf.header
    for name, e in header.tensors.items():
        if header.kind == "anchor":
            got = to_hex(tensor_sum(vf.dense(name)))
            if got != e.checksum:
                raise ChecksumMismatchError(
                    f"stored tensor has checksum {got}, the header records {e.checksum}",
                    version=header.version,
                    tensor=name,
                )
            continue
        if not e.nnz:
            continue
        ctx = {"version": header.version, "tensor": name}
        for piece in vf.pieces(name):
            changes = codecs.decode(
                header.codec or "", piece.payload, piece.enc, numel=e.numel, nnz=piece.nnz, dtype=e.torch_dtype, ctx=ctx
            )
            codecs.check_piece(changes.positions, piece.start, piece.stop, ctx)


def iter_version(files: list[VersionLike], names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the last file's version (or only `names`)."""
    for name in names if names is not None else files[-1].header.tensors:
        yield name, replay_tensor(files, name)


def _checked_stream(files: list[VersionLike], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_version`, with a progress bar, ending with the whole-model checksum check."""
    header = files[-1].header
    sums = []
    bar = tqdm(total=len(header.tensors), desc=f"replay v{header.version}", unit="tensor", disable=not progress)
    for name, t in iter_version(files):
        sums.append((name, tensor_sum(t)))
        bar.update(1)
        yield name, t
    bar.close()
    got = to_hex(combine(sums))
    if got != header.checksum:
        raise ChecksumMismatchError(
            f"replayed model has checksum {got}, the header records {header.checksum}", version=header.version
        )


def replay(
    store: DeltaStore, version: int | str = "latest", *, progress: bool = False
) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, {HF name: tensor}) of `version`, bit-exact, every tensor and the whole model checked."""
    target = store.resolve(version)
    return target, dict(_checked_stream(open_chain(store, target), progress))


def materialize(store: DeltaStore, version: int | str, out_dir: str, *, progress: bool = True) -> str:
    """Write version `version` as an HF safetensors directory (plus stored assets) at `out_dir`.

    Tensors stream into shards of at most 5 GB, so memory stays at one shard. Everything is written
    to a temporary sibling directory first; `out_dir` appears only complete and verified, and a
    failure leaves it untouched."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    target = store.resolve(version)
    files = open_chain(store, target)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".materialize-", dir=parent)
    try:
        _write_shards(tmp, files[-1].header, _checked_stream(files, progress), {"format": "pt"})
        for name in store.objects.assets():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(store.objects.get_asset(name))
        if os.path.exists(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_shards(
    directory: str, header: VersionHeader, tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict[str, str]
) -> None:
    """Group tensors (in header order) into shards of at most SHARD_BYTES, written as they fill."""
    sizes = {n: e.numel * e.torch_dtype.itemsize for n, e in header.tensors.items()}
    groups: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes.items():
        if groups[-1] and filled + nbytes > SHARD_BYTES:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    fnames = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    shard_of = {name: i for i, group in enumerate(groups) for name in group}
    shard: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        shard[name] = t.contiguous()
        i = shard_of[name]
        if len(shard) == len(groups[i]):
            save_file(shard, os.path.join(directory, fnames[i]), metadata=metadata)
            shard = {}
    if len(groups) > 1:
        weight_map = {name: fnames[i] for name, i in shard_of.items()}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
