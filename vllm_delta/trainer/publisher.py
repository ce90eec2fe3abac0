"""Publisher: turns each training step's weights into one store version, off the training thread.

    with Publisher("file:///data/run1", anchor_every=20, codec="compact") as pub:
        info = pub.publish(model, version=step)   # returns before the upload ends
        ...
    # leaving the block flushes: waits for the uploads and raises the first upload error

`publish` runs change detection and the device part of encoding (gaps, bit differences) on the
parameters' device, then hands host arrays to a background thread that compresses, writes the
safetensors file and uploads it. The queue is bounded, so a slow store slows `publish` down
instead of filling memory. An upload error is raised by the next `publish` or `flush`; the chain
is then broken, so the following version is published as an anchor.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .. import codec as codecs
from ..checksums import MASK64, combine, positional_sum_tensor, to_hex
from ..errors import PublishError
from ..format import DTYPE_NAMES, VersionHeader, write
from ..store import DeltaStore, VersionRecord
from ..writer import PreparedTensor, assemble_delta, encode_anchor
from .detect import Snapshot, named_tensors
from .staleness import StalenessGate, StalenessPolicy

log = logging.getLogger(__name__)


@dataclass
class PublishInfo:
    version: int
    kind: str  # "anchor" | "delta"
    base: int | None
    nnz: int  # changed elements (all elements for an anchor)
    numel: int
    checksum: str  # whole-model checksum of the published image (what a server will report)
    detect_ms: float
    uploaded: Future = field(repr=False)  # -> VersionRecord once the version is visible

    @property
    def density(self) -> float:
        return self.nnz / self.numel if self.numel else 0.0


@dataclass
class _Job:
    """One version on its way to the store: an anchor's header and payload, or a delta's prepared
    tensors (packed on the upload thread)."""

    version: int
    kind: str
    base: int | None
    header: VersionHeader | None = None  # anchors
    payload: dict[str, torch.Tensor] | None = None  # anchors
    prepared: dict[str, PreparedTensor] | None = None  # deltas
    base_checksum: str | None = None  # deltas
    created: float = 0.0
    future: Future = field(default_factory=Future)


class Publisher:
    def __init__(
        self,
        uri: str | DeltaStore,
        *,
        anchor_every: int = 20,
        codec: str = "compact",
        dtype: torch.dtype = torch.bfloat16,
        snapshot_device: str | torch.device | None = None,
        pin_snapshot: bool = False,
        queue_size: int = 2,
        keep_anchors: int | None = None,
        storage_options: dict | None = None,
        pack_threads: int | None = None,
        max_staleness: int | None = None,
        min_replicas: int = 1,
        staleness_timeout_s: float = 600.0,
    ):
        if anchor_every < 1:
            raise ValueError("anchor_every must be >= 1")
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"publishable dtypes: {list(DTYPE_NAMES)}")
        self.store = uri if isinstance(uri, DeltaStore) else DeltaStore(uri, storage_options=storage_options)
        self.codec = codecs.get_codec(codec)
        self.anchor_every = anchor_every
        self.dtype = dtype
        self.keep_anchors = keep_anchors
        self.snapshot = Snapshot(device=snapshot_device, pin=pin_snapshot)
        # Bounded staleness: publish waits until enough reporting replicas caught up (staleness.py).
        self._gate = (
            None
            if max_staleness is None
            else StalenessGate(self.store, StalenessPolicy(max_staleness, min_replicas, staleness_timeout_s))
        )
        self._sums: dict[str, int] = {}  # per-tensor positional sums of the snapshot
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._last: int | None = self.store.latest()
        self._last_anchor: int | None = None
        self._needs_anchor = True  # nothing to diff against until the first anchor
        self._assets_done = False
        self._checksum_of_last: str | None = None
        self._error: BaseException | None = None
        self._broken_at: int | None = None
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
        self._raise_pending()
        if self._closed:
            raise RuntimeError("Publisher is closed")
        version = self._next_version(version)
        if self._gate is not None:
            self._gate.wait(version)
        t0 = time.perf_counter()
        tensors = named_tensors(model_or_tensors)
        if not tensors:
            raise ValueError("nothing to publish")
        self._maybe_store_assets(model_or_tensors)
        names = [n for n, _ in tensors]
        anchor = (
            self._needs_anchor
            or self._last_anchor is None
            or version - self._last_anchor >= self.anchor_every
            or set(names) != set(self._shapes)
        )
        if not anchor:
            for name, t in tensors:
                if tuple(t.shape) != self._shapes[name]:
                    raise ValueError(f"tensor {name!r} changed shape {self._shapes[name]} -> {tuple(t.shape)}")
        host, sections, counts, sums = {}, {}, {}, {}
        try:
            for name, t in tensors:
                image = t.detach().to(self.dtype)
                if anchor:
                    self.snapshot.reset(name, image)
                    self._shapes[name] = tuple(image.shape)
                    sums[name] = positional_sum_tensor(image)
                    copy = image.to("cpu").contiguous()
                    if copy.data_ptr() == t.data_ptr():  # bf16 params on CPU: `to` copied nothing
                        copy = copy.clone()
                    host[name] = copy
                    continue
                pos, new, old = self.snapshot.changes(name, image)
                counts[name] = pos.numel()
                if pos.numel():
                    # Device scalars: one host synchronization for all tensors, after the loop.
                    sums[name] = positional_sum_tensor(new, pos) - positional_sum_tensor(old, pos)
                    sections[name] = self.codec.prepare(pos, new, old, image.numel())
                    self.snapshot.update(name, pos, new)
            values = torch.stack([v.cpu() for v in sums.values()]).tolist() if sums else []
        except BaseException:
            self._needs_anchor = True  # the snapshot may be half-updated: resynchronize with an anchor
            raise
        for name, value in zip(sums, values):
            self._sums[name] = (value if anchor else self._sums[name] + value) & MASK64
        created = time.time()
        if anchor:
            header, payload = encode_anchor(version, host, self._sums, created=created)
            job = _Job(version, "anchor", None, header=header, payload=payload)
        else:
            prepared = {
                name: PreparedTensor(tuple(t.shape), self.dtype, self._sums[name], counts[name], sections.get(name))
                for name, t in tensors
            }
            job = _Job(version, "delta", self._last, prepared=prepared, base_checksum=self._checksum_of_last)
        job.created = created
        checksum = to_hex(combine(self._sums.items()))
        self._checksum_of_last = checksum
        self._queue.put(job)  # blocks when the uploader is behind
        if anchor:
            self._last_anchor = version
        self._needs_anchor = False
        self._last = version
        return PublishInfo(
            version=version,
            kind=job.kind,
            base=job.base,
            nnz=sum(counts.values()) if not anchor else sum(t.numel() for t in host.values()),
            numel=sum(math.prod(t.shape) for _, t in tensors),
            checksum=checksum,
            detect_ms=(time.perf_counter() - t0) * 1e3,
            uploaded=job.future,
        )

    def flush(self) -> None:
        """Wait until every queued version is visible in the store; raise the first upload error."""
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

    # -- internals ---------------------------------------------------------------------------
    def _next_version(self, version: int | None) -> int:
        if version is None:
            return 0 if self._last is None else self._last + 1
        version = int(version)
        if version < 0 or (self._last is not None and version <= self._last):
            raise ValueError(f"version {version} is not after the last published version {self._last}")
        return version

    def _raise_pending(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            self._needs_anchor = True  # the chain is broken: start a new one
            raise PublishError(f"upload failed: {exc}", version=self._broken_at) from exc

    def _maybe_store_assets(self, source) -> None:
        if self._assets_done:
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
                if self._error is not None or (
                    self._broken_at is not None and job.base is not None and job.base >= self._broken_at
                ):
                    # Its base never became visible: drop it, the next publish starts a new chain.
                    job.future.set_exception(PublishError("base version failed to upload", version=job.version))
                    continue
                record = self._upload(job)
                self._broken_at = None
                job.future.set_result(record)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                log.error("upload of version %s failed: %s", job.version, exc)
                self._error, self._broken_at = exc, job.version
                job.future.set_exception(exc)
            finally:
                self._queue.task_done()

    def _upload(self, job: _Job) -> VersionRecord:
        if job.kind == "anchor":
            header, payload = job.header, job.payload
        else:
            assert job.prepared is not None and job.base is not None
            # zstd releases the GIL: compress tensors in parallel (8B, 1%: ~1 s on one thread).
            header, payload = assemble_delta(
                version=job.version,
                base=job.base,
                base_checksum=job.base_checksum,
                codec=self.codec,
                tensors=job.prepared,
                pool=self._pool,
                created=job.created,
            )
        assert header is not None and payload is not None
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._tmpdir)
        os.close(fd)
        try:
            write(path, header, payload)
            record = self.store.publish(header, path, move=True)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        if self.keep_anchors and job.kind == "anchor":
            self.store.retain(self.keep_anchors)
        return record
