"""Trainer side: exact change detection against the last published image, the Publisher, and the
checkpoint names a module's tensors are published under (names.py)."""

from .names import checkpoint_tensors
from .publisher import Publisher, PublishError, PublishInfo

__all__ = ["Publisher", "PublishInfo", "PublishError", "checkpoint_tensors"]
