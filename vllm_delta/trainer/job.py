"""What travels from `publish` to the upload thread: one version (or this rank's part of it), how its
upload can end, and the failure the training thread raises afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ..codec import BatchSections
from ..format import PartInfo, VersionKind
from ..store import VersionRecord
from .shard import Owned


@dataclass
class UploadJob:
    """One version (or this rank's part of it) on its way to the store."""

    version: int
    kind: VersionKind
    base: int | None
    base_checksum: str | None
    checksum: str  # whole-model checksum
    codec: str | None  # what the version's record names: deltas only
    shapes: dict[str, tuple[int, ...]]  # every tensor of the version, in order
    sums: np.ndarray  # whole-tensor checksums, uint64, in `shapes` order
    owned: list[Owned]  # what this rank publishes
    nnz: int  # whole version
    numel: int
    created: float
    counts: list[int] = field(default_factory=list)  # deltas: changed elements per owned tensor
    sections: BatchSections | None = None  # deltas: the codec's output, ready after its event
    host: list[torch.Tensor] | None = None  # anchors: the owned rows, on the host
    part: PartInfo | None = None  # sharded publishers: this rank's part
    future: Future[VersionRecord] = field(default_factory=Future)
    timings: dict[str, float] = field(default_factory=dict)  # ms per upload phase
    submitted: float = 0.0  # perf_counter() when the training thread queued it (the wait for the thread: "queued")

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Record how long the block took, in ms, as `phase`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = (time.perf_counter() - t0) * 1e3

    def sums_by_name(self) -> dict[str, int]:
        """`sums` by tensor name (the anchor writers and headers before format 5 take them so)."""
        return dict(zip(self.shapes, self.sums.tolist()))

    def release(self) -> None:
        """Drop the payload (host copies, codec sections) once the upload is over, whatever its end."""
        self.sections = None
        self.host = None


@dataclass(frozen=True)
class Committed:
    """The version is visible in the store."""

    record: VersionRecord


@dataclass(frozen=True)
class BaseMissing:
    """A delta whose base never became visible: dropped, not an error of its own (the publish after
    the failure that broke the chain is an anchor)."""

    base: int | None


CommitOutcome = Committed | BaseMissing


@dataclass(frozen=True)
class UploadFailure:
    """An upload error the training thread has not raised yet (sent to the other ranks as is)."""

    version: int
    text: str


__all__ = ["BaseMissing", "CommitOutcome", "Committed", "UploadFailure", "UploadJob"]
