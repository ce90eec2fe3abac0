"""Exact change detection: compare the low-precision image of the owned weights with the last published one.

The snapshot holds the last published bit patterns of every element this rank owns (2 bytes per
element for bf16) in one flat buffer, on the parameters' device or in (pinned) host memory.
Comparing bit patterns, not values, makes recall 1.0 by construction: every element whose published
bits change is found, including sign flips of zero and NaN payloads.

A publish works on all owned tensors at once, in large chunks of the flat buffer: the image of a
chunk's tensors is written into one flat buffer (the dtype conversion), compared with the snapshot
in one kernel and compacted in one `nonzero`; positions, checksum terms and per-tensor sums are
then computed for all tensors together. The host waits for the device once per chunk (the size of
the compaction) and once at the end (per-tensor counts and checksum sums); nothing is done tensor by
tensor on the host. On CUDA the work runs on a side stream that waits for the caller's stream (the
optimizer step), and the conversion and comparison are one Triton kernel that never writes the image
(kernels.py; backend "triton", the default on CUDA; "torch" elsewhere, or VLLM_DELTA_DETECT_BACKEND).

With "triton" and the snapshot on the parameters' device, the chunks give way to the whole-model
bitmask path (`_changes_bitmask`): one kernel converts, compares and writes one bit per element and a
count per block, a cumsum sizes the outputs (one host wait per pass), and a second kernel compacts
and finishes the changed elements (positions, new and old bits, snapshot update, checksum partials).
It reads 6 B per fp32 element and writes 1/8 B plus the changes, where the chunked path also writes
and re-reads an int8 mask and runs `nonzero`. Its outputs are the chunked path's, bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..bits import INT_DTYPE, bit_view
from ..checksums import partial_terms, positional_sum_tensor
from . import kernels
from .names import checkpoint_tensors
from .shard import Owned, ShardedTensor, local_tensor

CHUNK_ELEMS = 1 << 28  # elements compared per chunk: bounds the temporaries (2 B image + 1 B mask each)
BACKENDS = (None, "torch", "triton", "triton-chunked")
PASS_ELEMS = 1 << 34  # elements per pass of the bitmask path (1/8 B each): one pass for any model that fits
STREAM_PASS_ELEMS = 1 << 31  # ... when each pass's changes are handed on (`consume`): bounded memory


def named_tensors(source: nn.Module | Mapping[str, object] | Iterable[tuple[str, object]]):
    """(name, tensor) pairs to publish; tensors sharing storage (tied weights) appear once.

    Values may be tensors, DTensors or `ShardedTensor`s (a hand-sharded mapping)."""
    items: Iterable[tuple[str, object]]
    if isinstance(source, nn.Module):
        items = checkpoint_tensors(source)  # checkpoint names (names.py); tied duplicates dropped
    elif isinstance(source, Mapping):
        items = source.items()
    else:
        items = source
    seen, out = set(), []
    for name, t in items:
        local = t.local if isinstance(t, ShardedTensor) else t
        if isinstance(local, torch.Tensor) and hasattr(local, "to_local"):  # a DTensor: its local shard
            local = local_tensor(local)
        if isinstance(local, torch.Tensor):
            key = (
                local.untyped_storage().data_ptr(),
                local.storage_offset(),
                tuple(local.shape),
                tuple(local.stride()),
            )
            if local.numel() and key in seen:
                continue
            seen.add(key)
        out.append((name, t))
    return out


Consume = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""Takes one pass's changes (positions, tensor index, new bits, old bits), in owned order."""


@dataclass
class Detected:
    """Changes of the owned elements since the last publish, all tensors end to end, in owned order
    (empty tensors when they were handed to a `consume` callback pass by pass)."""

    positions: torch.Tensor  # int64: global row-major positions in each tensor
    new: torch.Tensor  # new bit patterns (int16 for bf16)
    old: torch.Tensor  # old bit patterns
    seg: torch.Tensor  # int64: index (into the owned list) of each element's tensor
    counts: list[int]  # changed elements per owned tensor
    sums: list[int]  # per owned tensor: Σ w(p)(new - old) mod 2^64, what its checksum moved by


@dataclass
class AnchorImage:
    """The owned elements' whole image (an anchor), on the host."""

    host: list[torch.Tensor]  # per owned tensor, its rows in their shape
    sums: list[int]  # per owned tensor: positional sum over the owned elements (global positions)


class FlatSnapshot:
    """The last published image of the owned elements, one flat integer buffer, with its chunk plan."""

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        device: torch.device | str | None = None,
        pin: bool = False,
        chunk_elems: int = CHUNK_ELEMS,
        backend: str | None = None,
        pass_elems: int = PASS_ELEMS,
        stream_pass_elems: int = STREAM_PASS_ELEMS,
        bitmask: bool = True,
        fused: bool = True,
    ):
        """`backend`: "triton" (fused convert-and-compare kernels; CUDA, or CPU under TRITON_INTERPRET=1),
        "triton-chunked" (the same kernels on the chunked int8-mask path only: `bitmask=False`) or
        "torch"; None: VLLM_DELTA_DETECT_BACKEND, else "triton" on CUDA when available.

        With "triton" and the snapshot on the parameters' device, `changes` runs the bitmask path
        (kernels.py: `bitmask_`, one cumsum and host wait, `compact_`) over all tensors in passes of
        at most `pass_elems` elements (temporaries: 1/8 B per element of a pass). It falls back to the
        chunked int8-mask path (per chunk `mask_`, `nonzero`, `gather_image`) when the snapshot lives
        elsewhere (host memory) or the kernels can't address the sources (mixed dtypes), and
        `bitmask=False` selects that path always. All paths give the same bits, positions and sums.
        `stream_pass_elems`: the bitmask path's pass when each pass's changes are handed on
        (`changes(consume=...)`): fewer passes wait on the host fewer times, larger ones hold more
        changes on the device at once (~20 B per change at once: positions, tensor, new, old).
        `fused=False` runs the bitmask path's compaction in two launches instead of one."""
        backend = backend or os.environ.get("VLLM_DELTA_DETECT_BACKEND") or None
        if backend not in BACKENDS:
            raise ValueError(f"detection backends: {', '.join(b for b in BACKENDS if b)} (not {backend!r})")
        if backend == "triton-chunked":
            backend, bitmask = "triton", False
        self.backend = backend
        self.dtype = dtype
        self.int_dtype = INT_DTYPE[torch.empty((), dtype=dtype).element_size()]
        self.device = torch.device(device) if device is not None else None
        self.pin = pin
        self.chunk_elems = max(1, int(chunk_elems))
        self.bits: torch.Tensor | None = None  # flat snapshot
        self.key: list[tuple[str, int, int]] = []  # (name, start, count) of each owned tensor, in order
        self._planned_for: list[Owned] | None = None  # the list `key` was taken from
        self._offsets: list[int] = []  # flat offset of each owned tensor in `bits`
        self._chunks: list[list[tuple[int, int, int, int]]] = []  # per chunk: (tensor, a, b, dst)
        self._chunk_starts: list[int] = []
        self._chunk_sizes: list[int] = []
        self._image: torch.Tensor | None = None  # reused chunk image buffer (torch backend)
        self._mask: torch.Tensor | None = None  # reused chunk mask buffer (triton backend)
        self._addr: dict[int, tuple[tuple[int, ...], kernels.ChunkAddressing]] = {}
        self._stream: Any = None  # torch.cuda.Stream once used on CUDA
        self.pass_elems = max(1, int(pass_elems))
        self.stream_pass_elems = max(1, int(stream_pass_elems))
        self.bitmask = bitmask
        self.fused = fused
        self._table: tuple[tuple[int, ...], kernels.DetectTable] | None = None
        self._scratch: dict[str, torch.Tensor] = {}  # reused buffers of the bitmask path

    # -- layout ----------------------------------------------------------------------------------
    def matches(self, owned: list[Owned]) -> bool:
        """Whether `owned` has the layout of the last anchor (deltas are taken against it)."""
        if self.bits is None:
            return False
        if owned is self._planned_for:  # the same resolved list (sources.SourceCache): no per-tensor compare
            return True
        return self.key == [(o.name, o.start, o.count) for o in owned]

    def _plan(self, owned: list[Owned]) -> None:
        self.key = [(o.name, o.start, o.count) for o in owned]
        self._planned_for = owned
        self._offsets, at = [], 0
        for o in owned:
            self._offsets.append(at)
            at += o.count
        self._chunks, self._chunk_starts = [], []
        chunk: list[tuple[int, int, int, int]] = []
        fill = 0
        for i, o in enumerate(owned):
            a = 0
            while a < o.count:
                if fill == self.chunk_elems:
                    self._chunks.append(chunk)
                    chunk, fill = [], 0
                take = min(o.count - a, self.chunk_elems - fill)
                chunk.append((i, a, a + take, fill))
                a, fill = a + take, fill + take
        if chunk:
            self._chunks.append(chunk)
        starts, sizes, at = [], [], 0
        for chunk in self._chunks:
            starts.append(at)
            sizes.append(chunk[-1][3] + chunk[-1][2] - chunk[-1][1])
            at += sizes[-1]
        self._chunk_starts, self._chunk_sizes = starts, sizes
        self._addr = {}
        self._table = None

    @staticmethod
    def compute_device(owned: list[Owned]) -> torch.device:
        devices = {o.source.device for o in owned}
        if len(devices) > 1:
            raise ValueError(f"the published tensors live on several devices ({sorted(map(str, devices))})")
        return devices.pop() if devices else torch.device("cpu")

    def side_stream(self, dev: torch.device):
        """A context running on the detection's side stream (CUDA; else nothing): the publisher runs
        the codec's device work on it too, so that its temporaries stay on one stream."""
        return self._stream_ctx(dev)

    def _stream_ctx(self, dev: torch.device):
        if dev.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None or self._stream.device != dev:
            self._stream = torch.cuda.Stream(dev)
        # Ordered after everything the caller queued (the optimizer step) without a host wait.
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        return torch.cuda.stream(self._stream)

    def _fill(self, c: int, owned: list[Owned], dev: torch.device) -> torch.Tensor:
        """The image of chunk `c` (integer bit view), written into the reused buffer."""
        chunk = self._chunks[c]
        n = chunk[-1][3] + chunk[-1][2] - chunk[-1][1]
        if self._image is None or self._image.device != dev or self._image.numel() < n:
            self._image = None
            self._image = torch.empty(max(self._chunk_sizes), dtype=self.dtype, device=dev)
        img = self._image[:n]
        for i, a, b, dst in chunk:
            img[dst : dst + b - a].copy_(owned[i].source[a:b])  # the dtype conversion
        return bit_view(img)

    def _use_triton(self, dev: torch.device) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            if not kernels.available(dev, self.dtype):
                raise ValueError(
                    f"the triton detection backend can't make {self.dtype} images on {dev} "
                    "(bf16 images only; CPU: set TRITON_INTERPRET=1)"
                )
            return True
        return dev.type == "cuda" and kernels.available(dev, self.dtype)  # the kernels make bf16 images only

    def _addressing(self, c: int, owned: list[Owned], dev: torch.device) -> kernels.ChunkAddressing:
        """Chunk `c`'s block table (cached while the sources stay where they are)."""
        chunk = self._chunks[c]
        key = tuple(owned[i].source.data_ptr() for i, _, _, _ in chunk)
        cached = self._addr.get(c)
        if cached is None or cached[0] != key:
            segs = [(owned[i].source, a, b - a, dst) for i, a, b, dst in chunk]
            cached = self._addr[c] = (key, kernels.ChunkAddressing(segs, dev))
        return cached[1]

    def _detect_table(self, owned: list[Owned], dev: torch.device) -> kernels.DetectTable:
        """The whole-model block table (cached while the sources stay where they are)."""
        key = tuple(o.source.data_ptr() for o in owned)
        if self._table is None or self._table[0] != key or self._table[1].base.device != dev:
            self._table = None
            segs = [(o.source, off, o.count, o.start) for o, off in zip(owned, self._offsets)]
            self._table = (key, kernels.DetectTable(segs, dev))
        return self._table[1]

    def _buffer(self, name: str, n: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        buf = self._scratch.get(name)
        if buf is None or buf.device != dev or buf.dtype != dtype or buf.numel() < n:
            self._scratch.pop(name, None)
            buf = self._scratch[name] = torch.empty(n, dtype=dtype, device=dev)
        return buf[:n]

    # -- anchors ---------------------------------------------------------------------------------
    @torch.no_grad()
    def anchor(self, owned: list[Owned]) -> AnchorImage:
        """Take the whole image: the new snapshot, its host copy, and each tensor's positional sum."""
        dev = self.compute_device(owned)
        home = self.device if self.device is not None else dev
        self._plan(owned)
        total = sum(o.count for o in owned)
        with self._stream_ctx(dev):
            if self.bits is None or self.bits.numel() != total or self.bits.device != home:
                self.bits = None
                pin = self.pin and home.type == "cpu" and torch.cuda.is_available()
                self.bits = torch.empty(total, dtype=self.int_dtype, device=home, pin_memory=pin)
            host = torch.empty(total, dtype=self.dtype)
            host_bits = bit_view(host)
            for c, start in enumerate(self._chunk_starts):
                img = self._fill(c, owned, dev)
                self.bits[start : start + img.numel()].copy_(img)
                host_bits[start : start + img.numel()].copy_(img)
            sums = [
                positional_sum_tensor(self.bits[off : off + o.count], o.start) for off, o in zip(self._offsets, owned)
            ]
            values = _unsigned(torch.stack(sums)) if sums else []
        images = [host[off : off + o.count].view(o.slice_shape) for off, o in zip(self._offsets, owned)]
        return AnchorImage(host=images, sums=values)

    # -- deltas ----------------------------------------------------------------------------------
    @torch.no_grad()
    def changes(self, owned: list[Owned], consume: Consume | None = None) -> Detected:
        """Elements whose image bits differ from the snapshot; the snapshot takes the new bits.

        With `consume`, the changes are handed to it as they are found (the bitmask path: pass by
        pass, passes of `stream_pass_elems` elements, so that only one pass's changes are on the device
        at a time; other paths: once), on the detection's stream, and the returned Detected has
        empty tensors (its counts and sums as always)."""
        if not self.matches(owned):
            raise ValueError("the owned tensors changed since the last anchor: publish an anchor")
        assert self.bits is not None
        dev = self.compute_device(owned)
        triton_path = self._use_triton(dev)
        if triton_path and self.bitmask and self.bits.device == dev:
            table = self._detect_table(owned, dev)
            if table.ok:
                with self._stream_ctx(dev):
                    return self._changes_bitmask(table, len(owned), dev, consume)
        found = self._changes_chunked(owned, dev, triton_path)
        if consume is not None:
            with self._stream_ctx(dev):
                consume(found.positions, found.seg, found.new, found.old)
            empty = found.positions[:0]
            found.positions, found.seg, found.new, found.old = empty, empty, found.new[:0], found.old[:0]
        return found

    def _changes_chunked(self, owned: list[Owned], dev: torch.device, triton_path: bool) -> Detected:
        """`changes` by the chunked paths (int8 mask + nonzero per chunk; torch or Triton)."""
        assert self.bits is not None
        with self._stream_ctx(dev):
            found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            for c, start in enumerate(self._chunk_starts):
                n = self._chunk_sizes[c]
                snap = self.bits[start : start + n]
                old_all = snap.to(dev, non_blocking=True) if snap.device != dev else snap
                addr = self._addressing(c, owned, dev) if triton_path else None
                if addr is not None and addr.ok:
                    if self._mask is None or self._mask.device != dev or self._mask.numel() < n:
                        self._mask = None
                        self._mask = torch.empty(max(self._chunk_sizes), dtype=torch.int8, device=dev)
                    mask = self._mask[:n]
                    kernels.mask_(addr, old_all, mask)
                    idx = mask.nonzero().reshape(-1)  # the one host wait of a chunk
                    new = kernels.gather_image(addr, idx)
                else:
                    img = self._fill(c, owned, dev)
                    idx = (img != old_all).nonzero().reshape(-1)  # the one host wait of a chunk
                    new = img[idx]
                old = old_all[idx]
                if snap.device != dev:
                    snap.index_copy_(0, idx.to(snap.device), new.to(snap.device))
                else:
                    snap.index_copy_(0, idx, new)
                found.append((idx.add_(start), new, old))
            flat = torch.cat([f[0] for f in found]) if found else torch.zeros(0, dtype=torch.int64, device=dev)
            new = torch.cat([f[1] for f in found]) if found else torch.zeros(0, dtype=self.int_dtype, device=dev)
            old = torch.cat([f[2] for f in found]) if found else torch.zeros(0, dtype=self.int_dtype, device=dev)
            t = len(owned)
            meta = torch.tensor(self._offsets + [o.start for o in owned], dtype=torch.int64).to(dev, non_blocking=True)
            offsets, starts = meta[:t], meta[t:]
            seg = torch.searchsorted(offsets, flat, right=True).sub_(1)
            positions = flat.sub_(offsets[seg]).add_(starts[seg])
            counts = torch.bincount(seg, minlength=t)
            terms = partial_terms(positions.clone(), new, old)
            sums = torch.zeros(t, dtype=torch.int64, device=dev).index_add_(0, seg, terms)
            host = torch.cat([counts, sums]).cpu()  # the final host wait
        return Detected(
            positions=positions, new=new, old=old, seg=seg, counts=host[:t].tolist(), sums=_unsigned(host[t:])
        )

    def _changes_bitmask(
        self, table: kernels.DetectTable, t: int, dev: torch.device, consume: Consume | None = None
    ) -> Detected:
        """`changes` by the bitmask path: per pass, `bitmask_`, a cumsum of the block counts, the
        pass's one host wait (its total), `compact_`; then one host wait for the per-tensor counts and
        sums (differences of cumsums over the blocks' counts and partials, mod 2^64)."""
        assert self.bits is not None
        nb, wpb = table.n_blocks, table.words_per_block
        counts = self._buffer("counts", nb, torch.int32, dev)
        bsums = self._buffer("bsums", nb, torch.int64, dev)
        found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        pass_elems = self.pass_elems if consume is None else min(self.pass_elems, self.stream_pass_elems)
        for b0, b1 in table.passes(pass_elems):
            words = self._buffer("words", (b1 - b0) * wpb, torch.int32, dev)
            kernels.bitmask_(table, b0, b1, self.bits, words, counts[b0:b1])
            incl = torch.cumsum(counts[b0:b1], 0, dtype=torch.int64)
            total = int(incl[-1])  # the one host wait of a pass: the size of its outputs
            out = (
                torch.empty(total, dtype=torch.int64, device=dev),
                torch.empty(total, dtype=torch.int64, device=dev),
                torch.empty(total, dtype=self.int_dtype, device=dev),
                torch.empty(total, dtype=self.int_dtype, device=dev),
            )
            if total:
                kernels.compact_(
                    table, b0, b1, self.bits, words, counts[b0:b1], incl, out, bsums[b0:b1], fused=self.fused
                )
            else:
                bsums[b0:b1].zero_()
            if consume is not None:
                consume(out[0], out[1], out[2], out[3])
                del out
                continue
            found.append(out)
        if len(found) == 1:
            positions, seg, new, old = found[0]
        elif found:
            positions, seg, new, old = (torch.cat([f[i] for f in found]) for i in range(4))
        else:
            positions, seg = (torch.zeros(0, dtype=torch.int64, device=dev) for _ in range(2))
            new, old = (torch.zeros(0, dtype=self.int_dtype, device=dev) for _ in range(2))
        # per tensor: the blocks [first[i], first[i+1]) are tensor i's; sums of a range are differences
        # of inclusive cumsums (int64 wrapping: exact mod 2^64)
        acc = torch.zeros(2, nb + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, dtype=torch.int64, out=acc[0, 1:])
        torch.cumsum(bsums, 0, out=acc[1, 1:])
        ends = acc[:, table.first]
        host = (ends[:, 1:] - ends[:, :-1]).cpu()  # the final host wait
        return Detected(
            positions=positions, new=new, old=old, seg=seg, counts=host[0, :t].tolist(), sums=_unsigned(host[1, :t])
        )


def _unsigned(sums: torch.Tensor) -> list[int]:
    """int64 sums (wrapped) as the unsigned values mod 2^64 they stand for, without a Python op per tensor."""
    return sums.cpu().numpy().view(np.uint64).tolist()


__all__ = [
    "BACKENDS",
    "CHUNK_ELEMS",
    "STREAM_PASS_ELEMS",
    "AnchorImage",
    "Consume",
    "Detected",
    "FlatSnapshot",
    "named_tensors",
]
