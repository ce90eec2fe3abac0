"""`ChunkedCodec`: the chunked codec's Codec (base.FileCodec): the trainer's side (`prepare_batch`,
`stream`, `plan_file`, `pack_file`) and the per-piece reader's (`unpack`/`finish`: replay,
materialize, the one-shot `decode`). A server's staging reads files with `ChunkedDecoder` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

from ...bits import int_view
from ...errors import CodecError
from ..base import Batch, BatchSections, Changes, Ctx, MemorySink, Sections, err, segment_ids
from .blocks import COLS, BlockLayout, edge, from_block_positions, span_bounds
from .decode import Carry, Spans, decode_planes
from .encode import encode_planes
from .planes import CHUNK_ELEMS, INDEX_WIDTH, PAYLOAD_LAYOUT, SLICE_ELEMS, ZSTD_LEVEL, PlanesBackend
from .regions import file_spans, has_blocks, region_payloads
from .streams import FileStreams, piece_at
from .write import BlockStreamEncoder, ChunkedBatch, FilePack, FilePlan, StreamEncoder


class ChunkedCodec:
    """The chunked codec (module docstring). File-level: `pack_file` writes every changed tensor of
    a file at once; `prepare`/`unpack`/`finish` work on one tensor (or piece) for the per-tensor
    readers (replay, materialize) and the one-shot `encode`/`decode`."""

    name = "chunked"
    needs_base = True
    file_level = True

    def __init__(
        self,
        level: int = ZSTD_LEVEL,
        chunk_elems: int = CHUNK_ELEMS,
        slice_elems: int = SLICE_ELEMS,
        encode_backend: PlanesBackend | None = None,
        encode_frames: int | None = None,
        rank_blocks: int = 0,
    ):
        """`encode_backend`: the device encoder (`encode_planes`): None picks Triton on CUDA.
        `encode_frames`: frames per nvCOMP compression call (None: as many as a call takes; fewer bound
        the publish's GPU memory, at the cost of more calls: UploadOptions(gpu_encode_frames))."""
        if encode_frames is not None and encode_frames < 1:
            raise ValueError(f"encode_frames must be >= 1 (or None), not {encode_frames}")
        self.level = level
        self.chunk_elems = chunk_elems
        self.slice_elems = slice_elems
        self.encode_backend = encode_backend
        self.encode_frames = encode_frames
        # >1: files with rank blocks (blocks.py, format 5) from `stream` given the tensors' shapes and rows
        self.rank_blocks = rank_blocks

    # -- trainer side ------------------------------------------------------------------------
    def prepare(
        self, positions: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, numel: int, start: int = 0
    ) -> Sections:
        """One tensor's changes, kept as they are (on their device) until `pack_file` lays out the file."""
        return Sections(meta={"changes": (positions, int_view(new_bits), int_view(old_bits)), "start": start})

    def prepare_batch(self, batch: Batch) -> ChunkedBatch:
        """Device work for many tensors at once: the planes, on the batch's device and stream."""
        if not batch.positions.numel():
            return ChunkedBatch(self, batch.counts, batch.starts, [])
        parts = [encode_planes(batch, self.chunk_elems, self.slice_elems, backend=self.encode_backend)]
        return ChunkedBatch(self, batch.counts, batch.starts, parts)

    def stream(
        self, starts: Sequence[int], tensors: Sequence[tuple[str, Sequence[int], int, int]] | None = None
    ) -> StreamEncoder | BlockStreamEncoder:
        """`prepare_batch` for changes that arrive in passes (`StreamEncoder`). With `rank_blocks` and the
        tensors' (name, shape, row0, row1): a file with rank blocks where some tensor is split."""
        layout = self._block_layout(tensors) if tensors is not None and self.rank_blocks > 1 else None
        return StreamEncoder(self, starts) if layout is None else BlockStreamEncoder(self, layout, starts)

    def _block_layout(self, tensors: Sequence[tuple[str, Sequence[int], int, int]]) -> BlockLayout | None:
        """The tensors' rank blocks, made again only for another list of tensors (a Publisher passes the
        same list for every version of one tensor set and share: 19K tuples at 30B-A3B)."""
        cached = getattr(self, "_blocks_of", None)
        if cached is not None and cached[0] is tensors:
            return cached[1]  # type: ignore[no-any-return]
        layout = BlockLayout.of(tensors, self.rank_blocks)
        self._blocks_of = (tensors, layout)
        return layout

    def plan_file(self, tensors: Sequence[tuple[str, Sections]]) -> FilePlan:
        """The file of the changed tensors given (Sections of one `prepare_batch`, or of `prepare`,
        laid out in the order given): its metadata now, its payload by `write_to`."""
        batches = {id(s.meta.get("batch")): s.meta.get("batch") for _, s in tensors}
        if len(batches) == 1 and None not in batches.values():
            (prepared,) = batches.values()
            assert isinstance(prepared, ChunkedBatch)
            if prepared.blocks is not None:  # its split tensors' pieces need format 5's spans (plan_batch)
                raise ValueError("a batch with rank blocks is written in format 5 (plan_batch)")
        else:
            if any("changes" not in s.meta for _, s in tensors):
                raise ValueError("pack_file takes the Sections of one prepare_batch, or of prepare")
            prepared = self.prepare_batch(_concat([s for _, s in tensors]))
        tensor_enc = {
            name: prepared.tensor_enc(s.meta["tensor"] if "batch" in s.meta else i)
            for i, (name, s) in enumerate(tensors)
        }
        return FilePlan(prepared, prepared.file_enc(), tensor_enc, list(PAYLOAD_LAYOUT), self._size_hint(prepared.n))

    def plan_batch(self, batch: BatchSections) -> FilePlan:
        """`plan_file` of a whole `prepare_batch` (or stream) result, every tensor in batch order, with
        no per-tensor object: the tensors' places are the batch's arrays (`ChunkedBatch.enc_arrays`)."""
        if not isinstance(batch, ChunkedBatch):
            raise ValueError(f"plan_batch takes what prepare_batch or stream return, not {type(batch).__name__}")
        return FilePlan(batch, batch.file_enc(), {}, batch.payload_layout, self._size_hint(batch.n))

    def _size_hint(self, n: int) -> int:
        # ~1.1-1.4 B per changed element (docs/PERFORMANCE.md), the index 72 B per chunk
        return n * 5 // 4 + -(-n // self.chunk_elems) * INDEX_WIDTH * 8

    def pack_file(
        self, tensors: Sequence[tuple[str, Sections]], pool: Executor | None = None, busy_ms: list[float] | None = None
    ) -> FilePack:
        """The file payload of the changed tensors given, in memory (`plan_file` into a MemorySink)."""
        plan = self.plan_file(tensors)
        sink = MemorySink()
        plan.write_to(sink, pool, busy_ms)
        return FilePack(payload=sink.payload(), enc=plan.enc, tensor_enc=plan.tensor_enc)

    def pack(self, sections: Sections, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One tensor as a file of its own: the payload and its `enc` (with the file's under "file")."""
        out = self.pack_file([("", sections)])
        return out.payload, {**out.tensor_enc[""], "file": out.enc}

    # -- reader side (one piece) -----------------------------------------------------------------
    def unpack(
        self, tensors: Mapping[str, torch.Tensor], meta: Any, *, numel: int, nnz: int, dtype: torch.dtype, ctx: Ctx
    ) -> Sections:
        """Host work: verify and decompress the chunks holding the piece's elements."""
        if has_blocks(meta.get("file") if isinstance(meta, Mapping) else None):
            return self._unpack_blocks(tensors, meta, numel=numel, nnz=nnz, dtype=dtype, ctx=ctx)
        at, start = piece_at(meta, numel, ctx)
        streams = FileStreams(tensors, meta.get("file"), ctx)
        spans = Spans.of([at], [nnz], [start], [numel], [0])
        spans.check(streams.n, lambda _: ctx)
        buf = torch.zeros(0, dtype=torch.uint8)
        k0 = k1 = 0
        if nnz:
            e = streams.chunk_elems
            k0, k1 = at // e, -(-(at + nnz) // e)
            buf = torch.empty(streams.range_layout(k0, k1).size, dtype=torch.uint8)
            for k in range(k0, k1):
                streams.decompress_into(k, (k0, k1), buf.numpy(), ctx)
        return Sections(meta={"streams": streams, "spans": spans, "chunks": (k0, k1), "buf": buf})

    def _unpack_blocks(
        self, tensors: Mapping[str, torch.Tensor], meta: Any, *, numel: int, nnz: int, dtype: torch.dtype, ctx: Ctx
    ) -> Sections:
        """`unpack` in a file with rank blocks (blocks.py): a whole tensor from region 0; a split one from
        each block it changed (its spans), every block's piece unpacked from its region's streams."""
        file_enc = meta["file"]
        regions = region_payloads(tensors, file_enc, ctx)
        if "at" in meta:
            return self.unpack(
                regions[0][0], {**meta, "file": regions[0][1]}, numel=numel, nnz=nnz, dtype=dtype, ctx=ctx
            )
        try:
            row, size, (r0, r1) = int(meta["tensor"]), int(meta["row_size"]), (int(x) for x in meta["rows"])
        except (KeyError, TypeError, ValueError):
            raise err(
                CodecError, f"a split tensor's piece lacks its row, row size or rows: {meta!r:.200}", ctx
            ) from None
        spans = file_spans(tensors, file_enc, ctx)
        mine = spans[spans[:, 0] == row]
        if int(mine[:, 3].sum()) != nnz:
            raise err(CodecError, f"its spans hold {int(mine[:, 3].sum())} elements, the header {nnz}", ctx)
        c = max(size, 1)
        one = np.ones(len(mine), dtype=np.int64)
        start, _ = span_bounds(
            mine[:, 1], mine[:, 2], one * (numel // c), one * size, one * r0, one * r1, int(file_enc["blocks"])
        )
        pieces = [
            self.unpack(
                regions[b + 1][0],
                {"at": at, "start": st, "file": regions[b + 1][1]},
                numel=numel,
                nnz=n,
                dtype=dtype,
                ctx=ctx,
            )
            for (_, _, b, n, at), st in zip(mine.tolist(), start.tolist())
        ]
        c0 = edge(mine[:, 2], size, int(file_enc["blocks"]))
        width = np.where(mine[:, 1] == COLS, edge(mine[:, 2] + 1, size, int(file_enc["blocks"])) - c0, 0)
        return Sections(meta={"blocks": pieces, "unblock": (c0.tolist(), width.tolist(), size)})

    def finish(self, sections: Sections, *, numel: int, device: torch.device | str, ctx: Ctx) -> Changes:
        """Device work: positions and differences of the piece's elements (a split tensor's blocks in
        position order)."""
        if "blocks" in sections.meta:
            parts = [self.finish(p, numel=numel, device=device, ctx=ctx) for p in sections.meta["blocks"]]
            if not parts:
                empty = torch.zeros(0, dtype=torch.int64, device=torch.device(device))
                return Changes(positions=empty, diffs=empty)
            c0s, widths, size = sections.meta["unblock"]  # a column block's positions, in the tensor's coordinates
            pos = torch.cat(
                [
                    from_block_positions(p.positions, *(torch.full_like(p.positions, x) for x in (c0, w, size)))
                    for p, c0, w in zip(parts, c0s, widths)
                ]
            )
            diffs = torch.cat([p.diffs for p in parts if p.diffs is not None])
            order = torch.argsort(pos)
            return Changes(positions=pos[order], diffs=diffs[order])
        dev = torch.device(device)
        streams, spans, buf = sections.meta["streams"], sections.meta["spans"], sections.meta["buf"]
        if not len(spans):
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            return Changes(positions=empty, diffs=empty)
        k0, k1 = sections.meta["chunks"]
        views = streams.views(k0, k1, buf.to(dev), dev)
        out = decode_planes(views, k0 * streams.chunk_elems, spans, Carry(), lambda _: ctx)
        return Changes(positions=out.positions, diffs=out.diffs)


def _concat(sections: Sequence[Sections]) -> Batch:
    """Single-tensor Sections (`prepare`) laid end to end as one Batch."""
    changes = [s.meta["changes"] for s in sections]
    dev = changes[0][0].device if changes else torch.device("cpu")
    counts = [int(c[0].numel()) for c in changes]
    seg = segment_ids(torch.tensor(counts, dtype=torch.int64, device=dev), sum(counts))
    return Batch(
        positions=torch.cat([c[0].to(torch.int64) for c in changes]),
        new=torch.cat([c[1] for c in changes]),
        old=torch.cat([c[2] for c in changes]),
        seg=seg,
        counts=counts,
        starts=[int(s.meta["start"]) for s in sections],
        numels=[0] * len(sections),
    )
