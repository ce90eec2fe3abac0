"""Who publishes a version together: the steps of `publish` that depend on it, as one interface.

`Publisher` runs the same orchestration whether it publishes alone or as one rank of a sharded
trainer; what differs is behind `PublishGroup`:

* `agree` settles what this publish is (version number, tensor set, anchor or delta) and raises the
  upload failures nobody has raised yet;
* `wait_for_replicas` applies bounded staleness (staleness.py), and tells every rank which bad-version
  marks released the wait;
* `whole_sums` turns this rank's checksum partials into whole-tensor checksums;
* `part_of` names this rank's part of the version's files;
* `commit` (on the upload thread) makes a written version visible.

`SingleProcess` (here) is the trivial case: one process owns every element and publishes one file.
`ShardGroup` (shard_group.py) does the same over a torch.distributed group, one part per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import PublishError
from ..format import PartInfo
from ..store import DeltaStore
from .encode import WriteFile
from .job import BaseMissing, CommitOutcome, Committed, UploadFailure, UploadJob
from .shard import Ownership
from .staleness import StalenessGate


@dataclass(frozen=True)
class Proposal:
    """What this rank would publish: the version, its share of the tensors, whether it needs an anchor."""

    version: int
    ownership: Ownership
    anchor: bool
    dtype: str  # format.DTYPE_NAMES
    codec: str


@dataclass(frozen=True)
class Agreement:
    """What every rank publishes: the same version and kind everywhere (its own share of the tensors)."""

    version: int
    ownership: Ownership
    anchor: bool


@dataclass(frozen=True)
class UploadsFailed:
    """Uploads failed (on any rank) and nobody raised it yet: every rank raises it now."""

    failures: Sequence[tuple[int, UploadFailure]]  # (rank, failure)
    world: int

    @property
    def versions(self) -> list[int]:
        return [f.version for _, f in self.failures]

    def error(self) -> PublishError:
        rank, failure = self.failures[0]
        where = "" if self.world == 1 else f" on rank {rank}"
        return PublishError(f"upload failed{where}: {failure.text}", version=failure.version)


class PublishGroup(Protocol):
    rank: int
    world: int

    def agree(self, failure: UploadFailure | None, propose: Callable[[], Proposal]) -> Agreement | UploadsFailed:
        """`failure`: this rank's unraised upload failure; `propose()`: this rank's proposal (may raise:
        bad input). Raises when the ranks disagree, PublishError when the group itself failed."""
        ...

    def wait_for_replicas(self, gate: StalenessGate, version: int) -> frozenset[int]:
        """Wait for the replicas; the marked versions that released the wait (the same on every rank)."""
        ...

    def whole_sums(
        self, own: Ownership, partials: np.ndarray, nnz: int, error: Exception | None
    ) -> tuple[np.ndarray, int]:
        """Whole-tensor checksums (uint64, per tensor of `own.names`) and the version's nnz from every
        rank's partials (uint64, per tensor of `own.owned`); `error`: this rank's detection failed
        (raised on every rank)."""
        ...

    def part_of(self, own: Ownership, partials: np.ndarray) -> PartInfo | None: ...

    def commit(self, job: UploadJob, write: WriteFile, *, base_missing: bool) -> CommitOutcome: ...

    def close(self) -> None: ...


class SingleProcess:
    """One process publishes every element, one file per version."""

    rank = 0
    world = 1

    def __init__(self, store: DeltaStore):
        self.store = store

    def agree(self, failure: UploadFailure | None, propose: Callable[[], Proposal]) -> Agreement | UploadsFailed:
        if failure is not None:
            return UploadsFailed([(0, failure)], world=1)
        p = propose()
        return Agreement(p.version, p.ownership, p.anchor)

    def wait_for_replicas(self, gate: StalenessGate, version: int) -> frozenset[int]:
        gate.wait(version)
        return gate.released_by

    def whole_sums(
        self, own: Ownership, partials: np.ndarray, nnz: int, error: Exception | None
    ) -> tuple[np.ndarray, int]:
        if error is not None:
            raise error
        return own.spread(partials), nnz

    def part_of(self, own: Ownership, partials: np.ndarray) -> PartInfo | None:
        return None

    def commit(self, job: UploadJob, write: WriteFile, *, base_missing: bool) -> CommitOutcome:
        if base_missing:
            return BaseMissing(job.base)
        with write() as f, job.timed("commit"):
            return Committed(self.store.writer.commit_file(f.header, f.path, move=True))

    def close(self) -> None:
        pass


__all__ = ["Agreement", "Proposal", "PublishGroup", "SingleProcess", "UploadsFailed"]
