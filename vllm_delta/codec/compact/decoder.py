"""`CompactDecoder`: a server's staging decoder of compact payloads (codec/decoding.py's interface),
built for one large version at a time:

* host: every zstd frame of every tensor is independent, so the pool decompresses them all in
  parallel (zstandard releases the GIL), in order, straight into one pinned buffer laid out as
  [gap low bytes | gap high bytes | diff codes] over all frames of the version (3 B per changed
  element; escape tables are small and separate);
* device: per unit (consecutive frames of up to `host.chunk_elems` elements) one host-to-device
  copy, then widen, patch escapes, prefix sums per frame and range checks, vectorized over all the
  frames of the unit, not per tensor.

It validates what docs/FORMAT.md says readers validate, with the same exceptions as
`CompactCodec.unpack`/`finish` (tests compare the two on the same files).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
import zstandard

from ...bits import INT_DTYPE
from ..decoding import Chunk, Fetch, Item, Pieces, StagingHost, ctx_of, piece_list
from .frames import Frame, FrameOrder, decode_frames, decompress_frame, parse_frames

_TLS = threading.local()


class CompactDecoder:
    """The compact codec's staging decoder (stateless: each `plan` holds one decode's state)."""

    def plan(self, version: int, pieces: Pieces, width: int, host: StagingHost) -> _Plan:
        return _Plan(version, piece_list(pieces, "compact", version), width, host)


class _FrameJob(NamedTuple):
    """One frame to decompress, and where its output goes in the version's host buffers."""

    item: int  # index into the decoded items
    offset: int  # byte offset of the frame in its item's blob
    frame: Frame
    elem: int  # first element in the planes
    gap_at: int  # first entry in the gap escape buffer
    diff_at: int  # first entry in the value escape buffer


class _Plan:
    """Units: runs of consecutive frames [i, j) of `jobs`, each of at most `host.chunk_elems`
    elements (or one frame)."""

    def __init__(self, version: int, items: list[Item], width: int, host: StagingHost):
        self.version, self.items, self.width, self.host = version, items, width, host
        self.jobs: list[_FrameJob] = []
        self.blobs: list[memoryview] = []
        elem = ge_at = de_at = 0
        for k, it in enumerate(self.items):
            blob = it.parts.get("blob")
            frames = parse_frames(blob, it.enc, it.nnz, ctx_of(version, it.name))
            assert blob is not None  # parse_frames checked it
            self.blobs.append(blob.numpy().data)
            offset = 0
            for f in frames:
                self.jobs.append(_FrameJob(k, offset, f, elem, ge_at, de_at))
                offset, elem = offset + f.nbytes, elem + f.elems
                ge_at, de_at = ge_at + f.gap_escapes, de_at + f.diff_escapes
        self.total = elem
        self.planes_t = host.buffer(3 * self.total, torch.uint8)
        self.ge_t = host.buffer(ge_at, torch.int64)
        self.de_t = host.buffer(de_at, INT_DTYPE[width])
        self.order = FrameOrder()  # per piece, positions keep rising across frames and units
        for k, it in enumerate(self.items):
            self.order.begin(k, it.start)
        self.units: list[tuple[int, int]] = []
        i = 0
        while i < len(self.jobs):
            j, size = i, 0
            while j < len(self.jobs) and (j == i or size + self.jobs[j].frame.elems <= host.chunk_elems):
                size += self.jobs[j].frame.elems
                j += 1
            self.units.append((i, j))
            i = j

    def _work(self, job: _FrameJob) -> None:
        """Decompress one frame into its places in the host buffers."""
        it, f, e, total = self.items[job.item], job.frame, job.elem, self.total
        planes, ge_all, de_all = self.planes_t.numpy(), self.ge_t.numpy(), self.de_t.numpy()
        fa = decompress_frame(
            _dctx(), self.blobs[job.item], job.offset, f, self.width, it.numel, ctx_of(self.version, it.name)
        )
        planes[e : e + f.elems] = fa.gap_lo
        planes[total + e : total + e + f.elems] = fa.gap_hi
        planes[2 * total + e : 2 * total + e + f.elems] = fa.d8.view(np.uint8)
        ge_all[job.gap_at : job.gap_at + f.gap_escapes] = fa.gap_esc
        de_all[job.diff_at : job.diff_at + f.diff_escapes] = fa.diff_esc

    def fetch(self, unit: tuple[int, int]) -> Fetch:
        return Fetch([self.host.submit(partial(self._work, job)) for job in self.jobs[unit[0] : unit[1]]])

    def decode(self, unit: tuple[int, int], fetched: Fetch) -> Iterator[Chunk]:
        dev, total = self.host.device, self.total
        nb = dev.type == "cuda"
        jobs = self.jobs[unit[0] : unit[1]]
        a, b = jobs[0].elem, jobs[-1].elem + jobs[-1].frame.elems
        ga, gb = jobs[0].gap_at, jobs[-1].gap_at + jobs[-1].frame.gap_escapes
        da, db = jobs[0].diff_at, jobs[-1].diff_at + jobs[-1].frame.diff_escapes
        lo = self.planes_t[a:b].to(dev, non_blocking=nb)
        hi = self.planes_t[total + a : total + b].to(dev, non_blocking=nb)
        d8 = self.planes_t[2 * total + a : 2 * total + b].to(dev, non_blocking=nb)
        ge = self.ge_t[ga:gb].to(dev, non_blocking=nb)
        de = self.de_t[da:db].to(dev, non_blocking=nb)
        self.host.mark("h2d")
        chunk = self._chunk(jobs, lo, hi, d8, ge, de)
        self.host.mark("decode")
        if chunk is not None:
            yield chunk

    def _chunk(
        self,
        jobs: list[_FrameJob],
        lo: torch.Tensor,
        hi: torch.Tensor,
        d8: torch.Tensor,
        ge: torch.Tensor,
        de: torch.Tensor,
    ) -> Chunk | None:
        """Device decode of the frames of one unit: positions and diffs, checked."""
        items, order = self.items, self.order

        def ctx(f: int) -> dict[str, Any]:
            return ctx_of(self.version, items[jobs[f].item].name)

        frames = [job.frame for job in jobs]
        if lo.numel() == 0:
            for f, job in enumerate(jobs):
                order.check(job.item, job.frame, None, items[job.item].end, ctx(f))
            return None
        gaps = lo.to(torch.int64).bitwise_or_(hi.to(torch.int64).bitwise_left_shift_(8))
        diffs = d8.view(torch.int8).to(INT_DTYPE[self.width])
        p, d, frame_of = decode_frames(gaps, diffs, ge, de, frames, ctx)
        counts = np.array([f.elems for f in frames], dtype=np.int64)
        ends = np.cumsum(counts) - 1
        nonempty = np.flatnonzero(counts)
        lasts = dict(zip(nonempty.tolist(), p[torch.from_numpy(ends[nonempty]).to(p.device)].tolist()))
        for f, job in enumerate(jobs):
            order.check(job.item, job.frame, lasts.get(f), items[job.item].end, ctx(f))
        idx = torch.from_numpy(np.array([items[job.item].index for job in jobs], dtype=np.int64)).to(p.device)
        t_idx = idx[frame_of]
        runs: list[tuple[int, int]] = []
        for job in jobs:
            t = items[job.item].index
            if runs and runs[-1][0] == t:
                runs[-1] = (t, runs[-1][1] + job.frame.elems)
            else:
                runs.append((t, job.frame.elems))
        return Chunk(t_idx=t_idx, p=p, diffs=d, values=None, runs=runs)


def _dctx() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (a pool thread keeps one)."""
    d = getattr(_TLS, "dctx", None)
    if d is None:
        d = _TLS.dctx = zstandard.ZstdDecompressor()
    return d
