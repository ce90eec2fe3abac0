"""Trainer side: exact change detection against the last published image, and the Publisher."""

from .publisher import Publisher, PublishError, PublishInfo

__all__ = ["Publisher", "PublishInfo", "PublishError"]
