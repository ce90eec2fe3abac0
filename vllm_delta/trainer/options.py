"""The Publisher's rarer settings, one dataclass per job, composed at the call site:

    from vllm_delta import Publisher
    from vllm_delta.trainer import DetectOptions, PublisherOptions, StoreOptions

    Publisher("s3://bucket/run1", anchor_every=20, options=PublisherOptions(
        store=StoreOptions(storage_options={"client_kwargs": {...}}, keep_anchors=3),
        detect=DetectOptions(snapshot_device="cpu", pin_snapshot=True),
    ))

The everyday settings stay keywords of `Publisher` itself: `anchor_every`, `codec`, `group`,
`max_staleness`, `min_replicas`, and `storage_options` (the fsspec convention: `Publisher(uri,
storage_options={...})`, as `DeltaStore`, pandas and datasets take it; the same as
`StoreOptions(storage_options=...)`, and giving both is an error). Each dataclass checks its own
values when it is built, so a bad setting fails at the call site, before any thread, file or process
group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec.chunked.blocks import RANK_BLOCKS
from ..format import DTYPE_NAMES
from ..store import DeltaStore
from .detect import CHUNK_ELEMS, STREAM_PASS_ELEMS
from .staleness import StalenessPolicy


@dataclass(frozen=True)
class DetectOptions:
    """Change detection (detect.FlatSnapshot): which kernels compare, and where the last published
    image (2 bytes per owned element) lives. `backend`: "triton", "triton-chunked" or "torch"
    (detect.BACKENDS, checked by FlatSnapshot); None: $VLLM_DELTA_DETECT_BACKEND, else "triton" on CUDA."""

    backend: str | None = None
    chunk_elems: int = CHUNK_ELEMS  # elements compared per chunk on the chunked paths (bounds temporaries)
    # elements per pass when the codec encodes detection's passes as they come (chunked): a pass's
    # changes are on the device at once (~20 B per change); fewer passes, fewer host waits
    stream_pass_elems: int = STREAM_PASS_ELEMS
    snapshot_device: str | torch.device | None = None  # None: the parameters' device
    pin_snapshot: bool = False  # pinned host memory, with snapshot_device="cpu"

    def __post_init__(self) -> None:
        if self.chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, not {self.chunk_elems}")
        if self.stream_pass_elems < 1:
            raise ValueError(f"stream_pass_elems must be >= 1, not {self.stream_pass_elems}")


@dataclass(frozen=True)
class UploadOptions:
    """The upload thread (uploader.py): how far it may fall behind, and its packing pool."""

    queue_size: int = 2  # versions waiting for the upload thread; `publish` blocks beyond (bounds memory)
    pack_threads: int | None = None  # zstd packing pool (zstd releases the GIL); None: min(16, CPUs)
    # `chunked` deltas' header format: 5 (packed arrays: written and read with no object per tensor),
    # 4 (JSON columns) or 3 (an object per tensor), for servers of releases before format 5 (or 4):
    # upgrade them, then drop this
    header_format: int = 5
    header_columns: bool = True  # False: format 3 whatever `header_format` says (the option before it)
    # The chunked codec's GPU encode: frames per nvCOMP compression call. None: as many as a call takes
    # (fastest; nvCOMP's temporary space for a whole Qwen3-8B version at 1% is ~1.8 GB). A number bounds
    # what torch's allocator holds for the calls (each call's space is reused by the next), not the
    # device-wide peak: nvCOMP's zstd asks ~1.1 GB of space for any batch of 64 KiB frames, and a call
    # costs ~10 ms however small (docs/PERFORMANCE.md, issue 35: memory and time side by side)
    gpu_encode_frames: int | None = None
    # `chunked` deltas (format 5) laid out by rank blocks (RANK_BLOCKS = 8): the elements of each tensor
    # that TP 2, 4 and 8 split (by its name: q/k/v, gate/up, embeddings by rows; o_proj, down_proj by
    # columns) ordered so that a tensor-parallel server rank decodes only its share's chunks
    # (codec/chunked/blocks.py). Off by default (0: one stream, every tensor whole, as formats 3 and 4):
    # measured on an H200 at W=1 (2026-11-29, docs/PERFORMANCE.md) the layout added 93 ms to Qwen3-8B's
    # step end -> live (116 -> 209 ms p50) and 123 ms to 30B-A3B's (12 layers), and ~550 MB to the
    # publish's peak, while its gain (a TP=2 rank decodes ~0.5 of a version, not all) is measured on
    # CPUs only: turn it on for servers at TP >= 2 once that gain is measured on two GPUs
    rank_blocks: int = 0

    @property
    def chunked_format(self) -> int:
        """The format `chunked` deltas are written in."""
        return self.header_format if self.header_columns else 3

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, not {self.queue_size}")
        if self.pack_threads is not None and self.pack_threads < 1:
            raise ValueError(f"pack_threads must be >= 1 (or None), not {self.pack_threads}")
        if self.header_format not in (3, 4, 5):
            raise ValueError(f"header_format must be 3, 4 or 5, not {self.header_format}")
        if self.rank_blocks not in (0, RANK_BLOCKS):
            raise ValueError(
                f"rank_blocks must be 0 or {RANK_BLOCKS} (the boundaries of TP 2, 4 and 8), not {self.rank_blocks}"
            )
        if self.gpu_encode_frames is not None and self.gpu_encode_frames < 1:
            raise ValueError(f"gpu_encode_frames must be >= 1 (or None), not {self.gpu_encode_frames}")


@dataclass(frozen=True)
class StoreOptions:
    """The store: how to reach it (when the Publisher is given a URI) and what to keep."""

    storage_options: dict[str, Any] | None = None  # fsspec options (S3 endpoint, credentials, ...)
    keep_anchors: int | None = None  # after each anchor, `store.retain(keep_anchors)`; None keeps everything

    def __post_init__(self) -> None:
        if self.keep_anchors is not None and self.keep_anchors < 1:
            raise ValueError(f"keep_anchors must be >= 1 (or None), not {self.keep_anchors}")

    def open_store(self, uri: str | DeltaStore, storage_options: dict[str, Any] | None = None) -> DeltaStore:
        """The store a Publisher writes: `uri` opened with the fsspec options, given here or as
        `Publisher(storage_options=...)` (one place, not both), or `uri` itself when it is a store
        already (which has its own options)."""
        if storage_options is not None and self.storage_options is not None:
            raise ValueError(
                "storage_options given twice: pass Publisher(storage_options=...) or "
                "PublisherOptions(store=StoreOptions(storage_options=...)), not both"
            )
        options = storage_options if storage_options is not None else self.storage_options
        if isinstance(uri, DeltaStore):
            if options is not None:
                raise ValueError(f"storage_options are for a URI: {uri!r} is a store, opened with its own options")
            return uri
        return DeltaStore(uri, storage_options=options)


@dataclass(frozen=True)
class ShardingOptions:
    """A sharded publisher (`Publisher(..., group=...)`)."""

    timeout_s: float = 600.0  # how long a rank waits for the others in a collective before it raises

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {self.timeout_s}")


@dataclass(frozen=True)
class PublisherOptions:
    """Everything `Publisher` takes besides its keywords, grouped by job."""

    dtype: torch.dtype = torch.bfloat16  # what is published (and compared): the servers' weight dtype
    detect: DetectOptions = field(default_factory=DetectOptions)
    upload: UploadOptions = field(default_factory=UploadOptions)
    store: StoreOptions = field(default_factory=StoreOptions)
    sharding: ShardingOptions = field(default_factory=ShardingOptions)
    # Bounded staleness with every knob (timeout, poll interval); `Publisher(max_staleness=K,
    # min_replicas=R)` is the short form of `staleness=StalenessPolicy(K, R)`.
    staleness: StalenessPolicy | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"publishable dtypes: {list(DTYPE_NAMES)} (not {self.dtype})")

    def staleness_policy(self, max_staleness: int | None, min_replicas: int) -> StalenessPolicy | None:
        """The policy `publish` waits on: from Publisher's keywords or from `staleness`, not both."""
        if max_staleness is None:
            return self.staleness
        if self.staleness is not None:
            raise ValueError(
                "bounded staleness is set twice: pass max_staleness/min_replicas or options.staleness, not both"
            )
        return StalenessPolicy(max_staleness, min_replicas)


__all__ = ["DetectOptions", "PublisherOptions", "ShardingOptions", "StoreOptions", "UploadOptions"]
