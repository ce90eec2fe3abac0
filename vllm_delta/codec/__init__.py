"""Codecs for the changed elements of a delta (layouts: docs/FORMAT.md; table: README.md here).

`chunked` (default; format 3)  every changed element of a file in one set of byte and bit planes,
                               cut into independent zstd chunks that a CPU or a GPU (nvCOMP) writes
                               and reads alike (chunked/)
`compact` (formats 1 and 2)    per tensor, gap and ULP-difference byte planes in zstd frames
                               (compact/)
`raw`                          int32/int64 positions + absolute values, the TRL baseline (raw.py)

The shared vocabulary (Changes, Sections, Batch, the checks) lives in base.py; the interface of a
server's staging decoder (pieces in, Chunks out) in decoding.py. Codecs are found by name through
the registry (registry.py: `get_codec`, `get_decoder`), which imports a codec's module the first
time its name is asked for; so does this package for the codecs' own names (`ChunkedCodec`, ...).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from .base import (
    Batch,
    BatchSections,
    Changes,
    Codec,
    Ctx,
    FileCodec,
    FilePayload,
    HostCopy,
    PassEncoder,
    Sections,
    check_piece,
    check_positions,
    err,
    position_dtype,
    segment_ids,
)
from .decoding import Chunk, CodecDecoder, DecodePlan, Fetch, FilePieces, FileSet, Item, Pieces, Runs, StagingHost
from .registry import DEFAULT_CODEC, get_codec, get_decoder, names, register_codec

if TYPE_CHECKING:  # imported on first use at run time (__getattr__ below)
    from .chunked import ChunkedCodec, ChunkedDecoder, FilePack, StreamEncoder
    from .compact import ZSTD_LEVEL, CompactCodec, CompactDecoder
    from .raw import RawCodec, RawDecoder

_LAZY = {  # name -> the codec's module that holds it
    "ChunkedCodec": "chunked",
    "ChunkedDecoder": "chunked",
    "FilePack": "chunked",
    "StreamEncoder": "chunked",
    "ZSTD_LEVEL": "compact",
    "CompactCodec": "compact",
    "CompactDecoder": "compact",
    "RawCodec": "raw",
    "RawDecoder": "raw",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def is_file_level(codec: Codec) -> TypeGuard[FileCodec]:
    """A codec whose payload covers every changed tensor of a file (format 3), not one tensor."""
    return bool(getattr(codec, "file_level", False))


def stream_encoder(
    codec: Codec, starts: list[int], tensors: Sequence[tuple[str, Sequence[int], int, int]] | None = None
) -> PassEncoder | None:
    """A codec's encoder for changes that arrive in passes (chunked: `StreamEncoder`), else None.
    `tensors`: each one's (name, shape, row0, row1), for a codec that lays files out by rank blocks."""
    make = getattr(codec, "stream", None)
    if make is None:
        return None
    encoder: PassEncoder = make(starts, tensors) if tensors is not None else make(starts)
    return encoder


def encode(
    codec: str, positions: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, numel: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One-shot encode of one tensor: returns (file tensors by suffix, JSON meta). A file-level codec
    gives the tensor's file as if it held that tensor alone (meta: its `enc` plus the file's under
    "file"), which `decode` reads back."""
    c = get_codec(codec)
    return c.pack(c.prepare(positions, new_bits, old_bits, numel), dtype)


def decode(
    codec: str,
    tensors: Mapping[str, torch.Tensor],
    meta: Any,
    *,
    numel: int,
    nnz: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    ctx: Ctx | None = None,
) -> Changes:
    """One-shot decode of one tensor's payload (one piece) into Changes on `device`."""
    ctx = ctx or {}
    c = get_codec(codec, ctx)
    return c.finish(
        c.unpack(tensors, meta, numel=numel, nnz=nnz, dtype=dtype, ctx=ctx), numel=numel, device=device, ctx=ctx
    )


__all__ = [
    "DEFAULT_CODEC",
    "ZSTD_LEVEL",
    "Batch",
    "BatchSections",
    "Changes",
    "ChunkedCodec",
    "ChunkedDecoder",
    "Chunk",
    "Codec",
    "CodecDecoder",
    "CompactCodec",
    "CompactDecoder",
    "Ctx",
    "DecodePlan",
    "Fetch",
    "FileCodec",
    "FilePack",
    "FilePayload",
    "FilePieces",
    "FileSet",
    "HostCopy",
    "Item",
    "PassEncoder",
    "Pieces",
    "RawCodec",
    "RawDecoder",
    "Sections",
    "Runs",
    "StagingHost",
    "StreamEncoder",
    "check_piece",
    "check_positions",
    "decode",
    "encode",
    "err",
    "get_codec",
    "get_decoder",
    "is_file_level",
    "names",
    "position_dtype",
    "register_codec",
    "segment_ids",
    "stream_encoder",
]
