"""Staging, host and device decode: a version file -> its changes on the device, in chunks.

`compact` payloads (docs/FORMAT.md) take a fast path built for one large version at a time:

* host: every zstd frame of every tensor is independent, so a thread pool decompresses them all
  in parallel (zstandard releases the GIL), largest first, straight into one pinned buffer laid
  out as [gap low bytes | gap high bytes | diff codes] over all frames of the version (3 B per
  changed element; escape tables are small and separate);
* one host-to-device copy (on the caller's stream: the engine's side stream);
* device: widen, patch escapes, prefix sums per frame and range checks, vectorized over all the
  frames of a chunk (a few million elements), not per tensor.

It validates what docs/FORMAT.md says readers validate, with the same exceptions as
`vllm_delta.codec` (tests compare the two on the same files). `raw` payloads are copied through
pinned memory and checked on the device. Any other codec goes through the codec's own
`unpack`/`finish`, one tensor at a time.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .. import codec as codecs
from ..errors import CodecError, PositionError
from .scatter import segment_ids

CHUNK_ELEMS = 1 << 23  # changed elements decoded per device chunk (bounds temporary memory)
_INT, _NP_INT = codecs.INT_DTYPE, codecs.NP_INT
_GAP_ESCAPE, _DIFF_ESCAPE = codecs.GAP_ESCAPE, codecs.DIFF_ESCAPE


@dataclass
class Item:
    """One changed tensor of a version, in the engine's layout order."""

    index: int  # tensor index in the engine's layout order
    name: str
    numel: int
    nnz: int
    enc: dict
    parts: dict  # the payload, by part name
    dtype: torch.dtype  # the tensor's dtype (header)


@dataclass
class Chunk:
    """Decoded changes of consecutive tensors (or of part of one), on the device."""

    t_idx: torch.Tensor  # int64: tensor index (layout order) of each element
    p: torch.Tensor  # int64: row-major position in its tensor (sorted within a tensor)
    diffs: torch.Tensor | None  # int16/int32 (element width): new - old bits, mod 2^bits
    values: torch.Tensor | None  # int16/int32: absolute new bits
    runs: list[tuple[int, int]]  # (tensor index, element count), in element order

    @property
    def tensors(self) -> list[int]:
        return [t for t, n in self.runs if n]

    @property
    def n(self) -> int:
        return int(self.p.numel())


def _err(exc_type, msg, version, name):
    return exc_type(msg, version=version, tensor=name)


def _threads() -> int:
    env = os.environ.get("VLLM_DELTA_STAGE_THREADS")
    return max(1, int(env)) if env else max(1, min(32, os.cpu_count() or 1))


class Decoder:
    """Decodes versions for one engine: a thread pool, reused pinned buffers, per-phase timings."""

    def __init__(self, device: torch.device, chunk_elems: int = CHUNK_ELEMS, threads: int | None = None):
        self.device = device
        self.chunk_elems = chunk_elems
        self.n_threads = threads or _threads()
        self._pool: ThreadPoolExecutor | None = None
        self._tls = threading.local()
        self.host_bytes = 0  # pinned / host staging bytes of the last decode

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.n_threads, thread_name_prefix="vllm-delta-stage")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._tls, "dctx", None)
        if d is None:
            d = self._tls.dctx = zstandard.ZstdDecompressor()
        return d

    def _host(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.empty(n, dtype=dtype, pin_memory=pin)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _span(self, timings: dict, key: str, t0: float, sync: bool = True) -> float:
        if sync:
            self._sync()
        t1 = time.perf_counter()
        timings[key] = timings.get(key, 0.0) + (t1 - t0) * 1e3
        return t1

    # -- entry point -----------------------------------------------------------------------------
    def decode(self, version: int, codec: str, items: list[Item], width: int, timings: dict):
        """Yield Chunks covering `items` (changed tensors of one element width, in layout order)."""
        items = [it for it in items if it.nnz]
        if not items:
            return
        if codec == "compact":
            yield from self._compact(version, items, width, timings)
        elif codec == "raw":
            yield from self._raw(version, items, width, timings)
        else:
            yield from self._generic(version, codec, items, width, timings)

    # -- compact ---------------------------------------------------------------------------------
    def _compact(self, version, items, width, timings):
        t0 = time.perf_counter()
        frames = []  # [item#, offset in blob, bytes, n, start, n_ge, n_de, elem, ge_at, de_at]
        blobs = []
        elem = ge_at = de_at = 0
        for k, it in enumerate(items):
            blob, table = it.parts.get("blob"), it.enc.get("frames") if isinstance(it.enc, dict) else None
            if blob is None or blob.dtype != torch.uint8 or not isinstance(table, list):
                raise _err(CodecError, "compact payload lacks its 'blob' tensor or frame table", version, it.name)
            try:
                tab = np.array([[int(x) for x in f] for f in table], dtype=np.int64).reshape(-1, 5)
            except (TypeError, ValueError) as exc:
                raise _err(CodecError, f"malformed frame table: {exc}", version, it.name) from None
            sizes, counts = tab[:, 0], tab[:, 1]
            if (tab < 0).any() or int(sizes.sum()) != blob.numel() or int(counts.sum()) != it.nnz:
                raise _err(
                    CodecError,
                    f"frame table covers {int(sizes.sum())} B / {int(counts.sum())} elements, payload has "
                    f"{blob.numel()} B / header nnz {it.nnz}",
                    version,
                    it.name,
                )
            raw = memoryview(blob.numpy())
            blobs.append(raw)
            off = 0
            for size, n, start, n_ge, n_de in tab.tolist():
                frames.append([k, off, size, n, start, n_ge, n_de, elem, ge_at, de_at])
                off, elem, ge_at, de_at = off + size, elem + n, ge_at + n_ge, de_at + n_de
        total = elem
        planes_t = self._host(3 * total, torch.uint8)
        ge_t = self._host(ge_at, torch.int64)
        de_t = self._host(de_at, _INT[width])
        self.host_bytes = planes_t.numel() + ge_t.numel() * 8 + de_t.numel() * width
        planes, ge_all, de_all = planes_t.numpy(), ge_t.numpy(), de_t.numpy()

        def work(fr):
            k, off, size, n, _start, n_ge, n_de, e, ga, da = fr
            want = 3 * n + 8 * n_ge + width * n_de
            try:
                buf = self._dctx().decompress(blobs[k][off : off + size], max_output_size=want)
            except zstandard.ZstdError as exc:
                return CodecError, f"zstd frame at byte {off} is corrupt: {exc}"
            if len(buf) != want:
                return CodecError, f"zstd frame at byte {off} holds {len(buf)} B, expected {want}"
            src = np.frombuffer(buf, dtype=np.uint8)
            planes[e : e + n] = src[:n]
            planes[total + e : total + e + n] = src[n : 2 * n]
            planes[2 * total + e : 2 * total + e + n] = src[2 * n : 3 * n]
            if n_ge:
                ge = np.frombuffer(buf, dtype="<i8", count=n_ge, offset=3 * n)
                if int(ge.min()) < 0 or int(ge.max()) >= items[k].numel:
                    return PositionError, f"gap escape out of range for {items[k].numel} elements"
                ge_all[ga : ga + n_ge] = ge
            if n_de:
                de_all[da : da + n_de] = np.frombuffer(buf, dtype=_NP_INT[width], count=n_de, offset=3 * n + 8 * n_ge)
            return None

        # Decompression runs ahead on the pool (frames in order) while this thread copies each
        # finished chunk to the device and decodes it there: host and device work overlap.
        pooled = len(frames) > 1 and self.n_threads > 1
        futures = [self.pool.submit(work, fr) for fr in frames] if pooled else None
        dev = self.device
        nb = dev.type == "cuda"
        last_seen: dict[int, int] = {}  # per tensor, the last position so far (frame order checks)
        try:
            i = 0
            while i < len(frames):
                j, size = i, 0
                while j < len(frames) and (j == i or size + frames[j][3] <= self.chunk_elems):
                    size += frames[j][3]
                    j += 1
                for f in range(i, j):
                    res = futures[f].result() if pooled else work(frames[f])
                    if res is not None:
                        raise _err(res[0], res[1], version, items[frames[f][0]].name)
                t0 = self._span(timings, "read", t0, sync=False)
                frs = frames[i:j]
                a, b = frs[0][7], frs[-1][7] + frs[-1][3]
                lo = planes_t[a:b].to(dev, non_blocking=nb)
                hi = planes_t[total + a : total + b].to(dev, non_blocking=nb)
                d8 = planes_t[2 * total + a : 2 * total + b].to(dev, non_blocking=nb)
                ge = ge_t[frs[0][8] : frs[-1][8] + frs[-1][5]].to(dev, non_blocking=nb)
                de = de_t[frs[0][9] : frs[-1][9] + frs[-1][6]].to(dev, non_blocking=nb)
                t0 = self._span(timings, "h2d", t0)
                chunk = self._compact_chunk(version, items, frs, lo, hi, d8, ge, de, width, last_seen)
                t0 = self._span(timings, "decode", t0)
                if chunk is not None:
                    yield chunk
                t0 = time.perf_counter()
                i = j
        finally:
            if futures:
                for fut in futures:
                    fut.cancel()
            self._sync()  # the copies out of the pinned buffers are done before they are reused

    def _compact_chunk(self, version, items, frs, lo, hi, d8, ge, de, width, last_seen):
        dev = self.device
        n = lo.numel()
        # Per frame, host-side: chunk-relative element start, count.
        fe = np.array([f[7] - frs[0][7] for f in frs], dtype=np.int64)
        fn = np.array([f[3] for f in frs], dtype=np.int64)
        if n == 0:
            for f in frs:
                self._check_frame_order(version, items, f, None, last_seen)
            return None
        g = lo.to(torch.int64).bitwise_or_(hi.to(torch.int64).bitwise_left_shift_(8))
        d = d8.view(torch.int8).to(_INT[width])
        for kind, codes, code, table, col in (("gap", g, _GAP_ESCAPE, ge, 5), ("value", d, _DIFF_ESCAPE, de, 6)):
            at = (codes == code).nonzero().reshape(-1)
            host_at = at.cpu().numpy()
            per_frame = np.bincount(np.searchsorted(fe, host_at, side="right") - 1, minlength=len(frs))
            bad = np.flatnonzero(per_frame != np.array([f[col] for f in frs]))
            if bad.size:
                name = items[frs[int(bad[0])][0]].name
                raise _err(CodecError, f"{kind} escapes do not match their escape table", version, name)
            if at.numel():
                codes[at] = table.to(codes.dtype)
        c = torch.cumsum(g.add_(1), 0)
        del g
        small = torch.tensor(
            np.concatenate([fe, fn, np.array([f[4] for f in frs], dtype=np.int64),
                            np.array([items[f[0]].index for f in frs], dtype=np.int64)])
        ).to(dev, non_blocking=dev.type == "cuda")
        k = len(frs)
        fe_d, fn_d, starts, tensor_of_frame = small[:k], small[k : 2 * k], small[2 * k : 3 * k], small[3 * k :]
        before = torch.where(fe_d > 0, c[(fe_d - 1).clamp_(min=0)], torch.zeros_like(fe_d))
        seg = segment_ids(fn_d, n)  # frame of each element
        p = c.add_((starts - 1 - before)[seg])
        nonempty = np.flatnonzero(fn)
        lasts = p[torch.from_numpy(fe[nonempty] + fn[nonempty] - 1).to(dev)].tolist()
        last_of = dict(zip(nonempty.tolist(), lasts))
        for i, f in enumerate(frs):
            self._check_frame_order(version, items, f, last_of.get(i), last_seen)
        t_idx = tensor_of_frame[seg]
        runs: list[tuple[int, int]] = []
        for f in frs:
            t = items[f[0]].index
            if runs and runs[-1][0] == t:
                runs[-1] = (t, runs[-1][1] + f[3])
            else:
                runs.append((t, f[3]))
        return Chunk(t_idx=t_idx, p=p, diffs=d, values=None, runs=runs)

    @staticmethod
    def _check_frame_order(version, items, f, last, last_seen):
        k, start = f[0], f[4]
        it = items[k]
        prev = last_seen.get(k, -1)
        if start <= prev:
            raise _err(PositionError, f"frame starts at {start}, not after position {prev}", version, it.name)
        if last is not None:
            if last >= it.numel:
                raise _err(PositionError, f"position {last} out of range for {it.numel} elements", version, it.name)
            last_seen[k] = last

    # -- raw -------------------------------------------------------------------------------------
    def _raw(self, version, items, width, timings):
        t0 = time.perf_counter()
        sections = []
        for it in items:
            ctx = {"version": version, "tensor": it.name}
            sec = codecs.get_codec("raw", ctx).unpack(
                it.parts, it.enc, numel=it.numel, nnz=it.nnz, dtype=it.dtype, ctx=ctx
            )
            sections.append(sec)
        total = sum(it.nnz for it in items)
        pos_t = self._host(total, torch.int64)
        val_t = self._host(total, _INT[width])
        self.host_bytes = total * (8 + width)
        pos, val = pos_t.numpy(), val_t.numpy()
        bounds, at = [], 0
        for it, sec in zip(items, sections):
            pos[at : at + it.nnz] = sec.arrays["idx"]
            val[at : at + it.nnz] = sec.arrays["val"]
            bounds.append((at, at + it.nnz))
            at += it.nnz
        t0 = self._span(timings, "read", t0, sync=False)
        nb = self.device.type == "cuda"
        pos_d = pos_t.to(self.device, non_blocking=nb)
        val_d = val_t.to(self.device, non_blocking=nb)
        t0 = self._span(timings, "h2d", t0)
        for group in _groups([it.nnz for it in items], self.chunk_elems):
            a, b = bounds[group[0]][0], bounds[group[-1]][1]
            p = pos_d[a:b]
            idx = torch.tensor([items[k].index for k in group], dtype=torch.int64, device=self.device)
            cnt = torch.tensor([items[k].nnz for k in group], dtype=torch.int64, device=self.device)
            seg = segment_ids(cnt, b - a)
            t_idx = idx[seg]
            numel = torch.tensor([items[k].numel for k in group], dtype=torch.int64, device=self.device)
            bad = (p < 0) | (p >= numel[seg])
            if b - a > 1:
                bad[1:] |= (p[1:] <= p[:-1]) & (t_idx[1:] == t_idx[:-1])
            if bool(bad.any()):
                for k in group:  # find the tensor and raise the codec's own message
                    s, e = bounds[k]
                    codecs.check_positions(pos_d[s:e], items[k].numel, {"version": version, "tensor": items[k].name})
                raise _err(PositionError, "invalid positions", version, items[group[0]].name)  # pragma: no cover
            t0 = self._span(timings, "decode", t0)
            yield Chunk(t_idx=t_idx, p=p, diffs=None, values=val_d[a:b],
                        runs=[(items[k].index, items[k].nnz) for k in group])
            t0 = time.perf_counter()

    # -- any other codec: its own unpack/finish, one tensor at a time ----------------------------
    def _generic(self, version, codec, items, width, timings):
        c = codecs.get_codec(codec, {"version": version})
        for it in items:
            ctx = {"version": version, "tensor": it.name}
            t0 = time.perf_counter()
            sec = c.unpack(it.parts, it.enc, numel=it.numel, nnz=it.nnz, dtype=it.dtype, ctx=ctx)
            t0 = self._span(timings, "read", t0, sync=False)
            ch = c.finish(sec, numel=it.numel, device=self.device, ctx=ctx)
            pos = ch.positions.to(torch.int64)
            t_idx = torch.full_like(pos, it.index)
            if ch.values is not None:
                vals, diffs = codecs.int_view(ch.values).to(_INT[width]), None
            else:
                vals, diffs = None, ch.diffs.to(torch.int64).to(_INT[width])
            self._span(timings, "decode", t0)
            yield Chunk(t_idx=t_idx, p=pos, diffs=diffs, values=vals, runs=[(it.index, int(pos.numel()))])


def _groups(sizes: list[int], limit: int) -> list[list[int]]:
    out, cur, size = [], [], 0
    for k, n in enumerate(sizes):
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    if cur:
        out.append(cur)
    return out
