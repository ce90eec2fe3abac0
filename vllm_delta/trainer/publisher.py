"""Publisher: turns each training step's weights into one store version, off the training thread.

    with Publisher("file:///data/run1", anchor_every=20, codec="chunked") as pub:
        info = pub.publish(model, version=step)   # returns before the upload ends
        ...
    # leaving the block flushes: waits for the uploads and raises the first upload error

`publish`, on the training thread:

1. agree on what this version is (group.py: alone, or with the other ranks of a sharded trainer,
   shard_group.py): its number, its tensors, anchor or delta; raise the upload failures nobody raised;
2. wait for the replicas, with bounded staleness (staleness.py);
3. detect the changes against the last published image, and run the device part of encoding, for
   all tensors at once (detect.FlatSnapshot, the codec's `prepare_batch`, or a stream encoder that
   encodes each pass of detection as it comes, so only one pass's changes are alive);
4. add up the checksums (a sharded trainer: every rank's partials);
5. hand the version to the upload thread (uploader.py), which encodes and writes its file
   (encode.py) and commits it. The queue is bounded, so a slow store slows `publish` down instead
   of filling memory.

An upload error is raised by the next `publish` or `flush`; the chain is then broken, so the
following version is an anchor. So is the version after a bad-version mark on the chain the next
delta would build on (`mark_bad`, or a mark by anyone: `vllm-delta mark-bad`, read after each
commit and by the staleness gate), so that the fleet, which never applies a version whose chain
passes through a mark, recovers at once. The rarer settings come in `options` (options.py).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from .. import codec as codecs
from .. import gc_pause
from ..checksums import combine_arrays, to_hex
from ..errors import PublishError
from ..format import DTYPE_NAMES, VersionKind
from ..signatures import SigningKey
from ..store import DeltaStore, VersionRecord
from ..store.marks import BadMark
from ..store.signed import RecordSigner, new_run_id
from .detect import FlatSnapshot
from .encode import VersionEncoder
from .group import Agreement, Proposal, PublishGroup, SingleProcess, UploadsFailed
from .job import UploadJob
from .options import PublisherOptions, UploadOptions
from .shard import Ownership
from .sources import SourceCache
from .staleness import StalenessGate
from .uploader import Uploader

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

# What `publish` takes: a module, or (name, tensor | DTensor | ShardedTensor) pairs (detect.named_tensors).
Source = torch.nn.Module | Mapping[str, object] | Iterable[tuple[str, object]]


@dataclass
class PublishInfo:
    version: int
    kind: VersionKind
    base: int | None
    nnz: int  # changed elements (all elements for an anchor), over every rank
    numel: int
    checksum: str  # whole-model checksum of the published image (what a server will report)
    detect_ms: float  # time `publish` held the calling thread
    uploaded: Future[VersionRecord] = field(repr=False)  # -> VersionRecord once the version is visible
    timings: dict[str, float] = field(default_factory=dict, repr=False)  # ms: agree, detect, prepare, sums, queue

    @property
    def density(self) -> float:
        return self.nnz / self.numel if self.numel else 0.0


def _no_sums() -> np.ndarray:
    return np.zeros(0, dtype=np.uint64)


@dataclass
class _Chain:
    """What the next version builds on, as this rank published it."""

    last: int | None  # the last version published (the store's latest, for a new Publisher)
    last_anchor: int | None = None
    needs_anchor: bool = True  # nothing to diff against (yet, or after a failure)
    fingerprint: str | None = None  # of the last version's tensor set
    checksum: str | None = None  # the last version's whole-model checksum
    partials: np.ndarray = field(default_factory=_no_sums)  # per owned tensor, uint64: its owned elements' sum

    def builds_on_any(self, versions: Iterable[int]) -> bool:
        """Whether the next delta would build on one of `versions` (it lies on the current chain)."""
        if self.last_anchor is None or self.last is None:
            return False
        return any(self.last_anchor <= v <= self.last for v in versions)

    def next_version(self, version: int | None) -> int:
        if version is None:
            return 0 if self.last is None else self.last + 1
        version = int(version)
        if version < 0 or (self.last is not None and version <= self.last):
            raise ValueError(f"version {version} is not after the last published version {self.last}")
        return version

    def advance(self, job: UploadJob, partials: np.ndarray) -> None:
        self.last, self.checksum, self.partials = job.version, job.checksum, partials
        if job.kind == "anchor":
            self.last_anchor = job.version
        self.needs_anchor = False


@dataclass
class _Detected:
    """This rank's share of a version after detection, on the training thread."""

    partials: np.ndarray = field(default_factory=_no_sums)  # per owned tensor, uint64
    counts: list[int] = field(default_factory=list)
    sections: codecs.BatchSections | None = None  # deltas
    host: list[torch.Tensor] | None = None  # anchors
    error: Exception | None = None  # a sharded publisher tells every rank before raising it


class Publisher:
    def __init__(
        self,
        uri: str | DeltaStore,
        *,
        anchor_every: int = 20,
        codec: str = "chunked",
        group: ProcessGroup | None = None,
        max_staleness: int | None = None,
        min_replicas: int = 1,
        storage_options: dict[str, Any] | None = None,
        options: PublisherOptions | None = None,
        signing_key: str | os.PathLike[str] | SigningKey | None = None,
    ):
        """`uri`: where versions go (a path, `s3://...`, `hf://buckets/...`: any fsspec URI), or a
        `DeltaStore`. `anchor_every`: a full version (anchor) every that many versions. `codec`:
        "chunked" (the default), "compact" or "raw" (codec/). `group`: a torch.distributed process
        group (or `torch.distributed.group.WORLD`) whose ranks publish together, each its own part of
        every version (created collectively: every rank of the group constructs its Publisher).
        `max_staleness`, `min_replicas`: `publish` waits until that many reporting replicas serve a
        version at most that far behind (staleness.py). `storage_options`: fsspec options for `uri`
        (S3 endpoint, credentials, ...), as `DeltaStore` takes them (or in
        `options.store.storage_options`: one of the two).
        `options`: everything else, grouped by job (options.py). `signing_key`: a private key file
        (`vllm-delta keygen`): every version is signed (docs/SECURITY.md); with `group`, rank 0 signs
        each version's record and the other ranks never read the file."""
        opts = options if options is not None else PublisherOptions()
        if anchor_every < 1:
            raise ValueError("anchor_every must be >= 1")
        staleness = opts.staleness_policy(max_staleness, min_replicas)
        self.codec = codecs.get_codec(codec)
        self.codec = _own_codec(self.codec, opts.upload)
        self.store = opts.store.open_store(uri, storage_options)
        self.anchor_every = anchor_every
        self.dtype = opts.dtype
        d = opts.detect
        self.snapshot = FlatSnapshot(
            opts.dtype,
            device=d.snapshot_device,
            pin=d.pin_snapshot,
            chunk_elems=d.chunk_elems,
            backend=d.backend,
            stream_pass_elems=d.stream_pass_elems,
        )
        self._gate = StalenessGate(self.store, staleness) if staleness is not None else None
        self._chain = _Chain(last=self.store.latest())
        self._sources = SourceCache()
        self._group: PublishGroup = SingleProcess(self.store)
        if group is not None:
            from .shard_group import ShardGroup  # torch.distributed only where a group is given

            self._group = ShardGroup(group, self.store, timeout_s=opts.sharding.timeout_s)
        if self._group.rank == 0:  # the rank that writes the records
            self.store.writer.signer = record_signer(self.store, self._chain.last, signing_key)
        keep = opts.store.keep_anchors
        self._marked: frozenset[int] = frozenset()  # bad-version marks known to this rank
        self._marked_lock = threading.Lock()
        self._uploader = Uploader(
            VersionEncoder(
                self.codec,
                opts.dtype,
                pack_threads=opts.upload.pack_threads,
                header_format=opts.upload.chunked_format,
            ),
            self._group,
            queue_size=opts.upload.queue_size,
            retain=(self.store, keep) if keep and self._group.rank == 0 else None,
            after_commit=self._read_marks if self._group.rank == 0 else None,
        )
        self._assets_done = False
        self._closed = False
        self._rows_of: tuple[Ownership, list[tuple[str, tuple[int, ...], int, int]], list[int]] | None = None

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def world(self) -> int:
        return self._group.world

    @property
    def upload_timings(self) -> dict[int, dict[str, float]]:
        """ms per upload phase (uploader.py, encode.py), per version (the last 64)."""
        return self._uploader.timings

    # -- public API --------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, model_or_tensors: Source, version: int | None = None) -> PublishInfo:
        """Detect changes against the last published image and queue the version for upload."""
        if self._closed:
            raise RuntimeError("Publisher is closed")
        t0 = time.perf_counter()
        agreed = self._agree(model_or_tensors, version)
        timings = {"agree": _ms(t0)}
        self._store_assets(model_or_tensors)
        try:
            detected = self._detect(agreed, timings)
            # Per-tensor bookkeeping (sums, the job, a part's rows): ~19K objects each at 30B-A3B, which
            # the collector would walk again and again, as on the upload thread (gc_pause.py).
            with gc_pause.paused():
                t1 = time.perf_counter()
                own = agreed.ownership
                sums, nnz = self._group.whole_sums(own, detected.partials, sum(detected.counts), detected.error)
                timings["sums"] = _ms(t1)
                t1 = time.perf_counter()
                job = self._job(agreed, detected, sums, nnz)
                timings["job"] = _ms(t1)
            # the group's waits for the other ranks (ShardGroup.waits), named inside agree and sums
            timings.update({f"{k}_wait": v for k, v in getattr(self._group, "waits", {}).items()})
            t1 = time.perf_counter()
            self._uploader.submit(job)  # blocks when the uploader is behind
            timings["queue"] = _ms(t1)
        except BaseException:
            self._chain.needs_anchor = True  # the snapshot may be half-updated: resynchronize with an anchor
            raise
        self._chain.advance(job, detected.partials)
        return PublishInfo(
            version=job.version,
            kind=job.kind,
            base=job.base,
            nnz=job.nnz,
            numel=job.numel,
            checksum=job.checksum,
            detect_ms=_ms(t0),
            uploaded=job.future,
            timings=timings,
        )

    def mark_bad(self, version: int, reason: str) -> BadMark:
        """Mark a published (visible) version bad in the store, once for the whole fleet: followers never
        apply it nor any version whose chain passes through it, the staleness gate stops waiting for
        replicas to reach those, and, when it lies on the chain the next delta would build on, this
        Publisher's next version is an anchor (the fleet moves on at once). VersionNotFoundError for a
        version that is not visible (yet: wait for its `uploaded` future), StoreAccessError for a store
        this process cannot write; nothing is written then. Any rank of a sharded publisher may call it."""
        mark = self.store.mark_bad(version, reason)
        self._learn_marks({version})
        return mark

    def flush(self) -> None:
        """Wait until every queued version is visible in the store (or failed); raise the first
        upload error. Sharded publishers: every rank sees the same outcome of every version."""
        self._uploader.join()
        failure = self._uploader.unraised()
        if failure is not None:
            self._raise(UploadsFailed([(self.rank, failure)], world=self.world))

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._uploader.close()
            self._group.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # don't mask the caller's exception with an upload error
            try:
                self.close()
            except Exception as upload_exc:  # noqa: BLE001
                log.error("publisher closed with an upload error: %s", upload_exc)

    # -- the steps of publish ----------------------------------------------------------------
    def _agree(self, source: Source, version: int | None) -> Agreement:
        """Settle the version with the group (raising the upload failures nobody raised yet), then wait
        for the replicas (bounded staleness)."""
        try:
            agreed = self._settle(source, version)
            if self._gate is not None:
                released = self._group.wait_for_replicas(self._gate, agreed.version)
                self._learn_marks(released)
                if released and not agreed.anchor and self._chain.builds_on_any(released):
                    # Marks released the wait, and this delta would build on a marked version that no
                    # replica will ever apply: settle again, as an anchor (every rank learned the same).
                    agreed = self._settle(source, version)
        except PublishError:  # an upload failed, or the group did: the chain restarts on every rank
            self._chain.needs_anchor = True
            raise
        self._chain.fingerprint = agreed.ownership.fingerprint
        return agreed

    def _settle(self, source: Source, version: int | None) -> Agreement:
        agreed = self._group.agree(self._uploader.unraised(), lambda: self._propose(source, version))
        if isinstance(agreed, UploadsFailed):
            self._raise(agreed)
        return agreed

    def _learn_marks(self, versions: Iterable[int]) -> None:
        with self._marked_lock:
            self._marked = self._marked | frozenset(versions)

    def _read_marks(self, _committed: VersionRecord) -> None:
        """After each commit (upload thread, rank 0): the store's marks, for the next anchor decision
        (one listing of `bad/`, off the training thread)."""
        self._learn_marks(self.store.marks())

    def _propose(self, source: Source, version: int | None) -> Proposal:
        v = self._chain.next_version(version)
        own = self._sources.ownership(source, self.rank, self.world)  # resolved once per model (sources.py)
        chain = self._chain
        anchor = (
            chain.needs_anchor
            or chain.builds_on_any(self._marked)
            or chain.last_anchor is None
            or v - chain.last_anchor >= self.anchor_every
            or own.fingerprint != chain.fingerprint
            or not self.snapshot.matches(own.owned)
        )
        return Proposal(v, own, anchor, dtype=DTYPE_NAMES[self.dtype], codec=self.codec.name)

    def _detect(self, agreed: Agreement, timings: dict[str, float]) -> _Detected:
        """The anchor image, or the changes and the codec's device work, of this rank's elements.
        An Exception is returned in `error`, for the group to hear of (and raise everywhere)."""
        owned = agreed.ownership.owned
        t0 = time.perf_counter()
        try:
            if agreed.anchor:
                image = self.snapshot.anchor(owned)
                timings["detect"] = _ms(t0)
                partials = np.array(image.sums, dtype=np.uint64)
                return _Detected(partials, [o.count for o in owned], host=image.host)
            # A codec that encodes detection's passes as they come (chunked, issue 17) keeps one pass's
            # changes on the device at a time; "detect" then includes that encoding.
            tensors, starts = self._owned_rows(agreed.ownership)  # rank blocks (a codec that lays them out)
            stream = codecs.stream_encoder(self.codec, starts, tensors)
            found = self.snapshot.changes(owned, consume=stream.add if stream is not None else None)
            timings["detect"] = _ms(t0)
            t0 = time.perf_counter()
            # the chain's partials are of the same owned tensors (a delta needs snapshot.matches(owned))
            moved = np.array(found.sums, dtype=np.uint64)
            if self._chain.partials.shape != moved.shape:
                raise PublishError(f"{moved.size} owned tensors, {self._chain.partials.size} in the last version")
            partials = self._chain.partials + moved  # uint64 arithmetic: mod 2^64
            with self.snapshot.side_stream(self.snapshot.compute_device(owned)):
                if stream is not None:
                    sections = stream.finish(found.counts)
                    # the GPU compression starts here, not after the hand-off to the upload thread
                    # (~0.5 ms of this thread: the launch; the version is live ~2-4 ms sooner)
                    sections.begin()
                else:
                    batch = codecs.Batch(
                        positions=found.positions,
                        new=found.new,
                        old=found.old,
                        seg=found.seg,
                        counts=found.counts,
                        starts=[o.start for o in owned],
                        numels=[o.numel for o in owned],
                    )
                    sections = self.codec.prepare_batch(batch)
                    del batch
            timings["prepare"] = _ms(t0)
            return _Detected(partials, found.counts, sections=sections)
        except Exception as exc:  # noqa: BLE001 - raised by whole_sums, on every rank
            return _Detected(error=exc)

    def _owned_rows(self, own: Ownership) -> tuple[list[tuple[str, tuple[int, ...], int, int]], list[int]]:
        """Each owned tensor's (name, shape, row0, row1), and each one's first position: made once per
        resolution of the model (the same lists every version: the codec keeps what it derives from them)."""
        cached = self._rows_of
        if cached is None or cached[0] is not own:
            cached = self._rows_of = (
                own,
                [(o.name, o.shape, o.row0, o.row1) for o in own.owned],
                [o.start for o in own.owned],
            )
        return cached[1], cached[2]

    def _job(self, agreed: Agreement, detected: _Detected, sums: np.ndarray, nnz: int) -> UploadJob:
        own, chain = agreed.ownership, self._chain
        shapes, numel = own.shapes, own.numel
        return UploadJob(
            version=agreed.version,
            kind="anchor" if agreed.anchor else "delta",
            base=None if agreed.anchor else chain.last,
            base_checksum=None if agreed.anchor else chain.checksum,
            checksum=to_hex(combine_arrays(own.keys, sums)),
            codec=None if agreed.anchor else self.codec.name,
            shapes=shapes,
            sums=sums,
            owned=own.owned,
            nnz=numel if agreed.anchor else nnz,
            numel=numel,
            created=time.time(),
            counts=detected.counts,
            sections=detected.sections,
            host=detected.host,
            part=self._group.part_of(own, detected.partials),
        )

    def _raise(self, failed: UploadsFailed) -> NoReturn:
        """Raise upload failures (every rank raises the same), and never again; the chain restarts."""
        mine = self._uploader.acknowledge(failed.versions)
        self._chain.needs_anchor = True
        raise failed.error() from mine

    def _store_assets(self, source: Source) -> None:
        """config.json, once (rank 0): what a server or `materialize` needs besides the weights."""
        if self._assets_done or self.rank != 0:
            return
        self._assets_done = True
        doc = _model_config(source)
        if doc is not None:
            try:
                self.store.objects.put_asset("config.json", json.dumps(doc, indent=2, default=str).encode())
            except Exception as exc:  # noqa: BLE001 - assets are a convenience, never fatal
                log.warning("could not store config.json: %s", exc)


def record_signer(
    store: DeltaStore, latest: int | None, key: str | os.PathLike[str] | SigningKey | None
) -> RecordSigner:
    """What the records of this Publisher carry: the store's run (its newest record's, so that a trainer
    restarted on its store continues the run; a new one for a new store, or a store written before runs),
    and a signature with `key`. A key file that is not a key fails here, before anything is published."""
    signing = key if isinstance(key, SigningKey) or key is None else SigningKey.load(key)
    run = store.record(latest).run if latest is not None else None
    return RecordSigner(run or new_run_id(), signing)


def _own_codec(codec: codecs.Codec, upload: UploadOptions) -> codecs.Codec:
    """The codec with this Publisher's settings (a copy: the registry's instance is the process's):
    the GPU encode's frames per call, and rank blocks where the header format can record them (5)."""
    blocks = upload.rank_blocks if upload.chunked_format == 5 else 0
    if upload.gpu_encode_frames is not None and not hasattr(codec, "encode_frames"):
        raise ValueError(f"gpu_encode_frames bounds the chunked codec's GPU encode, not {codec.name!r}'s")
    if not hasattr(codec, "encode_frames"):
        return codec  # nothing of it is this Publisher's own
    own = copy.copy(codec)
    if upload.gpu_encode_frames is not None:
        own.encode_frames = upload.gpu_encode_frames
    if hasattr(own, "rank_blocks"):
        own.rank_blocks = blocks
    return own


def _model_config(source: Source) -> dict[str, object] | None:
    config = getattr(source, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    doc: dict[str, object] = config.to_dict()
    if not doc.get("architectures") and isinstance(source, torch.nn.Module):
        # A model built with `from_config` has no `architectures`: name its class, so that a server
        # (or `from_pretrained` on a materialized directory) can pick the model class.
        doc["architectures"] = [type(source).__name__]
    return doc


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


__all__ = ["Publisher", "PublishError", "PublishInfo", "PublisherOptions"]
