"""Codecs for the changed elements of a delta (layouts: docs/FORMAT.md), one module per coder.

`chunked` (default; format 3)  every changed element of a file in one set of byte and bit planes,
                               cut into independent zstd chunks that a CPU or a GPU (nvCOMP) writes
                               and reads alike (chunked.py, gpu.py)
`compact` (formats 1 and 2)    per tensor, gap and ULP-difference byte planes in zstd frames
                               (compact.py)
`raw`                          int32/int64 positions + absolute values, the TRL baseline (raw.py)

The shared vocabulary (Changes, Sections, Batch, the checks) lives in base.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

import torch

from ..errors import CodecError
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
from .chunked import ChunkedCodec, FilePack, StreamEncoder
from .compact import (
    DIFF_ESCAPE,
    FRAME_ELEMS,
    GAP_ESCAPE,
    ZSTD_LEVEL,
    CompactCodec,
    Frame,
    FrameArrays,
    FrameOrder,
    decode_frames,
    decompress_frame,
    parse_frames,
    patch_escapes,
)
from .raw import RawCodec

DEFAULT_CODEC = "chunked"
CODECS: dict[str, Codec] = {"raw": RawCodec(), "compact": CompactCodec(), "chunked": ChunkedCodec()}


def get_codec(name: str, ctx: dict | None = None) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise err(CodecError, f"unknown codec {name!r} (known: {', '.join(CODECS)})", ctx or {}) from None


def is_file_level(codec: Codec) -> TypeGuard[FileCodec]:
    """A codec whose payload covers every changed tensor of a file (format 3), not one tensor."""
    return bool(getattr(codec, "file_level", False))


def stream_encoder(codec: Codec, starts: list[int]) -> PassEncoder | None:
    """A codec's encoder for changes that arrive in passes (chunked: `StreamEncoder`), else None."""
    make = getattr(codec, "stream", None)
    return make(starts) if make is not None else None


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
    "CODECS",
    "DEFAULT_CODEC",
    "DIFF_ESCAPE",
    "FRAME_ELEMS",
    "GAP_ESCAPE",
    "ZSTD_LEVEL",
    "Batch",
    "BatchSections",
    "Changes",
    "ChunkedCodec",
    "Codec",
    "CompactCodec",
    "Ctx",
    "FileCodec",
    "FilePack",
    "FilePayload",
    "Frame",
    "FrameArrays",
    "FrameOrder",
    "HostCopy",
    "PassEncoder",
    "RawCodec",
    "Sections",
    "StreamEncoder",
    "check_piece",
    "check_positions",
    "decode",
    "decode_frames",
    "decompress_frame",
    "encode",
    "err",
    "get_codec",
    "is_file_level",
    "parse_frames",
    "patch_escapes",
    "position_dtype",
    "segment_ids",
    "stream_encoder",
]
