"""Trainer side: exact change detection against the last published image, the Publisher (single
process, or one part per rank of a sharded trainer) and its options, and the checkpoint names a
module's tensors are published under (names.py)."""

from .names import checkpoint_tensors
from .options import DetectOptions, PublisherOptions, ShardingOptions, StoreOptions, UploadOptions
from .publisher import Publisher, PublishError, PublishInfo
from .shard import ShardedTensor
from .staleness import StalenessPolicy

__all__ = [
    "DetectOptions",
    "Publisher",
    "PublisherOptions",
    "PublishInfo",
    "PublishError",
    "ShardedTensor",
    "ShardingOptions",
    "StalenessPolicy",
    "StoreOptions",
    "UploadOptions",
    "checkpoint_tensors",
]
