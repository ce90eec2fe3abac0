"""The decoder interface: how a server's staging gets a version's changes onto its device, per codec.

Where the line is drawn:

* **staging** (`apply/staging.py`) owns which pieces a rank needs (its layout), host memory (pinned
  buffers, and reading a file's bytes into them), the thread pool, the order work runs in (every
  unit's host work queued at once, running ahead of the device) and its timings, and hands the
  decoded rows to the apply engine. It lends all of that to a codec's decoder as a `StagingHost`.
* **a codec's decoder** (`CodecDecoder`, one per codec, found through `registry.get_decoder`) owns
  turning its bytes into (positions, new values or differences) on the device, on the CPU or the
  GPU, with every integrity check and the errors naming version, tensor and chunk (a fault found by
  a fast check is looked for again by the checked path, which names it).

Staging drives every codec the same way:

    plan = get_decoder(codec).plan(version, pieces, width, host)   # metadata parsed and checked
    fetches = [plan.fetch(unit) for unit in plan.units]             # host work, on host's pool
    for unit, fetched in zip(plan.units, fetches):
        fetched.wait()
        yield from plan.decode(unit, fetched)                        # device work: Chunks

A plan is given every piece of one element width of a version at once, from one file or several
(the parts of a multi-part version), each with the range of positions it may hold: so a codec may
cut and batch its units across files (one nvCOMP call for several parts' chunks), and skip units no
piece needs (chunked: chunks of tensors the layout does not hold; with a per-chunk index of
positions, chunks outside a rank's rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from ..bits import INT_DTYPE, int_view
from ..errors import CodecError
from .base import Codec, Ctx, Sections, check_piece

Unit = TypeVar("Unit")


@dataclass
class Item:
    """One piece of a changed tensor of a version (a one-file version has one piece per changed
    tensor; a multi-part version one per part that changed it), in the engine's layout order."""

    index: int  # tensor index in the engine's layout order
    name: str
    numel: int
    nnz: int
    enc: dict[str, Any]
    parts: Mapping[str, torch.Tensor]  # the payload, by part name
    dtype: torch.dtype  # the tensor's dtype (header)
    start: int = 0  # the piece's positions lie in [start, end)
    stop: int | None = None  # None: numel

    @property
    def end(self) -> int:
        return self.numel if self.stop is None else min(self.stop, self.numel)


class PieceEncs(Sequence[dict[str, Any]]):
    """Pieces' `enc` of a file-level codec held as two arrays (a format-5 header's columns): `at` and
    `start`, -1 and -1 where a piece has none. Indexing gives the dict a format-4 header would."""

    __slots__ = ("at", "start")

    def __init__(self, at: np.ndarray, start: np.ndarray):
        self.at, self.start = at, start

    def __len__(self) -> int:
        return len(self.at)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, (slice, np.ndarray)):
            return PieceEncs(self.at[k], self.start[k])
        a, s = int(self.at[k]), int(self.start[k])
        return {} if a == -1 and s == -1 else {"at": a, "start": s}

    @classmethod
    def of(cls, encs: Sequence[dict[str, Any]]) -> PieceEncs:
        """A file-level codec's `enc` dicts as arrays ({at, start}; {}: -1, -1)."""
        n = len(encs)
        at = np.fromiter((e.get("at", -1) if e else -1 for e in encs), dtype=np.int64, count=n)
        start = np.fromiter((e.get("start", -1) if e else -1 for e in encs), dtype=np.int64, count=n)
        return cls(at, start)


@dataclass
class FilePieces:
    """The changed pieces of one file of a file-level codec (format 3) that a layout holds, as
    arrays in layout order: what staging a mixture of experts needs (~19K tensors per version) with
    no per-tensor objects. Built straight from a version file's header (staging) or from Items
    sharing one payload (`of_items`: tests)."""

    payload: Mapping[str, torch.Tensor]  # the file's streams
    file_enc: Any  # the file's codec metadata (the header's `enc`)
    names: list[str]
    encs: Sequence[Any]  # each piece's own codec metadata (a list of dicts, or PieceEncs)
    index: np.ndarray  # int64: tensor index in the engine's layout order
    numel: np.ndarray  # int64: elements of the whole tensor
    nnz: np.ndarray  # int64
    start: np.ndarray  # int64: its positions lie in [start, stop)
    stop: np.ndarray
    need_lo: np.ndarray | None = None  # int64: the layout needs its positions in [need_lo, need_hi)
    need_hi: np.ndarray | None = None  # (a rank's rows of the tensor); None: all of [start, stop)
    # a file with rank blocks (codec/chunked/blocks.py) needs, per piece: its tensor's row in the header
    # (its spans name it), its row size, and the columns [need_c0, need_c1) the layout holds of it
    header_index: np.ndarray | None = None
    row_size: np.ndarray | None = None
    need_c0: np.ndarray | None = None
    need_c1: np.ndarray | None = None
    # a piece of a column block: its positions are written in the block's own coordinates
    # (blocks.regions_of): the block's first column and width (0: positions as they are)
    block_c0: np.ndarray | None = None
    block_width: np.ndarray | None = None
    # bool per piece: all its positions lie in what the layout needs of its tensor (Runs.held)
    inside: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of_items(cls, items: Sequence[Item]) -> FilePieces:
        """Items of one file (sharing its payload; each `enc` holds the file's under "file", as
        `format.VersionFile.pieces` gives them)."""
        return cls(
            payload=items[0].parts,
            file_enc=items[0].enc.get("file"),
            names=[it.name for it in items],
            encs=[it.enc for it in items],
            index=np.array([it.index for it in items], dtype=np.int64),
            numel=np.array([it.numel for it in items], dtype=np.int64),
            nnz=np.array([it.nnz for it in items], dtype=np.int64),
            start=np.array([it.start for it in items], dtype=np.int64),
            stop=np.array([it.end for it in items], dtype=np.int64),
        )


@dataclass
class FileSet:
    """A version's changed pieces of a file-level codec, file by file: one file, or every part of a
    multi-part version (in part order). A decoder reads them as one sequence of chunks."""

    files: list[FilePieces]

    def __len__(self) -> int:
        return sum(len(f) for f in self.files)

    @property
    def indices(self) -> np.ndarray:
        """The layout indices of the tensors the files change (int64, sorted, distinct)."""
        if len(self.files) == 1:
            return self.files[0].index  # one piece per tensor, in layout order
        if not self.files:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.concatenate([f.index for f in self.files]))


Pieces = list[Item] | FileSet  # a version's changed pieces of one element width, in layout order


def piece_list(pieces: Pieces, codec: str, version: int) -> list[Item]:
    """The pieces of a per-tensor codec (a FileSet belongs to a file-level codec: CodecError)."""
    if isinstance(pieces, FileSet):
        raise CodecError(f"pieces of a format-3 file named codec {codec!r}", version=version)
    return pieces


def files_of(pieces: Pieces) -> list[FilePieces]:
    """The pieces of a file-level codec, by file (the pieces of one file share its payload dict,
    format.VersionFile), each file's in the order given."""
    if isinstance(pieces, FileSet):
        return [f for f in pieces.files if len(f)]
    files: dict[int, list[Item]] = {}
    for it in pieces:
        files.setdefault(id(it.parts), []).append(it)
    return [FilePieces.of_items(items) for items in files.values()]


class Runs(NamedTuple):
    """Consecutive elements by tensor: run r is `counts[r]` elements of tensor `tensors[r]` (layout
    order), in element order (int64 arrays: a chunk of a mixture of experts holds thousands)."""

    tensors: np.ndarray
    counts: np.ndarray
    # per run, where the decoder knows it (bool): every element of the run lies in the rows and columns
    # the staging layout needs of its tensor (a piece of a rank block inside the rank's share), so that
    # a tensor held by one segment needs no per-element mask (no device-to-host wait); None: unknown
    held: np.ndarray | None = None

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]]) -> Runs:
        arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        return cls(arr[:, 0].copy(), arr[:, 1].copy())

    def nonempty(self) -> Runs:
        keep = self.counts > 0
        if keep.all():
            return self
        return Runs(self.tensors[keep], self.counts[keep], None if self.held is None else self.held[keep])


@dataclass
class Chunk:
    """Decoded changes of consecutive tensors (or of part of one), on the device."""

    t_idx: torch.Tensor  # int64: tensor index (layout order) of each element
    p: torch.Tensor  # int64: row-major position in its tensor (sorted within a tensor)
    diffs: torch.Tensor | None  # int16/int32 (element width): new - old bits, mod 2^bits
    values: torch.Tensor | None  # int16/int32: absolute new bits
    runs: Runs  # the elements by tensor, in element order

    @property
    def tensors(self) -> np.ndarray:
        """The layout indices of the tensors with elements here, in element order."""
        return self.runs.tensors[self.runs.counts > 0]

    @property
    def n(self) -> int:
        return int(self.p.numel())


@dataclass
class Fetch:
    """One unit's host work in flight: wait for `futures`, then `data` holds what the unit's
    device work reads (a plan may keep its buffers itself and leave `data` None)."""

    futures: list[Future[None]] = field(default_factory=list)
    data: torch.Tensor | None = None

    def wait(self) -> None:
        for f in self.futures:
            f.result()

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()


class StagingHost(Protocol):
    """What staging lends a codec's decoder for one decode: its device, sizes, host memory, thread
    pool and clock."""

    @property
    def device(self) -> torch.device: ...

    @property
    def chunk_elems(self) -> int:
        """Changed elements per yielded Chunk, at most (bounds the device's temporary memory)."""
        ...

    @property
    def threads(self) -> int:
        """The pool's threads (a codec's own multithreaded calls may use as many)."""
        ...

    def buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for `n` elements (pinned when the device is a GPU), counted as staging's."""
        ...

    def read(self, ranges: Sequence[tuple[np.ndarray, int, int]]) -> Fetch:
        """Bytes src[a:b] of each (src, a, b) (files' memory maps), end to end in one fresh host
        buffer (`data`), copied in pieces on the pool."""
        ...

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run `fn` on the pool."""
        ...

    def mark(self, phase: str, sync: bool = True) -> None:
        """The time since the last mark counts to `phase` (`sync`: after the device's work is done, where
        staging times each phase's device work: VLLM_DELTA_STAGE_TIMING=sync). Never a barrier a
        decoder relies on: its data waits are its own."""
        ...

    def restart(self) -> None:
        """Start the clock again without counting the time since the last mark."""
        ...


class DecodePlan(Protocol[Unit]):
    """One decode of a codec's pieces of one width: units in element order, each fetched by host
    work and decoded on the device into Chunks (of at most `host.chunk_elems` elements)."""

    @property
    def units(self) -> Sequence[Unit]: ...

    @property
    def elements(self) -> int:
        """Changed elements the units decode (a rank skipping chunks of other ranks' rows decodes
        fewer than the pieces hold; elements of pieces the layout does not hold but that share a
        decoded chunk count: they are decoded too)."""
        ...

    def fetch(self, unit: Unit) -> Fetch:
        """Queue the unit's host work (decompression into host memory, or a copy of its bytes)."""
        ...

    def decode(self, unit: Unit, fetched: Fetch) -> Iterator[Chunk]:
        """The unit's device work once `fetched` is done: its changes, checked, on `host.device`.
        Marks its phases on the host's clock ("h2d", "inflate", "decode") before each yield; staging
        restarts the clock when the consumer hands control back. A plan may also have `finish()`,
        which staging calls after the last unit: checks it deferred (read once, not per unit), raising
        what `decode` would have; the units' changes count only once it returned."""
        ...


class CodecDecoder(Protocol):
    """A codec's staging decoder (one per codec, found through `registry.get_decoder`)."""

    def plan(self, version: int, pieces: Pieces, width: int, host: StagingHost) -> DecodePlan[Any]:
        """Parse and check the pieces' metadata; cut the work into units (CodecError, naming the
        version and a tensor, for anything malformed)."""
        ...


def ctx_of(version: int, name: str) -> Ctx:
    """Where an error about a piece of tensor `name` happened."""
    return {"version": version, "tensor": name}


class PieceDecoder:
    """The decoder of a codec without one of its own: the codec's `unpack` (host, on the pool) and
    `finish` (device), one piece per unit."""

    def __init__(self, codec: Codec):
        self.codec = codec

    def plan(self, version: int, pieces: Pieces, width: int, host: StagingHost) -> _PiecePlan:
        return _PiecePlan(self.codec, version, piece_list(pieces, self.codec.name, version), width, host)


class _PiecePlan:
    def __init__(self, codec: Codec, version: int, items: list[Item], width: int, host: StagingHost):
        self.codec, self.version, self.width, self.host = codec, version, width, host
        self.units = items
        self.elements = sum(it.nnz for it in items)
        self.sections: dict[int, Sections] = {}  # by id of the unit, once unpacked

    def fetch(self, unit: Item) -> Fetch:
        def unpack() -> None:
            ctx = ctx_of(self.version, unit.name)
            self.sections[id(unit)] = self.codec.unpack(
                unit.parts, unit.enc, numel=unit.numel, nnz=unit.nnz, dtype=unit.dtype, ctx=ctx
            )

        return Fetch([self.host.submit(unpack)])

    def decode(self, unit: Item, fetched: Fetch) -> Iterator[Chunk]:
        ctx = ctx_of(self.version, unit.name)
        ch = self.codec.finish(self.sections.pop(id(unit)), numel=unit.numel, device=self.host.device, ctx=ctx)
        pos = ch.positions.to(torch.int64)
        check_piece(pos, unit.start, unit.end, ctx)
        t_idx = torch.full_like(pos, unit.index)
        vals = diffs = None
        if ch.values is not None:
            vals = int_view(ch.values).to(INT_DTYPE[self.width])
        elif ch.diffs is not None:
            diffs = ch.diffs.to(torch.int64).to(INT_DTYPE[self.width])
        self.host.mark("decode")
        yield Chunk(t_idx=t_idx, p=pos, diffs=diffs, values=vals, runs=Runs.of([(unit.index, int(pos.numel()))]))
