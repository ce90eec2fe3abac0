"""The cyclic garbage collector paused around a bulk parse (a leaf: imports nothing of the package).

Why: a version header lists every tensor of the model (a mixture of experts: ~19K), and reading one
makes ~10^5 small acyclic objects (lists, ints, strings, dicts). CPython triggers collections by
allocation counts, so a parse runs many of them, each over the objects made so far and, when the
counts say so, over everything the process holds: measured on a 30B-A3B-shaped header of two parts,
the collections cost as much as the parse (docs/PERFORMANCE.md). Nothing a parse makes is cyclic, so
nothing is left for the collector afterwards that it would have freed during the pause.

`paused()` nests and may be entered from several threads at once: the collector is disabled by the
first entry (only if it was enabled) and enabled again by the last exit. The collector's switch is
one per process: code that disables it for its own reasons while a pause is open (vLLM does, around
CUDA graph capture at start-up, before any update can be staged) gets it enabled when the pause ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # pauses open
_disabled_by_us = False  # whether the first open pause found the collector enabled


@contextmanager
def paused() -> Iterator[None]:
    """The collector disabled for the block (if it was enabled when the first open pause began)."""
    global _depth, _disabled_by_us
    with _lock:
        if _depth == 0:
            _disabled_by_us = gc.isenabled()
            if _disabled_by_us:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _disabled_by_us:
                _disabled_by_us = False
                gc.enable()


__all__ = ["paused"]
