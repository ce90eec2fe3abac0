"""Reading a chunked file: its streams (`blob`, `index`, escape tables) parsed and checked against
each other and the file's metadata (`FileStreams`), each chunk's hash verified before its frames are
decompressed on the host (zstandard), and a piece's place in the streams (`piece_at`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import zstandard

from ...checksums import chunk_hash_np
from ...errors import CodecError, DeltaError
from ..base import Ctx, err
from .planes import (
    COL_BIG,
    COL_GAP_ESC,
    COL_HASH,
    COL_MAG_ESC,
    FIRST_PART,
    FRAME_ALIGN,
    INDEX_WIDTH,
    MAX_CHUNK_ELEMS,
    N_PLANES,
    PAYLOAD_PARTS,
    PLANES,
    PlaneLayout,
    PlaneViews,
    views_over,
)

_TLS = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_TLS, "dctx", None)
    if d is None:
        d = _TLS.dctx = zstandard.ZstdDecompressor()
    return d


class FileStreams:
    """A format-3 file's streams (`blob`, `index`, escape tables) and its file-level metadata
    (`{"chunk_elems", "elems"}`), parsed and checked against each other. Raises CodecError."""

    def __init__(self, payload: Mapping[str, torch.Tensor], meta: Any, ctx: Ctx):
        self.ctx = ctx
        if not isinstance(meta, Mapping):
            raise err(CodecError, "chunked payload lacks its file metadata", ctx)
        try:
            e, n = int(meta["chunk_elems"]), int(meta["elems"])
        except (KeyError, TypeError, ValueError):
            raise err(CodecError, f"malformed chunked file metadata {dict(meta)!r:.200}", ctx) from None
        if e % 128 or not 0 < e <= MAX_CHUNK_ELEMS or n < 0:
            raise err(CodecError, f"bad chunk size {e} or element count {n}", ctx)
        tensors = [payload.get(k) for k in PAYLOAD_PARTS]
        dtypes = (torch.uint8, torch.int64, torch.int64, torch.int64)
        if any(t is None or t.dtype != dt for t, dt in zip(tensors, dtypes)):
            raise err(CodecError, f"chunked payload lacks {'/'.join(PAYLOAD_PARTS)} or has wrong dtypes", ctx)
        blob, index, gap_esc, mag_esc = tensors
        assert blob is not None and index is not None and gap_esc is not None and mag_esc is not None
        self.layout = PlaneLayout(n, e)
        k = self.layout.chunks
        if index.shape != (k, INDEX_WIDTH):
            raise err(CodecError, f"index has shape {list(index.shape)}, {n} elements need [{k}, {INDEX_WIDTH}]", ctx)
        self.blob, self.gap_esc, self.mag_esc = blob.reshape(-1), gap_esc.reshape(-1), mag_esc.reshape(-1)
        self.index = index.numpy()
        idx = self.index
        self.frame_offsets, self.raw_sizes = self.layout.frames(idx[:, COL_BIG])
        comp = idx[:, :N_PLANES]
        padded = -(-comp // FRAME_ALIGN) * FRAME_ALIGN
        elems = self.layout.elems()
        bad = (
            (comp < 0).any(axis=1)
            | ((comp == 0) != (self.raw_sizes == 0)).any(axis=1)
            | (idx[:, COL_BIG] < 0)
            | (idx[:, COL_BIG] > elems)
            | (idx[:, COL_GAP_ESC] < 0)
            | (idx[:, COL_GAP_ESC] > elems)
            | (idx[:, COL_MAG_ESC] < 0)
            | (idx[:, COL_MAG_ESC] > idx[:, COL_BIG])
        )
        if bad.any():
            c = int(np.flatnonzero(bad)[0])
            raise err(CodecError, f"chunk {c}: malformed index row {idx[c].tolist()}", ctx)
        self.chunk_bytes = padded.sum(axis=1)
        self.chunk_starts = np.concatenate([[0], np.cumsum(self.chunk_bytes)]).astype(np.int64)
        frame_starts = np.cumsum(padded, axis=1) - padded
        self.blob_offsets = self.chunk_starts[:-1, None] + frame_starts  # [chunks, 5]
        if int(self.chunk_starts[-1]) != self.blob.numel():
            raise err(CodecError, f"index covers {int(self.chunk_starts[-1])} B, blob has {self.blob.numel()}", ctx)
        self.gap_esc_at = np.concatenate([[0], np.cumsum(idx[:, COL_GAP_ESC])]).astype(np.int64)
        self.mag_esc_at = np.concatenate([[0], np.cumsum(idx[:, COL_MAG_ESC])]).astype(np.int64)
        if self.gap_esc_at[-1] != self.gap_esc.numel() or self.mag_esc_at[-1] != self.mag_esc.numel():
            raise err(
                CodecError,
                f"escape tables hold {self.gap_esc.numel()}/{self.mag_esc.numel()} entries, "
                f"the index counts {int(self.gap_esc_at[-1])}/{int(self.mag_esc_at[-1])}",
                ctx,
            )
        # Optional (files written before issue 26 lack it): each chunk's first position in its tensor.
        self.first: np.ndarray | None = None
        first = payload.get(FIRST_PART)
        if first is not None:
            if first.dtype != torch.int64 or first.shape != (k,):
                raise err(CodecError, f"chunk positions `first` of shape {list(first.shape)}, expected [{k}]", ctx)
            self.first = first.numpy()

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def chunk_elems(self) -> int:
        return self.layout.chunk_elems

    def range_layout(self, k0: int, k1: int) -> PlaneLayout:
        e = self.chunk_elems
        return PlaneLayout(min(self.n, k1 * e) - k0 * e, e)

    def corrupt(self, k: int, ctx: Ctx) -> DeltaError:
        return err(CodecError, f"chunk {k} (elements {k * self.chunk_elems}..) is corrupt: its hash differs", ctx)

    def verify(self, k: int, ctx: Ctx) -> None:
        """Chunk k's bytes hash to its index entry (host)."""
        a, b = int(self.chunk_starts[k]), int(self.chunk_starts[k + 1])
        if chunk_hash_np(self.blob[a:b].numpy()) != int(self.index[k, COL_HASH]):
            raise self.corrupt(k, ctx)

    def decompress_into(self, k: int, run: tuple[int, int], out: np.ndarray, ctx: Ctx) -> None:
        """Verify chunk k and decompress its frames into `out`, the planes buffer of the chunks
        run = [k0, k1) (`range_layout`)."""
        self.verify(k, ctx)
        k0, k1 = run
        lay = self.range_layout(k0, k1)
        e = self.chunk_elems
        j = k - k0
        lo, hi, sign, big, mag = lay.starts
        offsets = (lo + j * e, hi + j * e, sign + j * (e // 8), big + j * (e // 8), mag + j * e)
        raw = self.blob.numpy()
        dctx = _dctx()
        for f in range(N_PLANES):
            size = int(self.raw_sizes[k, f])
            if not size:
                continue
            a = int(self.blob_offsets[k, f])
            try:
                data = dctx.decompress(raw[a : a + int(self.index[k, f])].data, max_output_size=size)
            except zstandard.ZstdError as exc:
                raise err(CodecError, f"chunk {k}: {PLANES[f]} frame does not decode: {exc}", ctx) from None
            if len(data) != size:
                raise err(CodecError, f"chunk {k}: {PLANES[f]} frame holds {len(data)} B, expected {size}", ctx)
            out[offsets[f] : offsets[f] + size] = np.frombuffer(data, dtype=np.uint8)

    def views(self, k0: int, k1: int, buf: torch.Tensor, device: torch.device | None = None) -> PlaneViews:
        """The planes of chunks [k0, k1) over `buf` (their `range_layout`, filled by
        `decompress_into` or nvCOMP), with their counts and escape tables (on `device`, default buf's)."""
        ga, gb = int(self.gap_esc_at[k0]), int(self.gap_esc_at[k1])
        ma, mb = int(self.mag_esc_at[k0]), int(self.mag_esc_at[k1])
        escapes = (self.gap_esc[ga:gb], self.mag_esc[ma:mb])
        return views_over(buf, self.range_layout(k0, k1), self.index[k0:k1], escapes, device or buf.device)


def piece_at(meta: Any, numel: int, ctx: Ctx) -> tuple[int, int]:
    """A piece's first element in its file's streams and the start of its gap chain (its `enc`)."""
    try:
        at, start = int(meta["at"]), int(meta.get("start", 0))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise err(CodecError, f"chunked tensor metadata lacks 'at': {meta!r:.200}", ctx) from None
    if at < 0 or not 0 <= start <= numel:
        raise err(CodecError, f"bad element offset {at} or start {start}", ctx)
    return at, start
