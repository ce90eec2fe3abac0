"""The upload thread: jobs from a bounded queue, each one written (encode.py) and committed (the
publish group: the store's `publish`, or a part and the shard group's agreement), one at a time, in
order.

Errors are latched, not lost: the first upload error is kept until the training thread raises it
(the next `publish` or `flush`; a sharded publisher raises it on every rank). A failure breaks the
chain: every later delta built on the failed version is dropped (its future ends with a PublishError,
no error of its own), and the training thread's next version is an anchor.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from ..errors import PublishError
from ..store import DeltaStore, VersionRecord
from .encode import VersionEncoder, WriteFile
from .job import BaseMissing, CommitOutcome, Committed, UploadFailure, UploadJob

log = logging.getLogger(__name__)

KEEP_TIMINGS = 64  # versions whose upload timings `Uploader.timings` keeps


class Committer(Protocol):
    """Makes one job's version visible (group.py: one process; shard_group.py: every rank's part)."""

    def commit(self, job: UploadJob, write: WriteFile, *, base_missing: bool) -> CommitOutcome:
        """`write()` encodes and writes the job's file; `base_missing`: the delta's base failed."""
        ...


class Uploader:
    def __init__(
        self,
        encoder: VersionEncoder,
        committer: Committer,
        *,
        queue_size: int,
        retain: tuple[DeltaStore, int] | None = None,
        after_commit: Callable[[VersionRecord], None] | None = None,
    ):
        """`retain`: (store, keep_anchors) on the process that commits: prune after each anchor.
        `after_commit(record)`: called on this thread after each version this process committed
        (exceptions are logged, never an upload failure)."""
        self._encoder = encoder
        self._committer = committer
        self._retain = retain
        self._after_commit = after_commit
        self.timings: dict[int, dict[str, float]] = {}  # version -> ms per upload phase (the last 64)
        self._queue: queue.Queue[UploadJob | None] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # the first failure not raised yet ...
        self._error_version = -1  # ... and its version
        self._raised: set[int] = set()  # failed versions already raised (sharded: by any rank)
        self._broken_at: int | None = None  # the failed version the next deltas build on, if any
        self._thread = threading.Thread(target=self._run, name="vllm-delta-upload", daemon=True)
        self._thread.start()

    # -- the training thread ---------------------------------------------------------------------
    def submit(self, job: UploadJob) -> None:
        """Queue the job; blocks while the upload thread is `queue_size` versions behind."""
        self.timings[job.version] = job.timings
        for old in sorted(self.timings)[:-KEEP_TIMINGS]:
            del self.timings[old]
        job.submitted = time.perf_counter()
        self._queue.put(job)

    def join(self) -> None:
        """Wait until every queued job is committed or failed."""
        self._queue.join()

    def unraised(self) -> UploadFailure | None:
        """The latched failure the training thread has not raised yet."""
        with self._lock:
            return None if self._error is None else UploadFailure(self._error_version, str(self._error))

    def acknowledge(self, versions: Iterable[int]) -> BaseException | None:
        """The failures of `versions` are raised now (on every rank): never latch them again. Returns
        this thread's failure among them, if any (the cause of what is raised)."""
        raised = set(versions)
        with self._lock:
            self._raised |= raised
            if self._error is None or self._error_version not in raised:
                return None  # a failure latched since is raised by the next publish or flush
            exc, self._error = self._error, None
            return exc

    def close(self) -> None:
        """Stop the thread once the queued jobs are done (the caller flushed first)."""
        self._queue.put(None)
        self._thread.join(timeout=60)
        if not self._thread.is_alive():
            self._encoder.close()

    # -- the upload thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._upload(job)
            finally:
                job.release()
                self._queue.task_done()
        self._queue.task_done()

    def _upload(self, job: UploadJob) -> None:
        if job.submitted:  # the wait for this thread (a version before it still uploading), a named phase
            job.timings["queued"] = (time.perf_counter() - job.submitted) * 1e3
        base_missing = self._broken_at is not None and job.base is not None and job.base >= self._broken_at
        try:
            outcome = self._committer.commit(job, lambda: self._encoder.written(job), base_missing=base_missing)
            if isinstance(outcome, Committed) and self._retain is not None and job.kind == "anchor":
                store, keep = self._retain
                store.retain(keep)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            log.error("upload of version %s failed: %s", job.version, exc)
            self._broken_at = job.version if self._broken_at is None else self._broken_at
            self._latch(job.version, exc)
            job.future.set_exception(exc)
            return
        if isinstance(outcome, BaseMissing):
            job.future.set_exception(PublishError(f"base version {outcome.base} failed to upload", version=job.version))
            return
        self._broken_at = None
        if self._after_commit is not None:
            try:
                with job.timed("after_commit"):  # rank 0: the store's marks read (a listing of bad/)
                    self._after_commit(outcome.record)
            except Exception as exc:  # noqa: BLE001 - the version is visible: nothing failed
                log.warning("after the commit of version %d: %s", job.version, exc)
        job.future.set_result(outcome.record)

    def _latch(self, version: int, exc: BaseException) -> None:
        with self._lock:
            if version in self._raised or self._error is not None:
                return
            self._error, self._error_version = exc, version


__all__ = ["Committer", "Uploader"]
