"""Trainer side: exact change detection against the last published image, and the Publisher
(single process, or one part per rank of a sharded trainer)."""

from .publisher import Publisher, PublishError, PublishInfo
from .shard import ShardedTensor

__all__ = ["Publisher", "PublishInfo", "PublishError", "ShardedTensor"]
