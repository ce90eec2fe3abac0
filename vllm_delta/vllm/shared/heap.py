"""What vllm-delta's own code keeps alive, measured inside a server process (tests and the soak benchmark).

RSS cannot tell our growth from vLLM's (the soak's control phase grows hundreds of KiB per cycle on its
own), so the test hooks measure ours directly, in the API process and in every worker:

    start(frames)   tracemalloc on, each allocation recording `frames` frames of its traceback
    report()        the blocks still alive whose traceback passes through vllm_delta (its tests' helpers
                    under vllm_delta/testing excluded): bytes, blocks, the largest sites; and the bytes
                    of every torch CPU storage alive in the process (tensor data is allocated outside
                    tracemalloc's reach)
    stop()

A block counts as ours when any frame of its traceback is in vllm_delta, so what vLLM, torch or the
standard library allocate on our behalf counts too (a dict json.loads builds for a record); what vLLM
allocates on its own does not. Nor does what vLLM allocates for a request while it runs under one of
our wrappers: a line that hands a request on to vLLM (the attribution middleware's call of the app,
the loop over `generate`'s outputs) carries the comment `heap: pass-through`, and a block whose
innermost frame of ours is such a line is vLLM's (without this, vLLM's per-request state, 130 B a
block, counted as ours whenever it happened to grow inside the measured window). Tracing slows every
allocation of the process: test hooks only (`VLLM_DELTA_TEST_FAULTS=1`; the API process's POST
/v1/delta/test/heap, the worker call rpc.TEST_HEAP).
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections import Counter
from typing import Literal, get_args

from .messages import HeapReport, HeapSite

HeapAction = Literal["start", "report", "stop"]
HEAP_ACTIONS: tuple[HeapAction, ...] = get_args(HeapAction)
TOP_SITES = 12
_PACKAGE = os.sep + "vllm_delta" + os.sep
_TESTING = _PACKAGE + "testing" + os.sep
_SELF = __file__
PASS_THROUGH = "heap: pass-through"  # the comment that marks a line handing a request on to vLLM
# (file, line) of every marked line, read at start(), before tracing: a report must allocate nothing
# that outlives it (linecache's copies of the sources, read during a report, showed as 18 KB of ours
# per update).
_pass_lines: frozenset[tuple[str, int]] = frozenset()


def start(frames: int = 48) -> None:
    global _pass_lines
    if not tracemalloc.is_tracing():
        _pass_lines = _marked_lines(os.path.dirname(os.path.dirname(os.path.dirname(_SELF))))
        tracemalloc.start(frames)


def stop() -> None:
    tracemalloc.stop()


def _ours(filename: str) -> bool:
    return _PACKAGE in filename and _TESTING not in filename and filename != _SELF


def _marked_lines(package_dir: str) -> frozenset[tuple[str, int]]:
    """(file, line number) of every line of the package that carries PASS_THROUGH."""
    found = []
    for folder, _, names in os.walk(package_dir):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    found += [(path, i) for i, line in enumerate(f, 1) if PASS_THROUGH in line and path != _SELF]
    return frozenset(found)


def _site(frames: tuple[tuple[str, int], ...]) -> str | None:
    """`file:line` of the innermost frame of ours (`frames` as tracemalloc records them: (file, line),
    the most recent first); None without one, or when that frame is a pass-through line (what lies
    below it is vLLM's)."""
    for filename, lineno in frames:
        if _ours(filename):
            return None if (filename, lineno) in _pass_lines else f"{filename}:{lineno}"
    return None


def report(rank: int | None = None) -> HeapReport:
    """Our live blocks (empty unless tracing) and the torch CPU storage bytes alive, after a collection."""
    gc.collect()
    total = blocks = 0
    sites: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    if tracemalloc.is_tracing():
        # The snapshot's raw traces, (domain, size, frames, total frames): CPython's tracemalloc makes one
        # `frames` tuple per distinct traceback and shares it among the blocks allocated there, so a site
        # is found once per traceback (by the tuple's identity), not once per block. A vLLM process holds
        # ~10^5-10^6 traced blocks; through `Snapshot.traces` each costs a Trace, a Traceback and a Frame
        # per frame walked (~100 us: a report took minutes).
        raw = tracemalloc.take_snapshot().traces._traces  # type: ignore[attr-defined]
        site_of: dict[int, str | None] = {}
        for _domain, size, frames, _total in raw:
            key = id(frames)  # the tuple lives as long as `raw`
            try:
                site = site_of[key]
            except KeyError:
                site = site_of[key] = _site(frames)
            if site is None:
                continue
            total += size
            blocks += 1
            short = site[site.rindex(_PACKAGE) + 1 :]
            sites[short] += size
            counts[short] += 1
    top = [HeapSite(where, size, counts[where]) for where, size in sites.most_common(TOP_SITES)]
    return HeapReport(rank=rank, bytes=total, blocks=blocks, top=top, tensor_bytes=_tensor_bytes())


def _tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of every torch tensor the garbage collector can reach."""
    import torch

    seen: dict[int, int] = {}
    tensor = torch.Tensor
    # One subclass check per type, not per object (a server process has ~10^6 objects, and under
    # tracemalloc each check of torch's metaclass cost several us). type(), not isinstance():
    # isinstance reads __class__, which some deprecated module objects warn on.
    is_tensor: dict[type, bool] = {}
    for obj in gc.get_objects():
        cls = type(obj)
        known = is_tensor.get(cls)
        if known is None:
            known = is_tensor[cls] = issubclass(cls, tensor)
        if known and not obj.is_meta and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def act(action: HeapAction, rank: int | None = None) -> HeapReport:
    """One test-hook call: start or stop tracing, or report; every call answers the report."""
    if action == "start":
        start()
    out = report(rank)
    if action == "stop":
        stop()
    return out
