"""Trainer side: exact change detection against the last published image, the Publisher (single
process, or one part per rank of a sharded trainer), and the checkpoint names a module's tensors are
published under (names.py)."""

from .names import checkpoint_tensors
from .publisher import Publisher, PublishError, PublishInfo
from .shard import ShardedTensor

__all__ = ["Publisher", "PublishInfo", "PublishError", "ShardedTensor", "checkpoint_tensors"]
