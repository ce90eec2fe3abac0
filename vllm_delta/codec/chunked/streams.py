"""Reading a chunked file: its streams (`blob`, `index`, escape tables) parsed and checked against
each other and the file's metadata (`FileStreams`), each chunk's hash verified before its frames are
decompressed on the host (zstandard), and a piece's place in the streams (`piece_at`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import zstandard

from ...checksums import chunk_hash_np, chunk_hashes_np
from ...errors import CodecError, DeltaError
from ..base import Ctx, err
from .planes import (
    COL_BIG,
    COL_GAP_ESC,
    COL_HASH,
    COL_MAG_ESC,
    FRAME_ALIGN,
    INDEX_WIDTH,
    MAX_CHUNK_ELEMS,
    N_PLANES,
    PAYLOAD_PARTS,
    PLANES,
    PlaneLayout,
    PlaneViews,
)

CtxOfChunk = Callable[[int], Ctx]  # chunk index -> where an error about it happened
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

    def verify_run(self, k0: int, k1: int, ctx_of_chunk: CtxOfChunk) -> None:
        """Chunks [k0, k1) hash to their index entries (host, vectorized: one pass over their words)."""
        a, b = int(self.chunk_starts[k0]), int(self.chunk_starts[k1])
        got = chunk_hashes_np(self.blob.numpy()[a:b], self.chunk_bytes[k0:k1])
        bad = np.flatnonzero(got != self.index[k0:k1, COL_HASH])
        if bad.size:
            k = k0 + int(bad[0])
            raise self.corrupt(k, ctx_of_chunk(k))

    def decompress_run(self, run: tuple[int, int], out: np.ndarray, ctx_of_chunk: CtxOfChunk, threads: int) -> None:
        """Verify chunks run = [k0, k1) and decompress all their frames into `out` (their
        `range_layout`) with zstandard's own threads (one call, the GIL released throughout)."""
        k0, k1 = run
        self.verify_run(k0, k1, ctx_of_chunk)
        offsets, sizes = self.range_layout(k0, k1).frames(self.index[k0:k1, COL_BIG])
        used = sizes.reshape(-1) > 0
        a = int(self.chunk_starts[k0])
        src = np.stack(
            [(self.blob_offsets[k0:k1] - a).reshape(-1)[used], self.index[k0:k1, :N_PLANES].reshape(-1)[used]], 1
        )
        data = self.blob.numpy()[a : int(self.chunk_starts[k1])].tobytes()
        want = sizes.reshape(-1)[used]
        try:
            frames = zstandard.BufferWithSegments(data, src.astype(np.uint64).tobytes())
            got = _dctx().multi_decompress_to_buffer(
                frames, decompressed_sizes=want.astype(np.uint64).tobytes(), threads=max(1, threads)
            )
        except zstandard.ZstdError:  # find and name the frame: one chunk at a time
            for k in range(k0, k1):
                self.decompress_into(k, run, out, ctx_of_chunk(k))
            raise err(CodecError, f"chunks {k0}..{k1 - 1} do not decompress", ctx_of_chunk(k0)) from None
        for i, dst in enumerate(offsets.reshape(-1)[used].tolist()):
            seg = got[i]
            if len(seg) != want[i]:
                k = k0 + int(np.flatnonzero(used)[i]) // N_PLANES
                raise err(
                    CodecError, f"chunk {k}: a frame holds {len(seg)} B, expected {int(want[i])}", ctx_of_chunk(k)
                )
            out[dst : dst + len(seg)] = np.frombuffer(seg, dtype=np.uint8)  # type: ignore[call-overload]

    def views(self, k0: int, k1: int, buf: torch.Tensor, device: torch.device | None = None) -> PlaneViews:
        """The planes of chunks [k0, k1) over `buf` (their `range_layout`, filled by
        `decompress_into` or nvCOMP), with their counts and escape tables (on `device`, default buf's)."""
        dev = device or buf.device
        nb = dev.type == "cuda"
        lay = self.range_layout(k0, k1)
        lo, hi, sign, big, mag = lay.starts
        n, bits = lay.n, lay.bit_bytes
        idx = torch.from_numpy(np.ascontiguousarray(self.index[k0:k1, COL_BIG : COL_MAG_ESC + 1].T)).to(
            dev, non_blocking=nb
        )
        ga, gb = int(self.gap_esc_at[k0]), int(self.gap_esc_at[k1])
        ma, mb = int(self.mag_esc_at[k0]), int(self.mag_esc_at[k1])
        return PlaneViews(
            chunk_elems=self.chunk_elems,
            lo=buf[lo : lo + n],
            hi=buf[hi : hi + n],
            sign=buf[sign : sign + bits],
            big=buf[big : big + bits],
            mag=buf[mag : mag + lay.chunks * lay.chunk_elems].view(lay.chunks, lay.chunk_elems),
            n_big=idx[0],
            n_gap_esc=idx[1],
            n_mag_esc=idx[2],
            gap_esc=self.gap_esc[ga:gb].to(dev, non_blocking=nb),
            mag_esc=self.mag_esc[ma:mb].to(dev, non_blocking=nb),
        )

    def escape_offsets(self, k0: int, k1: int) -> tuple[int, int]:
        return int(self.gap_esc_at[k1] - self.gap_esc_at[k0]), int(self.mag_esc_at[k1] - self.mag_esc_at[k0])


def piece_at(meta: Any, numel: int, ctx: Ctx) -> tuple[int, int]:
    """A piece's first element in its file's streams and the start of its gap chain (its `enc`)."""
    try:
        at, start = int(meta["at"]), int(meta.get("start", 0))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise err(CodecError, f"chunked tensor metadata lacks 'at': {meta!r:.200}", ctx) from None
    if at < 0 or not 0 <= start <= numel:
        raise err(CodecError, f"bad element offset {at} or start {start}", ctx)
    return at, start
