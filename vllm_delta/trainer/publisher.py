"""Publisher: turns each training step's weights into one store version, off the training thread.

    with Publisher("file:///data/run1", anchor_every=20, codec="chunked") as pub:
        info = pub.publish(model, version=step)   # returns before the upload ends
        ...
    # leaving the block flushes: waits for the uploads and raises the first upload error

`publish` runs change detection and the device part of encoding on the parameters' device, for all
tensors at once (detect.FlatSnapshot, the codec's `prepare_batch`), then hands the result to a
background thread that compresses, writes the safetensors file and uploads it. The queue is
bounded, so a slow store slows `publish` down instead of filling memory. An upload error is raised
by the next `publish` or `flush`; the chain is then broken, so the following version is an anchor.

Sharded trainers (`group=`: a torch.distributed process group; every rank calls `publish` at the
same step): each rank detects, encodes and uploads only the elements it owns (shard.py: its rows of
`Shard(0)` DTensors and `ShardedTensor`s, and the replicated tensors assigned to it) as one *part*
of the version; rank 0 of the group writes the version's record once every part is durable. Per
publish, on the training thread: one small all_gather_object on a control group (version number,
tensor-set fingerprint, whether an anchor is needed, any pending upload error; the row ranges when
the layout is new), then one all_gather_object of per-tensor checksum partials after one device
synchronization, so every rank knows the whole-tensor checksums its part header records. Per
version, on each rank's upload thread (its own group): write and upload the part, all_gather_object
of the part's metadata (or the error), rank 0 commits the record only if every part is in the
store, then broadcasts the outcome so that every rank's `uploaded` future ends the same way. A
failure anywhere leaves nothing visible; every rank raises at its next `publish`/`flush`, and the
next version is an anchor on every rank (decided through the control gather). Both groups are gloo
groups with a timeout, so a rank that dies makes the others raise instead of waiting forever.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

from .. import codec as codecs
from ..checksums import MASK64, combine, to_hex
from ..errors import PublishError, ShardingError, StalenessTimeoutError
from ..format import DTYPE_NAMES, PartInfo, VersionHeader, write
from ..store import DeltaStore, PartRecord, VersionRecord
from ..writer import PreparedTensor, assemble_delta, encode_anchor, encode_anchor_part
from .detect import CHUNK_ELEMS, FlatSnapshot, named_tensors
from .shard import Owned, Ownership, check_layouts, describe_mismatch, resolve
from .staleness import StalenessGate, StalenessPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class PublishInfo:
    version: int
    kind: str  # "anchor" | "delta"
    base: int | None
    nnz: int  # changed elements (all elements for an anchor), over every rank
    numel: int
    checksum: str  # whole-model checksum of the published image (what a server will report)
    detect_ms: float  # time `publish` held the calling thread
    uploaded: Future = field(repr=False)  # -> VersionRecord once the version is visible
    timings: dict[str, float] = field(default_factory=dict, repr=False)  # ms: agree, detect, prepare, sums, queue

    @property
    def density(self) -> float:
        return self.nnz / self.numel if self.numel else 0.0


@dataclass
class _Job:
    """One version (or this rank's part of it) on its way to the store."""

    version: int
    kind: str
    base: int | None
    base_checksum: str | None
    checksum: str  # whole-model checksum
    shapes: dict[str, tuple[int, ...]]  # every tensor of the version, in order
    sums: dict[str, int]  # whole-tensor checksums
    owned: list[Owned]
    nnz: int  # whole version
    numel: int
    created: float
    counts: list[int] = field(default_factory=list)  # deltas: changed elements per owned tensor
    sections: codecs.BatchSections | None = None  # deltas: the codec's output, ready after its event
    host: list[torch.Tensor] | None = None  # anchors: the owned rows, on the host
    part: PartInfo | None = None  # sharded publishers: this rank's part
    future: Future = field(default_factory=Future)


class _Groups:
    """The gloo groups of a sharded publisher: one for the training thread, one for uploads."""

    def __init__(self, group: Any, timeout: datetime.timedelta):
        import torch.distributed as dist

        self.dist = dist
        ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world = len(ranks)
        self.src = ranks[0]  # global rank of the coordinator (group rank 0)
        kw: dict[str, Any] = {"backend": "gloo", "timeout": timeout, "use_local_synchronization": True}
        self.control = dist.new_group(ranks, **kw)
        self.upload = dist.new_group(ranks, **kw)
        self.upload_broken: str | None = None  # a collective of the upload group failed: no more

    def gather(self, obj: Any, *, upload: bool = False) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.upload if upload else self.control)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.src, group=self.upload)
        return box[0]

    def close(self) -> None:
        for g in (self.control, self.upload):
            try:
                self.dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


class Publisher:
    def __init__(
        self,
        uri: str | DeltaStore,
        *,
        anchor_every: int = 20,
        codec: str = "chunked",
        dtype: torch.dtype = torch.bfloat16,
        snapshot_device: str | torch.device | None = None,
        pin_snapshot: bool = False,
        queue_size: int = 2,
        keep_anchors: int | None = None,
        storage_options: dict | None = None,
        pack_threads: int | None = None,
        group: Any = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        chunk_elems: int = CHUNK_ELEMS,
        detect_backend: str | None = None,
        max_staleness: int | None = None,
        min_replicas: int = 1,
        staleness_timeout_s: float = 600.0,
    ):
        """`group`: a torch.distributed process group (or `torch.distributed.group.WORLD`) whose
        ranks publish together, each its own part of every version (created collectively: every rank
        of the group constructs its Publisher). `timeout`: how long a rank waits for the others in a
        collective (seconds or a timedelta) before it raises. `chunk_elems`, `detect_backend`: see
        detect.FlatSnapshot."""
        if anchor_every < 1:
            raise ValueError("anchor_every must be >= 1")
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"publishable dtypes: {list(DTYPE_NAMES)}")
        self.store = uri if isinstance(uri, DeltaStore) else DeltaStore(uri, storage_options=storage_options)
        self.codec = codecs.get_codec(codec)
        self.anchor_every = anchor_every
        self.dtype = dtype
        self.keep_anchors = keep_anchors
        self.snapshot = FlatSnapshot(
            dtype, device=snapshot_device, pin=pin_snapshot, chunk_elems=chunk_elems, backend=detect_backend
        )
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        self._groups = _Groups(group, timeout) if group is not None else None
        self.rank = self._groups.rank if self._groups else 0
        self.world = self._groups.world if self._groups else 1
        self._partials: dict[str, int] = {}  # per tensor: positional sum over the owned elements
        self._fingerprint: str | None = None
        self._layouts: list[str] | None = None  # every rank's layout fingerprint, as last validated
        # Bounded staleness: publish waits until enough reporting replicas caught up (staleness.py).
        self._gate = (
            None
            if max_staleness is None
            else StalenessGate(self.store, StalenessPolicy(max_staleness, min_replicas, staleness_timeout_s))
        )
        self._last: int | None = self.store.latest()
        self._last_anchor: int | None = None
        self._needs_anchor = True  # nothing to diff against until the first anchor
        self._assets_done = False
        self._checksum_of_last: str | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._error_version: int | None = None
        self._raised: set[int] = set()  # failed versions already raised (sharded: by any rank)
        self._broken_at: int | None = None
        self.upload_timings: dict[int, dict[str, float]] = {}  # version -> ms per upload phase (last 64)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max(1, queue_size))
        self._tmpdir = tempfile.mkdtemp(prefix="vllm-delta-pub-")
        self._pool = ThreadPoolExecutor(
            max_workers=pack_threads or min(16, os.cpu_count() or 1), thread_name_prefix="vllm-delta-pack"
        )
        self._thread = threading.Thread(target=self._upload_loop, name="vllm-delta-upload", daemon=True)
        self._thread.start()
        self._closed = False

    # -- public API --------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, model_or_tensors, version: int | None = None) -> PublishInfo:
        """Detect changes against the last published image and queue the version for upload."""
        if self._closed:
            raise RuntimeError("Publisher is closed")
        t0 = time.perf_counter()
        if self._groups is None:
            self._raise_pending()
            version = self._next_version(version)
            self._wait_for_replicas(version)
            own = self._ownership(model_or_tensors)
            anchor = self._wants_anchor(version, own)
            self._fingerprint = own.fingerprint
        else:
            version, own, anchor = self._agree(model_or_tensors, version)
            self._wait_for_replicas(version)
        timings = {"agree": (time.perf_counter() - t0) * 1e3}
        t1 = time.perf_counter()
        self._maybe_store_assets(model_or_tensors)
        image, sections, error = None, None, None
        partials: dict[str, int] = {}
        counts: list[int] = []
        try:
            if anchor:
                image = self.snapshot.anchor(own.owned)
                partials = {o.name: s for o, s in zip(own.owned, image.sums)}
                counts = [o.count for o in own.owned]
            else:
                # codec (issue 17): a codec that encodes detection's passes as they come (chunked) keeps
                # one pass's changes on the device at a time; "detect" then includes that encoding
                stream = codecs.stream_encoder(self.codec, [o.start for o in own.owned])
                found = self.snapshot.changes(own.owned, consume=stream.add if stream is not None else None)
                timings["detect"] = (time.perf_counter() - t1) * 1e3
                t1 = time.perf_counter()
                partials = {o.name: (self._partials.get(o.name, 0) + s) & MASK64 for o, s in zip(own.owned, found.sums)}
                counts = found.counts
                with self.snapshot.side_stream(self.snapshot.compute_device(own.owned)):
                    if stream is not None:
                        sections = stream.finish(counts)
                    else:
                        batch = codecs.Batch(
                            positions=found.positions,
                            new=found.new,
                            old=found.old,
                            seg=found.seg,
                            counts=counts,
                            starts=[o.start for o in own.owned],
                            numels=[o.numel for o in own.owned],
                        )
                        sections = self.codec.prepare_batch(batch)
                        del batch
                timings["prepare"] = (time.perf_counter() - t1) * 1e3
                del found
        except BaseException as exc:  # noqa: BLE001 - sharded: every rank must hear of it
            self._needs_anchor = True  # the snapshot may be half-updated: resynchronize with an anchor
            if self._groups is None or not isinstance(exc, Exception):
                raise
            error = exc
        if anchor:
            timings["detect"] = (time.perf_counter() - t1) * 1e3
        t1 = time.perf_counter()
        sums, nnz = self._whole_sums(own, partials, sum(counts), error)  # sharded: raises on every rank
        timings["sums"] = (time.perf_counter() - t1) * 1e3
        self._partials = partials
        shapes = own.shapes
        checksum = to_hex(combine(sums.items()))
        numel = sum(_numel(s) for s in shapes.values())
        created = time.time()
        job = _Job(
            version=version,
            kind="anchor" if anchor else "delta",
            base=None if anchor else self._last,
            base_checksum=None if anchor else self._checksum_of_last,
            checksum=checksum,
            shapes=shapes,
            sums=sums,
            owned=own.owned,
            nnz=numel if anchor else nnz,
            numel=numel,
            created=created,
            counts=counts,
            sections=sections,
            host=image.host if image is not None else None,
        )
        if self._groups is not None:
            job.part = PartInfo(
                index=self.rank,
                count=self.world,
                checksum=to_hex(combine((o.name, self._partials[o.name]) for o in own.owned)),
                rows={o.name: [o.row0, o.row1] for o in own.owned},
            )
        self._checksum_of_last = checksum
        t1 = time.perf_counter()
        self._queue.put(job)  # blocks when the uploader is behind
        timings["queue"] = (time.perf_counter() - t1) * 1e3
        if anchor:
            self._last_anchor = version
        self._needs_anchor = False
        self._last = version
        return PublishInfo(
            version=version,
            kind=job.kind,
            base=job.base,
            nnz=job.nnz,
            numel=numel,
            checksum=checksum,
            detect_ms=(time.perf_counter() - t0) * 1e3,
            uploaded=job.future,
            timings=timings,
        )

    def flush(self) -> None:
        """Wait until every queued version is visible in the store (or failed); raise the first
        upload error. Sharded publishers: every rank sees the same outcome of every version."""
        self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._pool.shutdown(wait=True)
            if self._groups is not None:
                self._groups.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # don't mask the caller's exception with an upload error
            try:
                self.close()
            except Exception as upload_exc:  # noqa: BLE001
                log.error("publisher closed with an upload error: %s", upload_exc)

    # -- what to publish ---------------------------------------------------------------------
    def _ownership(self, source) -> Ownership:
        tensors = named_tensors(source)
        if not tensors:
            raise ValueError("nothing to publish")
        return resolve(tensors, self.rank, self.world)

    def _wants_anchor(self, version: int, own: Ownership) -> bool:
        return (
            self._needs_anchor
            or self._last_anchor is None
            or version - self._last_anchor >= self.anchor_every
            or own.fingerprint != self._fingerprint
            or not self.snapshot.matches(own.owned)
        )

    def _agree(self, source, version: int | None) -> tuple[int, Ownership, bool]:
        """Sharded: the control gather. Every rank leaves with the same version and anchor decision,
        or every rank raises the same error."""
        groups = self._groups
        assert groups is not None
        msg: dict[str, Any] = {"error": None, "failed": self._pending()}
        own = None
        try:
            v = self._next_version(version)
            own = self._ownership(source)
            msg.update(
                version=v,
                fp=own.fingerprint,
                layout=own.layout_fingerprint,
                anchor=self._wants_anchor(v, own),
            )
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            msg["error"] = f"{type(exc).__name__}: {exc}"
            local_exc: Exception | None = exc
        else:
            local_exc = None
        msgs = self._collective(lambda: groups.gather(msg))
        failed = [(r, m["failed"]) for r, m in enumerate(msgs) if m["failed"] is not None]
        if failed:
            with self._lock:
                self._raised.update(f[0] for _, f in failed)
                mine = self._error
                if mine is not None and self._error_version is not None:
                    self._raised.add(self._error_version)
                self._error = None
            self._needs_anchor = True
            r, (v_failed, text) = failed[0]
            raise PublishError(f"upload failed on rank {r}: {text}", version=v_failed) from mine
        errors = [(r, m["error"]) for r, m in enumerate(msgs) if m["error"] is not None]
        if errors:
            r, text = errors[0]
            raise ShardingError(f"rank {r} could not publish: {text}") from local_exc
        assert own is not None
        versions = [m["version"] for m in msgs]
        if len(set(versions)) > 1:
            by = {v: [r for r, x in enumerate(versions) if x == v] for v in dict.fromkeys(versions)}
            raise ShardingError(
                "ranks publish different versions: " + "; ".join(f"ranks {rs}: version {v}" for v, rs in by.items())
            )
        if len({m["fp"] for m in msgs}) > 1:
            specs = self._collective(lambda: groups.gather(own.spec))
            raise ShardingError("ranks publish different tensors: " + describe_mismatch(specs))
        layouts = [m["layout"] for m in msgs]
        if layouts != self._layouts:
            ranges = self._collective(lambda: groups.gather(own.ranges))
            check_layouts(own.spec, ranges)
            self._layouts = layouts
        self._fingerprint = own.fingerprint
        return versions[0], own, any(m["anchor"] for m in msgs)

    def _whole_sums(
        self, own: Ownership, partials: dict[str, int], nnz: int, error: BaseException | None
    ) -> tuple[dict[str, int], int]:
        """Whole-tensor checksums (and the version's nnz) from every rank's partials."""
        names = [name for name, _, _ in own.spec]
        if self._groups is None:
            return {n: partials.get(n, 0) for n in names}, nnz
        groups = self._groups
        mine = None if error is not None else [partials.get(n, 0) for n in names] + [nnz]
        msgs = self._collective(
            lambda: groups.gather((mine, None if error is None else f"{type(error).__name__}: {error}"))
        )
        for r, (_, text) in enumerate(msgs):
            if text is not None:
                self._needs_anchor = True
                if error is not None:
                    raise error
                raise ShardingError(f"rank {r} failed to detect its changes: {text}")
        total = [0] * (len(names) + 1)
        for values, _ in msgs:
            for i, x in enumerate(values):
                total[i] = (total[i] + x) & MASK64
        return dict(zip(names, total[:-1])), total[-1]

    def _collective(self, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a rank died or timed out: nothing of this version exists
            self._needs_anchor = True
            raise PublishError(f"rank {self.rank}: the publisher group failed ({type(exc).__name__}: {exc})") from exc

    # -- internals ---------------------------------------------------------------------------
    def _next_version(self, version: int | None) -> int:
        if version is None:
            return 0 if self._last is None else self._last + 1
        version = int(version)
        if version < 0 or (self._last is not None and version <= self._last):
            raise ValueError(f"version {version} is not after the last published version {self._last}")
        return version

    def _pending(self) -> tuple[int, str] | None:
        with self._lock:
            if self._error is None:
                return None
            return (self._error_version if self._error_version is not None else -1, str(self._error))

    def _raise_pending(self) -> None:
        with self._lock:
            exc, self._error = self._error, None
            version = self._error_version
            if exc is not None and version is not None:
                self._raised.add(version)
        if exc is not None:
            self._needs_anchor = True  # the chain is broken: start a new one
            raise PublishError(f"upload failed: {exc}", version=version) from exc

    def _wait_for_replicas(self, version: int) -> None:
        """Bounded staleness (staleness.py): wait until enough reporting replicas serve a version within
        `max_staleness` of `version`. Sharded, rank 0 reads the ledger and every rank learns the outcome
        (all publish, or all raise StalenessTimeoutError)."""
        if self._gate is None:
            return
        if self._groups is None:
            self._gate.wait(version)
            return
        error = None
        if self.rank == 0:
            try:
                self._gate.wait(version)
            except StalenessTimeoutError as exc:
                error = str(exc)
        errors = [e for e in self._groups.gather(error) if e is not None]  # the control group (training thread)
        if errors:
            raise StalenessTimeoutError(errors[0])

    def _set_error(self, version: int, exc: BaseException) -> None:
        with self._lock:
            if version in self._raised or self._error is not None:
                return
            self._error, self._error_version = exc, version

    def _maybe_store_assets(self, source) -> None:
        if self._assets_done or self.rank != 0:
            return
        self._assets_done = True
        config = getattr(source, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            doc = config.to_dict()
            if not doc.get("architectures") and isinstance(source, torch.nn.Module):
                # A model built with `from_config` has no `architectures`: name its class, so that a
                # server (or `from_pretrained` on a materialized directory) can pick the model class.
                doc["architectures"] = [type(source).__name__]
            try:
                self.store.put_asset("config.json", json.dumps(doc, indent=2, default=str).encode())
            except Exception as exc:  # noqa: BLE001 - assets are a convenience, never fatal
                log.warning("could not store config.json: %s", exc)

    def _upload_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                base_failed = self._broken_at is not None and job.base is not None and job.base >= self._broken_at
                if self._groups is None:
                    if base_failed:
                        # Its base never became visible: drop it, the next publish starts a new chain.
                        raise _BaseFailed(f"base version {job.base} failed to upload")
                    record = self._upload(job)
                else:
                    record = self._upload_part(job, base_failed)
                self._broken_at = None
                job.future.set_result(record)
            except _BaseFailed as exc:
                job.future.set_exception(PublishError(str(exc), version=job.version))
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                log.error("upload of version %s failed: %s", job.version, exc)
                self._broken_at = job.version if self._broken_at is None else self._broken_at
                self._set_error(job.version, exc)
                job.future.set_exception(exc)
            finally:
                job.sections = None
                job.host = None
                self._queue.task_done()

    def _encode(self, job: _Job) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
        """The version file (or this rank's part file) of a job."""
        if job.kind == "anchor":
            assert job.host is not None
            if job.part is None:
                return encode_anchor(
                    job.version, {o.name: h for o, h in zip(job.owned, job.host)}, job.sums, created=job.created
                )
            slices = {o.name: h for o, h in zip(job.owned, job.host)}
            return encode_anchor_part(
                job.version, job.shapes, self.dtype, job.sums, job.checksum, slices, job.part, created=job.created
            )
        assert job.sections is not None and job.base is not None
        t0 = time.perf_counter()
        job.sections.wait()  # the device work queued before the copies, and the copies
        t0 = self._note(job.version, "d2h", t0)
        sections = job.sections.split()  # per tensor, on the host
        self._note(job.version, "split", t0)
        owned = {o.name: (n, s) for o, n, s in zip(job.owned, job.counts, sections)}
        prepared = {
            name: PreparedTensor(shape, self.dtype, job.sums[name], *owned.get(name, (0, None)))
            for name, shape in job.shapes.items()
        }
        # zstd releases the GIL: compress tensors in parallel (8B, 1%: ~1 s on one thread).
        t0 = time.perf_counter()
        busy: list[float] = []
        try:
            return assemble_delta(
                version=job.version,
                base=job.base,
                base_checksum=job.base_checksum,
                codec=self.codec,
                tensors=prepared,
                pool=self._pool,
                created=job.created,
                checksum=job.checksum if job.part is not None else None,
                part=job.part,
                busy_ms=busy,
            )
        finally:
            self._note(job.version, "pack", t0)
            self.upload_timings.setdefault(job.version, {})["pack_busy"] = sum(busy)

    def _note(self, version: int, phase: str, t0: float) -> float:
        t1 = time.perf_counter()
        self.upload_timings.setdefault(version, {})[phase] = (t1 - t0) * 1e3
        for old in sorted(self.upload_timings)[:-64]:
            del self.upload_timings[old]
        return t1

    def _encoded_file(self, job: _Job) -> tuple[VersionHeader, str]:
        """Encode (pack) and write the job's file to a temporary path."""
        header, payload = self._encode(job)
        t0 = time.perf_counter()
        path = self._write(header, payload)
        self._note(job.version, "write", t0)
        return header, path

    def _write(self, header: VersionHeader, payload: dict[str, torch.Tensor]) -> str:
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._tmpdir)
        os.close(fd)
        try:
            write(path, header, payload)
        except BaseException:
            os.unlink(path)
            raise
        return path

    def _put_encoded(self, job: _Job, put: Callable[[VersionHeader, str], T], phase: str) -> T:
        """Encode the job's file, hand it to `put` (store.publish or store.put_part, with move=True),
        time it as `phase`; the temporary file is gone afterwards whatever happened."""
        header, path = self._encoded_file(job)
        t0 = time.perf_counter()
        try:
            out = put(header, path)
            self._note(job.version, phase, t0)
            return out
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def _upload(self, job: _Job) -> VersionRecord:
        record = self._put_encoded(job, lambda h, p: self.store.publish(h, p, move=True), "commit")
        if self.keep_anchors and job.kind == "anchor":
            self.store.retain(self.keep_anchors)
        return record

    def _upload_part(self, job: _Job, base_failed: bool) -> VersionRecord:
        """Upload this rank's part, agree on the outcome with the other ranks; rank 0 commits."""
        groups = self._groups
        assert groups is not None
        if groups.upload_broken:
            raise PublishError(f"the publisher group failed earlier: {groups.upload_broken}", version=job.version)
        part: PartRecord | None = None
        error: str | None = "base failed" if base_failed else None
        if error is None:
            try:
                part = self._put_encoded(job, lambda h, p: self.store.put_part(h, p, move=True), "put_part")
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                log.error("rank %d: part of version %d failed: %s", self.rank, job.version, exc)
                error = f"{type(exc).__name__}: {exc}"
        t0 = time.perf_counter()
        try:
            reports = groups.gather({"part": asdict(part) if part else None, "error": error}, upload=True)
            outcome: dict[str, Any] | None = None
            if self.rank == 0:
                outcome = self._commit(job, reports)
            outcome = groups.broadcast(outcome)
            self._note(job.version, "commit", t0)
        except Exception as exc:  # noqa: BLE001 - a rank died or timed out: the outcome is unknown here
            groups.upload_broken = f"{type(exc).__name__}: {exc}"
            raise PublishError(
                f"rank {self.rank}: the publisher group failed while committing "
                f"({groups.upload_broken}); the version is not visible unless rank 0 committed it",
                version=job.version,
            ) from exc
        assert outcome is not None
        if not outcome["ok"]:
            if part is not None:
                self.store.discard_parts([part])
            if outcome.get("base_failed"):
                raise _BaseFailed(f"base version {job.base} failed to upload")
            raise PublishError(outcome["error"], version=job.version)
        record = VersionRecord.from_json(outcome["record"])
        if self.rank == 0 and self.keep_anchors and job.kind == "anchor":
            self.store.retain(self.keep_anchors)
        return record

    def _commit(self, job: _Job, reports: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: the record, if every part is in the store."""
        bad = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"] is not None]
        if bad:
            if all(text == "base failed" for _, text in bad):
                return {"ok": False, "base_failed": True, "error": f"base version {job.base} failed to upload"}
            r, text = next((r, t) for r, t in bad if t != "base failed")
            return {"ok": False, "error": f"rank {r} failed to upload its part: {text}"}
        parts = [PartRecord.from_dict(rep["part"]) for rep in reports]
        try:
            record = self.store.commit_parts(
                version=job.version,
                kind=job.kind,
                base=job.base,
                codec=self.codec.name if job.kind == "delta" else None,
                nnz=job.nnz,
                numel=job.numel,
                checksum=job.checksum,
                base_checksum=job.base_checksum,
                parts=parts,
                created=job.created,
            )
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            log.error("commit of version %d failed: %s", job.version, exc)
            return {"ok": False, "error": f"rank 0 could not commit: {type(exc).__name__}: {exc}"}
        return {"ok": True, "record": record.to_json()}


class _BaseFailed(Exception):
    """A delta whose base never became visible: dropped, not an error of its own."""


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["Publisher", "PublishError", "PublishInfo"]
