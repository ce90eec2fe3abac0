"""From an upload job to its file on local disk: the seam where a version is encoded and written.

`VersionEncoder.written(job)` is everything between the training thread's hand-off and the store:

* a delta: wait for the device work the codec queued at `publish` (phase `d2h`), start the codec's
  device work on the file (`launch`: the chunked codec's GPU compression), split it per
  tensor (`split`), then encode and write the file (`pack`: the codec's packing, and for the
  chunked codec the file's writes too, which overlap it; `pack_busy`: the sum of the packing
  times, tensor by tensor for per-tensor codecs), and finish the file (`write`: the header and the
  writes still in flight; for per-tensor codecs, the whole write);
* an anchor: the owned rows, already on the host, written as they are (`write`).

The chunked codec's file is pipelined (writer.write_delta, format.PayloadWriter): on the GPU path
each run of chunks is compressed by nvCOMP, copied to pinned memory and written by a pool thread
while the next run is compressed, so the first bytes land while the last are encoded; the header,
reserved before the data, goes in last. A multi-part version's part file is written the same way.

It yields the written file (a temporary path the store moves into place) and removes whatever is
left of it afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from .. import gc_pause
from ..codec import Codec, is_file_level
from ..format import VersionHeader, write
from ..writer import (
    DeltaOf,
    PreparedTensor,
    TableTemplate,
    encode_anchor,
    encode_anchor_part,
    write_delta,
    write_delta_arrays,
)
from .job import UploadJob


@dataclass(frozen=True)
class EncodedFile:
    """A version's file (or a part file), written to local disk."""

    header: VersionHeader
    path: str  # temporary: the store's put moves it into place; removed afterwards if it is still here


WriteFile = Callable[[], AbstractContextManager[EncodedFile]]  # one job's `written`, ready to enter


class VersionEncoder:
    """Encodes and writes jobs' files on the upload thread (one job at a time)."""

    def __init__(self, codec: Codec, dtype: torch.dtype, *, pack_threads: int | None = None, header_format: int = 5):
        if header_format not in (3, 4, 5):
            raise ValueError(f"a file-level codec's deltas are written in format 3, 4 or 5, not {header_format}")
        self.codec = codec
        self.dtype = dtype
        self.header_format = header_format  # a file-level codec's deltas (5: arrays, 4: columns, 3: dicts)
        self._template: tuple[object, object, TableTemplate] | None = None  # (shapes, owned, template)
        self._tmpdir = tempfile.mkdtemp(prefix="vllm-delta-pub-")
        self._pool = ThreadPoolExecutor(
            max_workers=pack_threads or min(16, os.cpu_count() or 1), thread_name_prefix="vllm-delta-pack"
        )

    @contextmanager
    def written(self, job: UploadJob) -> Iterator[EncodedFile]:
        """The job's file, encoded and written; gone after the block whatever happened."""
        path = self._path()
        try:
            header = self._write_delta(job, path) if job.kind == "delta" else self._write_anchor(job, path)
            yield EncodedFile(header, path)
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def _path(self) -> str:
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._tmpdir)
        os.close(fd)
        return path

    def _write_anchor(self, job: UploadJob, path: str) -> VersionHeader:
        assert job.host is not None
        slices = {o.name: h for o, h in zip(job.owned, job.host)}
        if job.part is None:
            header, payload = encode_anchor(job.version, slices, job.sums_by_name(), created=job.created)
        else:
            header, payload = encode_anchor_part(
                job.version,
                job.shapes,
                self.dtype,
                job.sums_by_name(),
                job.checksum,
                slices,
                job.part,
                created=job.created,
            )
        with job.timed("write"):
            write(path, header, payload)
        return header

    def _write_delta(self, job: UploadJob, path: str) -> VersionHeader:
        """The version file's (or this rank's part file's) header and payload, written to `path`."""
        assert job.sections is not None and job.base is not None
        with job.timed("d2h"):
            job.sections.wait()  # the device work queued before the copies, and the copies
        with job.timed("launch"):
            job.sections.begin()  # started by the Publisher already, else now: runs while the header is laid out
        of = DeltaOf(
            version=job.version,
            base=job.base,
            base_checksum=job.base_checksum,
            created=job.created,
            checksum=job.checksum if job.part is not None else None,
            part=job.part,
            columns=self.header_format >= 4,
        )
        busy: list[float] = []
        if self.header_format == 5 and is_file_level(self.codec):
            # format 5: the header's table from arrays, no object per tensor (split, pack and header)
            of = dataclasses.replace(of, checksum=job.checksum)
            try:
                return write_delta_arrays(
                    path,
                    of,
                    self.codec,
                    job.sections,
                    self._table_template(job),
                    job.sums,
                    job.counts,
                    pool=self._pool,
                    busy_ms=busy,
                    timings=job.timings,
                )
            finally:
                job.timings["pack_busy"] = sum(busy)
        # Objects per tensor here (sections, prepared tensors) and a header column per field in
        # write_delta: ~19K each for a mixture of experts, which the collector would otherwise walk
        # again and again (gc_pause.py).
        with gc_pause.paused():
            with job.timed("split"):
                sections = job.sections.split()  # per tensor, on the host
            owned = {o.name: (n, s) for o, n, s in zip(job.owned, job.counts, sections)}
            sums = job.sums_by_name()
            prepared = {
                name: PreparedTensor(shape, self.dtype, sums[name], *owned.get(name, (0, None)))
                for name, shape in job.shapes.items()
            }
            try:
                # zstd releases the GIL: tensors (or chunks) in parallel on the pool (8B, 1%: ~1 s on one thread)
                return write_delta(path, of, self.codec, prepared, pool=self._pool, busy_ms=busy, timings=job.timings)
            finally:
                job.timings["pack_busy"] = sum(busy)

    def _table_template(self, job: UploadJob) -> TableTemplate:
        """The table's per-run part (writer.TableTemplate), made again only when the job's tensor set or
        share is another (an Ownership is reused by every publish of the same tensors: sources.py)."""
        cached = self._template
        if cached is not None and cached[0] is job.shapes and cached[1] is job.owned:
            return cached[2]
        template = TableTemplate.of(job.shapes, self.dtype, [(o.name, o.row0, o.row1) for o in job.owned])
        self._template = (job.shapes, job.owned, template)
        return template

    def close(self) -> None:
        """Once no job is being written any more."""
        self._pool.shutdown(wait=True)
        shutil.rmtree(self._tmpdir, ignore_errors=True)


__all__ = ["EncodedFile", "VersionEncoder", "WriteFile"]
