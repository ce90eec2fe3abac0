"""Full Hugging Face tensors of a store version, one tensor at a time (what the "delta" loader feeds vLLM).

Streaming per tensor keeps the host memory of a load at one tensor beyond the memory-mapped
version files, instead of a whole extra copy of the model. Every tensor is checked against the
checksum its version header records before it is handed out. No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .. import codec as codecs
from ..checksum import tensor_sum, to_hex
from ..errors import ChecksumMismatchError, FormatError, ShapeMismatchError
from ..format import VersionFile
from ..store import DeltaStore


def open_chain(store: DeltaStore, version: int) -> list[VersionFile]:
    """The version files to replay for `version`, anchor first, each checked against its record."""
    files = [store.open(rec.version) for rec in store.chain(version)]
    if files[0].header.kind != "anchor":
        raise FormatError("a chain must start with an anchor", version=files[0].version)
    return files


def replay_tensor(files: list[VersionFile], name: str) -> torch.Tensor:
    """One tensor at the last file's version: the anchor's values with every delta applied in order."""
    anchor = files[0]
    entry = files[-1].header.tensors.get(name)
    if entry is None or name not in anchor.header.tensors:
        raise FormatError("tensor missing from the chain", version=files[-1].version, tensor=name)
    out = anchor.dense(name).clone()
    flat = codecs.int_view(out).reshape(-1)
    for vf in files[1:]:
        e = vf.header.tensors.get(name)
        if e is None:
            raise FormatError("delta does not list the tensor", version=vf.version, tensor=name)
        if list(e.shape) != list(out.shape):
            raise ShapeMismatchError(f"shape {e.shape} != {list(out.shape)}", version=vf.version, tensor=name)
        if not e.nnz:
            continue
        ctx = {"version": vf.version, "tensor": name}
        changes = codecs.decode(
            vf.header.codec, vf.parts(name), e.enc, numel=e.numel, nnz=e.nnz, dtype=e.torch_dtype, ctx=ctx
        )
        flat[changes.positions] = changes.new_bits(flat[changes.positions])
    got = to_hex(tensor_sum(out))
    if got != entry.checksum:
        raise ChecksumMismatchError(
            f"replayed tensor has checksum {got}, the header records {entry.checksum}",
            version=files[-1].version,
            tensor=name,
        )
    return out


def iter_version(files: list[VersionFile], names=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the last file's version (or only `names`)."""
    for name in names if names is not None else files[-1].header.tensors:
        yield name, replay_tensor(files, name)
