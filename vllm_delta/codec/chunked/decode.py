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
    [start[i], stop[i]); the reader needs its positions in [lo[i], hi[i]) (its rank's rows: a part
    of [start, stop), or all of it); `key[i]` is the caller's name for it (an index into its own list)."""

    at: np.ndarray
    end: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    key: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def of(
        cls,
        at: ArrayLike,
        nnz: ArrayLike,
        start: ArrayLike,
        stop: ArrayLike,
        key: ArrayLike,
        lo: ArrayLike | None = None,
        hi: ArrayLike | None = None,
    ) -> Spans:
        """`lo`/`hi`: the positions needed (None: every position, [start, stop))."""
        arrays = [np.asarray(x, dtype=np.int64).reshape(-1) for x in (at, nnz, start, stop, key)]
        arrays.append(arrays[2] if lo is None else np.asarray(lo, dtype=np.int64).reshape(-1))
        arrays.append(arrays[3] if hi is None else np.asarray(hi, dtype=np.int64).reshape(-1))
        keep = arrays[1] > 0
        at_, nnz_, start_, stop_, key_, lo_, hi_ = (x[keep] for x in arrays)
        order = np.argsort(at_, kind="stable")
        return cls(at_[order], (at_ + nnz_)[order], start_[order], stop_[order], key_[order], lo_[order], hi_[order])

    def __len__(self) -> int:
        return int(self.at.size)

    def shifted(self, elems: int, keys: int) -> Spans:
        """The same spans `elems` elements later, their keys `keys` higher (files read as one sequence)."""
        return Spans(self.at + elems, self.end + elems, self.start, self.stop, self.key + keys, self.lo, self.hi)

    @classmethod
    def concat(cls, parts: list[Spans]) -> Spans:
        """Spans of consecutive ranges of elements, in order."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in _SPAN_FIELDS))

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

    def chunks(
        self, chunk_elems: int, n_chunks: int, first: np.ndarray | None = None, ctx_of: CtxOfSpan | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(which chunks hold elements of positions the spans need, the first span holding elements of
        each chunk). Without `first` (files written before it) a span needing any position needs all
        its chunks (its gap chain runs through them); with `first` (each chunk's first position) a
        chunk is needed where a span's positions in it, bounded by the first positions of the chunk
        and of the next, meet the span's needed range: the chunks of other ranks' rows are skipped.
        `first` is checked against the spans (CodecError naming a tensor through `ctx_of`)."""
        e = chunk_elems
        first_k, last_k = self.at // e, (self.end - 1) // e
        wanted = (self.lo < self.hi) & (self.lo < self.stop) & (self.hi > self.start)
        owner = np.full(n_chunks, -1, dtype=np.int64)
        # spans are sorted: the first span covering a chunk is the smallest index whose range reaches it
        for_chunk = np.searchsorted(self.end, np.arange(n_chunks, dtype=np.int64) * e, side="right")
        hit = for_chunk < len(self)
        owner[hit] = for_chunk[hit]
        if first is None:
            marks = np.zeros(n_chunks + 1, dtype=np.int64)
            np.add.at(marks, first_k[wanted], 1)
            np.add.at(marks, last_k[wanted] + 1, -1)
            return np.cumsum(marks)[:n_chunks] > 0, owner
        # one row per (span, chunk it has elements in): ~ spans + chunks rows
        per = last_k - first_k + 1
        span = np.repeat(np.arange(len(self), dtype=np.int64), per)
        k = np.repeat(first_k, per) + (np.arange(span.size, dtype=np.int64) - np.repeat(np.cumsum(per) - per, per))
        holds_first = self.at[span] <= k * e  # the span holds the chunk's first element
        holds_next = (k + 1) * e < self.end[span]  # ... and the next chunk's
        start, stop = self.start[span], self.stop[span]
        f = first[k]
        nxt = first[np.minimum(k + 1, n_chunks - 1)]
        for bad, exc_type, what in (
            (holds_first & ((f < start) | (f >= stop)), PositionError, "out of its tensor's range"),
            (holds_first & holds_next & (nxt < f + e), CodecError, "not below the next chunk's by its elements"),
        ):
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                msg = f"chunk {int(k[i])}: its first position {int(f[i])} (`first`) is {what}"
                raise err(exc_type, msg, ctx_of(int(span[i])) if ctx_of is not None else {})
        p_lo = np.where(holds_first, f, start)  # the span's positions in the chunk lie in [p_lo, p_hi)
        p_hi = np.where(holds_next, nxt, stop)
        need = wanted[span] & (p_lo < self.hi[span]) & (p_hi > self.lo[span])
        needed = np.zeros(n_chunks, dtype=bool)
        needed[k[need]] = True
        return needed, owner


_SPAN_FIELDS = ("at", "end", "start", "stop", "key", "lo", "hi")


class Carry:
    """A gap chain running from one decoded run of chunks into the next: the span and its last
    position (`last`, a device scalar), or, where the run before was skipped, the position of the
    run's first element (`first`: the file's `first` entry of its first chunk)."""

    def __init__(self) -> None:
        self.span = -1
        self.last: torch.Tensor | None = None
        self.first: int | None = None

    def clear(self) -> None:
        self.span, self.last, self.first = -1, None, None

    def resume(self, span: int, first: int) -> None:
        """The next run starts inside `span`, at position `first` (the chunks before it were skipped)."""
        self.span, self.last, self.first = span, None, first

    def copy(self) -> Carry:
        out = Carry()
        out.span, out.last, out.first = self.span, self.last, self.first
        return out


class Decoded(NamedTuple):
    """Decoded elements of a run of chunks, in file order, restricted to the spans."""

    positions: torch.Tensor  # int64
    diffs: torch.Tensor  # int64: new - old mod 2^bits, read signed
    span: torch.Tensor  # int64: index into the spans, per element
    first: int  # the spans [first, first + len(counts)) have elements here, in element order
    counts: np.ndarray  # int64: elements of each of them
    # `decode_planes(defer=True)`: the run's checks folded into one device flag, not yet read; the
    # positions are clamped into their spans' ranges meanwhile (a flagged run's garbage addresses
    # nothing outside its tensors), and the caller reads the flag later (`recheck` names the fault)
    flag: torch.Tensor | None = None


def decode_planes(
    v: PlaneViews,
    elem0: int,
    spans: Spans,
    carry: Carry,
    ctx_of: CtxOfSpan,
    backend: PlanesBackend | None = None,
    *,
    defer: bool = False,
) -> Decoded:
    """Device work of the decoder for one run of whole chunks (its first element is the file's
    `elem0`): escapes patched and checked against the chunks' counts, positions from the gap chains
    of the spans (a span that began in an earlier run continues from `carry`, updated here), every
    position checked against its span's range. Vectorized over the spans: no per-tensor work, and
    one host synchronization (every check folded into one flag; when it is set, the run is decoded
    again checking as it goes, by torch, to find the fault and raise the error naming it: `recheck`).
    With `defer`, not even that: the flag comes back unread in `Decoded.flag` (positions clamped into
    their spans' ranges), for the caller to read once for many runs. `ctx_of(span index)` names a
    tensor for errors. `backend`: the planes' decode ("triton": one fused kernel; "torch": the
    reference; None: Triton on CUDA where it runs)."""
    dev = v.lo.device
    chosen = backend or default_backend(dev)
    if chosen not in PLANES_BACKENDS or (chosen == "triton" and not kernels.available(dev)):
        raise ValueError(f"planes backend {chosen!r} does not run on {dev}")
    i0 = int(np.searchsorted(spans.end, elem0, side="right"))
    continued = carry.last is not None or carry.first is not None
    if i0 < len(spans) and spans.at[i0] < elem0 and (carry.span != i0 or not continued):
        raise err(CodecError, "a tensor's elements continue a run that was not decoded", ctx_of(i0))
    saved = carry.copy()
    try:
        out, checks = _decode(v, elem0, spans, carry, _Checks(eager=False, clamp=defer), chosen)
    except Exception as exc:
        if backend is not None or chosen != "triton" or isinstance(exc, DeltaError):
            raise
        KERNEL_FAILED.add(str(dev))  # a kernel that does not build here: the torch path from now on
        log.warning("vllm-delta: the Triton decoder failed on %s, decoding with torch: %s", dev, exc)
        carry.span, carry.last, carry.first = saved.span, saved.last, saved.first
        out, checks = _decode(v, elem0, spans, carry, _Checks(eager=False, clamp=defer), "torch")
    if defer:
        flag = checks.flag if checks.flag is not None else torch.zeros((), dtype=torch.bool, device=dev)
        return out._replace(flag=flag)
    if checks.flag is not None and bool(checks.flag):  # the one synchronization
        recheck(v, elem0, spans, saved, ctx_of)
    return out


def recheck(v: PlaneViews, elem0: int, spans: Spans, carry: Carry, ctx_of: CtxOfSpan) -> None:
    """A run whose checks failed, decoded again by torch checking as it goes from the carry it started
    with: raises the error naming the chunk and a tensor (a generic CodecError if no check names one)."""
    _decode(
        v,
        elem0,
        spans,
        carry.copy(),
        _Checks(eager=True, elem0=elem0, chunk_elems=v.chunk_elems, spans=spans, ctx_of=ctx_of),
        "torch",
    )
    i0 = int(np.searchsorted(spans.end, elem0, side="right"))
    raise err(CodecError, f"elements {elem0}..{elem0 + v.n} do not decode", ctx_of(min(i0, len(spans) - 1)))


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
        clamp: bool = False,
    ):
        self.eager, self.elem0, self.e, self.spans, self.ctx_of = eager, elem0, chunk_elems, spans, ctx_of
        self.clamp = clamp  # the flag is read later: keep positions inside their spans meanwhile
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
        if carry.last is not None:
            base[0] = carry.last
        else:  # the run before was skipped: the first element is at `carry.first`
            assert carry.first is not None
            base[0] = c[0].neg() + carry.first
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
    lo_e, hi_e = lo_t[local], hi_t[local]
    check.positions((positions < lo_e) | (positions >= hi_e), positions, local, sel, i0)
    if check.clamp:  # unread checks: nothing downstream may address outside the span's tensor
        positions = torch.maximum(torch.minimum(positions, hi_e.sub_(1)), lo_e)
    if v.first is not None:  # each chunk's first element decoded where the file's `first` says
        check(_first_differs(v, positions, sel), CodecError, "its first position differs from the file's `first`")
    if spans.end[i1 - 1] > elem0 + n:  # the last span continues in the next run
        carry.span, carry.last, carry.first = i1 - 1, positions[-1:].clone().reshape(()), None
    else:
        carry.clear()
    return Decoded(positions, d, local.add_(i0), i0, counts), check


def _first_differs(v: PlaneViews, positions: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
    """Per chunk of the run: its first element was decoded (it belongs to a span) at a position other
    than the file's `first` entry (bool [chunks])."""
    assert v.first is not None
    e = v.chunk_elems
    starts = torch.arange(0, v.n, e, device=positions.device, dtype=torch.int64)
    if sel is None:
        return positions[starts] != v.first
    if not sel.numel():
        return torch.zeros(starts.numel(), dtype=torch.bool, device=positions.device)
    at = torch.searchsorted(sel, starts).clamp_(max=sel.numel() - 1)
    return (sel[at] == starts) & (positions[at] != v.first)
