"""From an upload job to its file on local disk: the seam where a version is encoded and written.

`VersionEncoder.written(job)` is everything between the training thread's hand-off and the store:

* a delta: wait for the device-to-host copies the codec queued at `publish` (phase `d2h`), split them
  per tensor (`split`), pack every changed tensor (zstd, on a thread pool: `pack`; the sum of the
  tensors' packing times is `pack_busy`), write the safetensors file (`write`);
* an anchor: the owned rows, already on the host, written as they are (`write`).

It yields the written file (a temporary path the store moves into place) and removes whatever is
left of it afterwards. Encoding, the copy and the write run one after the other today; a pipelined
encoder (the three overlapping in chunks) replaces the body of `_encode`/`_write` behind the same
`written(job)`: same job in, same `EncodedFile` out, same phase names.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from ..codec import Codec
from ..format import VersionHeader, write
from ..writer import PreparedTensor, assemble_delta, encode_anchor, encode_anchor_part
from .job import UploadJob


@dataclass(frozen=True)
class EncodedFile:
    """A version's file (or a part file), written to local disk."""

    header: VersionHeader
    path: str  # temporary: the store's put moves it into place; removed afterwards if it is still here


WriteFile = Callable[[], AbstractContextManager[EncodedFile]]  # one job's `written`, ready to enter


class VersionEncoder:
    """Encodes and writes jobs' files on the upload thread (one job at a time)."""

    def __init__(self, codec: Codec, dtype: torch.dtype, *, pack_threads: int | None = None):
        self.codec = codec
        self.dtype = dtype
        self._tmpdir = tempfile.mkdtemp(prefix="vllm-delta-pub-")
        self._pool = ThreadPoolExecutor(
            max_workers=pack_threads or min(16, os.cpu_count() or 1), thread_name_prefix="vllm-delta-pack"
        )

    @contextmanager
    def written(self, job: UploadJob) -> Iterator[EncodedFile]:
        """The job's file, encoded and written; gone after the block whatever happened."""
        header, payload = self._encode(job)
        with job.timed("write"):
            path = self._write(header, payload)
        del payload
        try:
            yield EncodedFile(header, path)
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def _encode(self, job: UploadJob) -> tuple[VersionHeader, dict[str, torch.Tensor]]:
        """The version file's (or this rank's part file's) header and payload."""
        if job.kind == "anchor":
            assert job.host is not None
            slices = {o.name: h for o, h in zip(job.owned, job.host)}
            if job.part is None:
                return encode_anchor(job.version, slices, job.sums, created=job.created)
            return encode_anchor_part(
                job.version, job.shapes, self.dtype, job.sums, job.checksum, slices, job.part, created=job.created
            )
        assert job.sections is not None and job.base is not None
        with job.timed("d2h"):
            job.sections.wait()  # the device work queued before the copies, and the copies
        with job.timed("split"):
            sections = job.sections.split()  # per tensor, on the host
        owned = {o.name: (n, s) for o, n, s in zip(job.owned, job.counts, sections)}
        prepared = {
            name: PreparedTensor(shape, self.dtype, job.sums[name], *owned.get(name, (0, None)))
            for name, shape in job.shapes.items()
        }
        busy: list[float] = []
        try:
            with job.timed("pack"):
                return assemble_delta(
                    version=job.version,
                    base=job.base,
                    base_checksum=job.base_checksum,
                    codec=self.codec,
                    tensors=prepared,
                    pool=self._pool,  # zstd releases the GIL: tensors in parallel (8B, 1%: ~1 s on one thread)
                    created=job.created,
                    checksum=job.checksum if job.part is not None else None,
                    part=job.part,
                    busy_ms=busy,
                )
        finally:
            job.timings["pack_busy"] = sum(busy)

    def _write(self, header: VersionHeader, payload: dict[str, torch.Tensor]) -> str:
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._tmpdir)
        os.close(fd)
        try:
            write(path, header, payload)
        except BaseException:
            os.unlink(path)
            raise
        return path

    def close(self) -> None:
        """Once no job is being written any more."""
        self._pool.shutdown(wait=True)
        shutil.rmtree(self._tmpdir, ignore_errors=True)


__all__ = ["EncodedFile", "VersionEncoder", "WriteFile"]
