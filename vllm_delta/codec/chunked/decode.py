"""The chunked codec's decoder half on the device: the planes of a run of whole chunks -> positions
and differences of the spans (tensors or pieces) they hold (`decode_planes`), every check folded
into one flag; a flagged run is decoded again by the checked torch path, which names the fault.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from numpy.typing import ArrayLike

from ...errors import CodecError, DeltaError, PositionError
from ..base import Ctx, err, segment_ids
from . import kernels
from .planes import (
    GAP_ESCAPE,
    KERNEL_FAILED,
    MAG_BIAS,
    MAG_ESCAPE,
    PLANES_BACKENDS,
    PlanesBackend,
    PlaneViews,
    chunk_counts,
    chunk_ranks,
    default_backend,
    unpack_bits,
)

log = logging.getLogger(__name__)

CtxOfSpan = Callable[[int], Ctx]  # span index -> where an error about it happened


@dataclass
class Spans:
    """Tensors' (or pieces') elements in a file, as arrays sorted by `at`, none empty: tensor i holds
    elements [at[i], end[i]), its gap chain starts at start[i] and its positions lie in
    [start[i], stop[i]); `key[i]` is the caller's name for it (an index into its own list)."""

    at: np.ndarray
    end: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    key: np.ndarray

    @classmethod
    def of(cls, at: ArrayLike, nnz: ArrayLike, start: ArrayLike, stop: ArrayLike, key: ArrayLike) -> Spans:
        arrays = [np.asarray(x, dtype=np.int64).reshape(-1) for x in (at, nnz, start, stop, key)]
        keep = arrays[1] > 0
        at_, nnz_, start_, stop_, key_ = (x[keep] for x in arrays)
        order = np.argsort(at_, kind="stable")
        return cls(at_[order], (at_ + nnz_)[order], start_[order], stop_[order], key_[order])

    def __len__(self) -> int:
        return int(self.at.size)

    def check(self, n: int, ctx_of: CtxOfSpan) -> None:
        """Inside the file's n elements, not overlapping, starts within range (CodecError)."""
        bad = (self.at < 0) | (self.end > n) | (self.start < 0) | (self.start > self.stop)
        if len(self) > 1:
            bad[1:] |= self.at[1:] < self.end[:-1]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise err(
                CodecError,
                f"elements [{self.at[i]}, {self.end[i]}) outside the file's {n}, overlapping, or a bad start",
                ctx_of(i),
            )

    def chunks(self, chunk_elems: int, n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
        """(which chunks hold elements of any span, the first span holding elements of each chunk)."""
        first_k, last_k = self.at // chunk_elems, (self.end - 1) // chunk_elems
        marks = np.zeros(n_chunks + 1, dtype=np.int64)
        np.add.at(marks, first_k, 1)
        np.add.at(marks, last_k + 1, -1)
        needed = np.cumsum(marks)[:n_chunks] > 0
        owner = np.full(n_chunks, -1, dtype=np.int64)
        # spans are sorted: the first span covering a chunk is the smallest index whose range reaches it
        for_chunk = np.searchsorted(self.end, np.arange(n_chunks, dtype=np.int64) * chunk_elems, side="right")
        hit = for_chunk < len(self)
        owner[hit] = for_chunk[hit]
        return needed, owner


class Carry:
    """A gap chain running from one decoded run of chunks into the next: the span and its last position."""

    def __init__(self) -> None:
        self.span = -1
        self.last: torch.Tensor | None = None

    def clear(self) -> None:
        self.span, self.last = -1, None


class Decoded(NamedTuple):
    """Decoded elements of a run of chunks, in file order, restricted to the spans."""

    positions: torch.Tensor  # int64
    diffs: torch.Tensor  # int64: new - old mod 2^bits, read signed
    span: torch.Tensor  # int64: index into the spans, per element
    first: int  # the spans [first, first + len(counts)) have elements here, in element order
    counts: np.ndarray  # int64: elements of each of them


def decode_planes(
    v: PlaneViews, elem0: int, spans: Spans, carry: Carry, ctx_of: CtxOfSpan, backend: PlanesBackend | None = None
) -> Decoded:
    """Device work of the decoder for one run of whole chunks (its first element is the file's
    `elem0`): escapes patched and checked against the chunks' counts, positions from the gap chains
    of the spans (a span that began in an earlier run continues from `carry`, updated here), every
    position checked against its span's range. Vectorized over the spans: no per-tensor work, and
    one host synchronization (every check folded into one flag; when it is set, the run is decoded
    again checking as it goes, by torch, to find the fault and raise the error naming it). `ctx_of(span
    index)` names a tensor for errors. `backend`: the planes' decode ("triton": one fused kernel;
    "torch": the reference; None: Triton on CUDA where it runs)."""
    dev = v.lo.device
    chosen = backend or default_backend(dev)
    if chosen not in PLANES_BACKENDS or (chosen == "triton" and not kernels.available(dev)):
        raise ValueError(f"planes backend {chosen!r} does not run on {dev}")
    i0 = int(np.searchsorted(spans.end, elem0, side="right"))
    if i0 < len(spans) and spans.at[i0] < elem0 and (carry.span != i0 or carry.last is None):
        raise err(CodecError, "a tensor's elements continue a run that was not decoded", ctx_of(i0))
    saved = Carry()
    saved.span, saved.last = carry.span, carry.last
    try:
        out, checks = _decode(v, elem0, spans, carry, _Checks(eager=False), chosen)
    except Exception as exc:
        if backend is not None or chosen != "triton" or isinstance(exc, DeltaError):
            raise
        KERNEL_FAILED.add(str(dev))  # a kernel that does not build here: the torch path from now on
        log.warning("vllm-delta: the Triton decoder failed on %s, decoding with torch: %s", dev, exc)
        carry.span, carry.last = saved.span, saved.last
        out, checks = _decode(v, elem0, spans, carry, _Checks(eager=False), "torch")
    if checks.flag is not None and bool(checks.flag):  # the one synchronization
        _decode(
            v,
            elem0,
            spans,
            saved,
            _Checks(eager=True, elem0=elem0, chunk_elems=v.chunk_elems, spans=spans, ctx_of=ctx_of),
            "torch",
        )
        raise err(CodecError, f"elements {elem0}..{elem0 + v.n} do not decode", ctx_of(min(i0, len(spans) - 1)))
    return out


class _Checks:
    """The checks of `_decode`: folded into one device flag (no synchronization), or, `eager`, each
    tested as it comes and raised with a message naming its chunk and a tensor."""

    def __init__(
        self,
        eager: bool,
        elem0: int = 0,
        chunk_elems: int = 1,
        spans: Spans | None = None,
        ctx_of: CtxOfSpan | None = None,
    ):
        self.eager, self.elem0, self.e, self.spans, self.ctx_of = eager, elem0, chunk_elems, spans, ctx_of
        self.flag: torch.Tensor | None = None

    def __call__(self, bad: torch.Tensor, exc_type: type[DeltaError], what: str) -> None:
        """`bad`: per chunk (or one value) whether the check fails."""
        if not self.eager:
            self.flag = bad.any() if self.flag is None else self.flag | bad.any()
            return
        at = bad.reshape(-1).nonzero().reshape(-1)
        if at.numel():
            chunk = int(at[0]) if bad.dim() else 0
            assert self.spans is not None and self.ctx_of is not None
            start = self.elem0 + chunk * self.e
            j = min(int(np.searchsorted(self.spans.end, start, side="right")), len(self.spans) - 1)
            raise err(exc_type, f"chunk {start // self.e} (elements {start}..): {what}", self.ctx_of(j))

    def positions(
        self, bad: torch.Tensor, positions: torch.Tensor, local: torch.Tensor, sel: torch.Tensor | None, i0: int
    ) -> None:
        """Positions outside their span's range (the message names the position and its element)."""
        if not self.eager:
            self(bad, PositionError, "")
            return
        if bool(bad.any()):
            assert self.spans is not None and self.ctx_of is not None
            w = int(bad.nonzero()[0, 0])
            i = i0 + int(local[w])
            elem = (w if sel is None else int(sel[w])) + self.elem0
            raise err(
                PositionError,
                f"position {int(positions[w])} out of range [{self.spans.start[i]}, {self.spans.stop[i]}) "
                f"(chunk {elem // self.e}, element {elem})",
                self.ctx_of(i),
            )


def _escape_checks(v: PlaneViews, check: _Checks) -> None:
    if v.gap_esc.numel():
        check((v.gap_esc < 0).any(), PositionError, "negative gap escape")
    if v.mag_esc.numel():
        check(
            ((v.mag_esc < MAG_BIAS + MAG_ESCAPE) | (v.mag_esc > 1 << 31)).any(), CodecError, "value escape out of range"
        )


def _planes_triton(v: PlaneViews, check: _Checks) -> tuple[torch.Tensor, torch.Tensor]:
    """(gap + 1, difference) per element by the fused kernel; its per-chunk count checks folded in."""
    counts = torch.stack([v.n_big, v.n_gap_esc, v.n_mag_esc])
    inc, diffs, bad = kernels.decode_chunks(
        (v.lo, v.hi, v.sign, v.big, v.mag),
        counts,
        v.gap_esc,
        v.mag_esc,
        chunk_elems=v.chunk_elems,
        gap_escape=GAP_ESCAPE,
        mag_bias=MAG_BIAS,
        mag_escape=MAG_ESCAPE,
    )
    check(bad != 0, CodecError, "big elements or escapes do not match the index")
    _escape_checks(v, check)
    return inc, diffs


def _planes_torch(v: PlaneViews, check: _Checks) -> tuple[torch.Tensor, torch.Tensor]:
    """(gap + 1, difference) per element, int64, escapes patched, counts checked against the index."""
    n, e = v.n, v.chunk_elems
    dev = v.lo.device
    gaps = v.lo.to(torch.int64).bitwise_or_(v.hi.to(torch.int64).bitwise_left_shift_(8))
    g_esc = gaps == GAP_ESCAPE
    check(chunk_counts(g_esc, e) != v.n_gap_esc, CodecError, "gap escapes do not match the index")
    if v.gap_esc.numel():  # the r-th escape code takes the r-th entry (clamped: a count mismatch is flagged)
        check((v.gap_esc < 0).any(), PositionError, "negative gap escape")
        at = torch.cumsum(g_esc, 0).sub_(1).clamp_(0, v.gap_esc.numel() - 1)
        gaps = torch.where(g_esc, v.gap_esc[at], gaps)
        del at
    del g_esc
    neg = unpack_bits(v.sign, n)
    big = unpack_bits(v.big, n)
    n_big, rank = chunk_ranks(big, e)
    check(n_big != v.n_big, CodecError, "big elements do not match the index")
    col = torch.where(big, rank, 0)
    col += torch.arange(n, device=dev, dtype=torch.int64).div_(e, rounding_mode="floor").mul_(e)
    codes = v.mag.reshape(-1)[col].to(torch.int64)
    del col, rank
    m_esc = big & (codes == MAG_ESCAPE)
    check(chunk_counts(m_esc, e) != v.n_mag_esc, CodecError, "value escapes do not match the index")
    m = torch.where(big, codes + MAG_BIAS, 1)
    if v.mag_esc.numel():
        check(
            ((v.mag_esc < MAG_BIAS + MAG_ESCAPE) | (v.mag_esc > 1 << 31)).any(), CodecError, "value escape out of range"
        )
        at = torch.cumsum(m_esc, 0).sub_(1).clamp_(0, v.mag_esc.numel() - 1)
        m = torch.where(m_esc, v.mag_esc[at], m)
        del at
    diffs = torch.where(neg, -m, m)
    return gaps.add_(1), diffs


def _decode(
    v: PlaneViews, elem0: int, spans: Spans, carry: Carry, check: _Checks, backend: PlanesBackend
) -> tuple[Decoded, _Checks]:
    """`decode_planes`' work, its checks made through `check`."""
    n = v.n
    dev = v.lo.device
    nb = dev.type == "cuda"
    i0 = int(np.searchsorted(spans.end, elem0, side="right"))
    i1 = int(np.searchsorted(spans.at, elem0 + n, side="left"))
    if backend == "triton":
        inc, diffs = _planes_triton(v, check)
    else:
        inc, diffs = _planes_torch(v, check)
    c = torch.cumsum(inc, 0)  # p = base(span) + (C_i - C_{first(span) - 1})
    del inc
    if i1 <= i0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return Decoded(empty, empty, empty, i0, np.zeros(0, dtype=np.int64)), check
    rel_at = np.maximum(spans.at[i0:i1], elem0) - elem0
    rel_end = np.minimum(spans.end[i0:i1], elem0 + n) - elem0
    counts = rel_end - rel_at
    total = int(counts.sum())
    small = torch.from_numpy(np.stack([rel_at, counts, spans.start[i0:i1] - 1, spans.start[i0:i1], spans.stop[i0:i1]]))
    at_t, cnt_t, base, lo_t, hi_t = small.to(dev, non_blocking=nb)
    if spans.at[i0] < elem0:  # began in an earlier run: continue its gap chain (decode_planes checked it)
        assert carry.last is not None
        base[0] = carry.last
    local = segment_ids(cnt_t, total)
    if int(rel_at[0]) == 0 and int(rel_end[-1]) == n and bool((rel_at[1:] == rel_end[:-1]).all()):
        sel = None  # the spans cover the run: every element is kept
        cc, d = c, diffs
    else:
        sel = torch.arange(total, device=dev, dtype=torch.int64) - (torch.cumsum(cnt_t, 0) - cnt_t)[local]
        sel += at_t[local]
        cc, d = c[sel], diffs[sel]
    before = torch.where(at_t > 0, c[(at_t - 1).clamp(min=0)], torch.zeros_like(at_t))
    positions = cc.sub_(before[local]).add_(base[local])
    check.positions((positions < lo_t[local]) | (positions >= hi_t[local]), positions, local, sel, i0)
    if spans.end[i1 - 1] > elem0 + n:  # the last span continues in the next run
        carry.span, carry.last = i1 - 1, positions[-1:].clone().reshape(())
    else:
        carry.clear()
    return Decoded(positions, d, local.add_(i0), i0, counts), check
