"""The codecs' shared vocabulary: change sets, host sections, batches, errors and checks.

A change set is (positions, new bit patterns) with positions the sorted, unique row-major flat
indices of the changed elements. Every codec runs in four steps, so that the device work and the
host work can be placed where they belong (trainer: detect on the GPU, compress on a background
thread; server: decompress before the pause, finish on a side stream):

    prepare (device)  -> Sections (host arrays) -> pack (host)   -> file tensors + JSON meta
    unpack  (host)    -> Sections (host arrays) -> finish (device) -> Changes

`prepare_batch` is `prepare` over many tensors at once (the trainer's detection output). A
*file-level* codec (`chunked`, format 3) packs every changed tensor of a file into one set of
streams (`pack_file`) instead of one payload per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..bits import wrap_add, wrap_sub
from ..errors import CodecError, DeltaError, PositionError

Ctx = dict[str, Any]  # {"version": int, "tensor": str}: where an error happened, for its message


@dataclass
class Changes:
    """Decoded changes of one tensor, on one device. New values come from `new_bits(old)`."""

    positions: torch.Tensor  # int64, sorted, unique
    values: torch.Tensor | None = None  # absolute bit patterns (int16/int32), codecs without a base
    diffs: torch.Tensor | None = None  # new - old mod 2^bits, as int64

    @property
    def needs_base(self) -> bool:
        return self.values is None

    def new_bits(self, old_bits: torch.Tensor | None) -> torch.Tensor:
        """New bit patterns (same integer dtype as `old_bits`) for the changed positions."""
        if self.values is not None:
            return self.values
        if old_bits is None or self.diffs is None:
            raise CodecError("this codec's values are relative to the base; pass the base values")
        return wrap_add(old_bits, self.diffs, old_bits.element_size())

    def old_bits(self, new_bits: torch.Tensor) -> torch.Tensor:
        """The bit patterns the changed positions held before (old = new - d): undoing the delta."""
        if self.diffs is None:
            raise CodecError("this codec stores new values, not differences: its changes cannot be undone")
        return wrap_sub(new_bits, self.diffs, new_bits.element_size())


@dataclass
class Sections:
    """Host-side intermediate form of a codec: named numpy arrays plus small metadata."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def host_array(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


@dataclass
class Batch:
    """Changes of several tensors laid end to end on one device (the trainer's detection output).

    Element i belongs to tensor `seg[i]` (non-decreasing); positions are row-major flat indices into
    that whole tensor, increasing within it and at least `starts[seg[i]]` (where the tensor's first
    frame starts: 0, or the first position a part owns)."""

    positions: torch.Tensor  # int64
    new: torch.Tensor  # new bit patterns (int16/int32)
    old: torch.Tensor  # old bit patterns
    seg: torch.Tensor  # int64 tensor index of each element
    counts: list[int]  # changed elements per tensor (host)
    starts: list[int] | np.ndarray  # per tensor: the position its first frame starts from
    numels: list[int]  # per tensor: elements of the whole tensor


class BatchSections:
    """Per-tensor Sections of a Batch, once the device-to-host copies are done: `wait()` waits for
    them (an event on CUDA); `split()` waits too and returns one Sections per tensor (None where
    nothing changed)."""

    def __init__(self, split: Callable[[], list[Sections | None]], wait: Callable[[], None] = lambda: None):
        self._split, self._wait = split, wait

    def wait(self) -> None:
        self._wait()

    def begin(self) -> None:
        """Start what the file's encode does on the device now, before the host lays out the file (a
        codec may: the chunked codec's GPU compression; by default nothing)."""

    def split(self) -> list[Sections | None]:
        self._wait()
        return self._split()


class HostCopy:
    """Device-to-host copies into pinned memory on the current stream, waited for by an event."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.event: Any = None

    def add(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t.detach().contiguous()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def done(self) -> None:
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def check_piece(positions: torch.Tensor, start: int, stop: int, ctx: Ctx) -> None:
    """A piece's decoded positions lie in [start, stop) (the rows its part owns)."""
    if positions.numel() and (int(positions.min()) < start or int(positions.max()) >= stop):
        raise err(PositionError, f"positions outside the piece's range [{start}, {stop})", ctx)


def err(exc_type: type[DeltaError], msg: str, ctx: Ctx) -> DeltaError:
    return exc_type(msg, version=ctx.get("version"), tensor=ctx.get("tensor"))


def position_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= np.iinfo(np.int32).max else torch.int64


def segment_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """For segments of `counts` elements laid end to end (sum n): each element's segment index (int64).

    `torch.repeat_interleave` runs one CUDA thread per segment, slow for a few long segments; this is
    marks + prefix sum, parallel over elements."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=counts.device)
    marks = torch.zeros(n + 1, dtype=torch.int32, device=counts.device)
    ends = torch.cumsum(counts.to(torch.int64), 0)
    marks.index_add_(0, ends, torch.ones_like(ends, dtype=torch.int32))
    return torch.cumsum(marks[:n], 0, dtype=torch.int64)


def check_positions(pos: torch.Tensor, numel: int, ctx: Ctx) -> None:
    """Sorted, unique, within [0, numel). Raises PositionError naming the first offender."""
    if pos.numel() == 0:
        return
    if int(pos.min()) < 0 or int(pos.max()) >= numel:
        bad = int(pos[(pos < 0) | (pos >= numel)][0])
        raise err(PositionError, f"position {bad} out of range for {numel} elements", ctx)
    if pos.numel() > 1:
        step = pos[1:] - pos[:-1]
        if bool((step <= 0).any()):
            i = int((step <= 0).nonzero()[0])
            kind = "duplicated" if int(step[i]) == 0 else "unsorted"
            raise err(PositionError, f"positions {kind} at entry {i + 1} ({int(pos[i])}, {int(pos[i + 1])})", ctx)


class Codec(Protocol):
    """What every codec provides (the four steps of the module docstring; `prepare_batch` is
    `prepare` over many tensors at once)."""

    name: str
    needs_base: bool

    def prepare(
        self, positions: torch.Tensor, new_bits: torch.Tensor, old_bits: torch.Tensor, numel: int, start: int = 0
    ) -> Sections: ...

    def prepare_batch(self, batch: Batch) -> BatchSections: ...

    def pack(self, sections: Sections, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...

    def unpack(
        self, tensors: Mapping[str, torch.Tensor], meta: Any, *, numel: int, nnz: int, dtype: torch.dtype, ctx: Ctx
    ) -> Sections: ...

    def finish(self, sections: Sections, *, numel: int, device: torch.device | str, ctx: Ctx) -> Changes: ...


class PassEncoder(Protocol):
    """An encoder fed a batch's changes in passes (the trainer's detection, pass by pass)."""

    def add(self, positions: torch.Tensor, seg: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None: ...

    def finish(self, counts: Sequence[int]) -> BatchSections: ...


class FilePayload(Protocol):
    """What a file-level codec's `pack_file` returns (chunked.FilePack)."""

    payload: dict[str, torch.Tensor]  # by part name: stored under `::<part>`
    enc: dict[str, Any]  # the file's codec metadata (the header's `enc`)
    tensor_enc: dict[str, dict[str, Any]]  # each packed tensor's `enc`


class PayloadSink(Protocol):
    """Where a file-level codec streams its payload: parts in order, each in one or more appends
    (concatenated along dimension 0). `ready()`, if given, waits until `data` holds its bytes (a
    device-to-host copy in flight). `restart()` drops everything appended (a fallback writes again).
    format.PayloadWriter writes a file as the parts come; MemorySink keeps them."""

    def append(self, part: str, data: torch.Tensor, ready: Callable[[], None] | None = None) -> None: ...

    def restart(self) -> None: ...


class MemorySink:
    """A PayloadSink that keeps the parts in memory (`payload()`: each part's appends concatenated)."""

    def __init__(self) -> None:
        self._parts: dict[str, list[tuple[torch.Tensor, Callable[[], None] | None]]] = {}

    def append(self, part: str, data: torch.Tensor, ready: Callable[[], None] | None = None) -> None:
        self._parts.setdefault(part, []).append((data, ready))

    def restart(self) -> None:
        self._parts.clear()

    def payload(self) -> dict[str, torch.Tensor]:
        out = {}
        for part, pieces in self._parts.items():
            for _, ready in pieces:
                if ready is not None:
                    ready()
            tensors = [t for t, _ in pieces]
            out[part] = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).contiguous()
        return out


class FileWrite(Protocol):
    """A file-level codec's plan for one file: its metadata, known before the payload is written
    (the header's `enc` and each tensor's), and `write_to`, which streams the payload."""

    enc: dict[str, Any]
    tensor_enc: dict[str, dict[str, Any]]
    parts: list[tuple[str, torch.dtype, int]]  # the payload's parts in order: name, dtype, dimensions
    size_hint: int  # the payload's expected bytes (a writer may allocate them ahead)

    def write_to(self, sink: PayloadSink, pool: Executor | None = None, busy_ms: list[float] | None = None) -> None: ...

    def enc_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Each tensor's place in the streams, in batch order: (`at`, `start`), -1 and -1 where it did
        not change (a plan of `plan_batch`: format 5's columns)."""
        ...

    def set_tensor_rows(self, rows: np.ndarray) -> None:
        """Each tensor's (batch order) row in the header's table, which the payload may name (format 5:
        the spans of rank blocks); before `write_to`."""
        ...


class FileCodec(Codec, Protocol):
    """A codec whose payload covers every changed tensor of a file (format 3): `plan_file` lays out
    all of them at once (the Sections of one `prepare_batch`, or of `prepare` per tensor) and
    streams the payload into a sink; `pack_file` is the same into memory."""

    file_level: bool

    def plan_file(self, tensors: Sequence[tuple[str, Sections]]) -> FileWrite: ...

    def plan_batch(self, batch: BatchSections) -> FileWrite:
        """`plan_file` of every tensor of one `prepare_batch` (or stream) result, no per-tensor object."""
        ...

    def pack_file(
        self, tensors: Sequence[tuple[str, Sections]], pool: Executor | None = None, busy_ms: list[float] | None = None
    ) -> FilePayload: ...
