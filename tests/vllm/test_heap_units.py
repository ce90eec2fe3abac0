"""The heap test hooks' rule of what is ours (vllm_delta/vllm/shared/heap.py), without an engine."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tracemalloc

import pytest

import vllm_delta
from vllm_delta.vllm.api_server import spans
from vllm_delta.vllm.shared import heap

pytestmark = pytest.mark.vllm_objects  # no engine, no server: make check-vllm-next runs them against the newest vLLM


def _line_of(path: str, text: str) -> int:
    with open(path, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_a_block_allocated_below_a_pass_through_line_is_vllms():
    marked = heap._marked_lines(os.path.dirname(vllm_delta.__file__))
    middleware = inspect.getsourcefile(spans.AttributionMiddleware)
    assert middleware is not None
    call = _line_of(middleware, "await self.app(scope, receiving, send_wrapper)")
    record = _line_of(middleware, "store.record(out.request_id")
    assert (middleware, call) in marked and (middleware, record) not in marked
    vllm_frame = ("/site-packages/vllm/entrypoints/openai/serving.py", 10)
    # tracemalloc's tuples run from the most recent frame to the oldest.
    old, heap._pass_lines = heap._pass_lines, marked
    try:
        below_the_call = (vllm_frame, (middleware, call))
        ours = (("/usr/lib/python3.11/json/decoder.py", 3), (middleware, record))
        assert heap._site(below_the_call) is None
        assert heap._site(ours) == f"{middleware}:{record}"
        assert heap._site((vllm_frame,)) is None
        # the raw tuples are what a snapshot's Traceback holds, oldest first
        assert tuple(tracemalloc.Traceback(ours)) == tuple(map(tracemalloc.Frame, reversed(ours)))
    finally:
        heap._pass_lines = old


# Run in a fresh interpreter: a report walks every object of its process (gc, the tensors), and this test
# session's process holds everything the suite imported (up to two minutes per report in it).
REPORT_TWICE = """
import gc, json, linecache, tracemalloc
from vllm_delta.vllm.api_server import spans
from vllm_delta.vllm.shared import heap

assert not tracemalloc.is_tracing()
heap.start(8)
try:
    heap.report()  # a first report's one-time costs in a long-lived process (the tensor walk's)
    store = spans.SpanStore(limit=64)
    for i in range(32):  # blocks of ours, allocated in spans.py while tracing
        store.record(f"req-{i}", 1, 0, [[1, 0, 4]])
    linecache.clearcache()  # as in a server, where no traceback has read our sources
    gc.collect()
    # the same count through tracemalloc's public objects, block by block (what report() did before it
    # found each distinct traceback's site once)
    snap = tracemalloc.take_snapshot()
    walked = [t for t in snap.traces
              if (f := next((f for f in reversed(t.traceback) if heap._ours(f.filename)), None)) is not None
              and (f.filename, f.lineno) not in heap._pass_lines]
    expect = (sum(t.size for t in walked), len(walked))
    del snap, walked, f
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    report = heap.report()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
finally:
    heap.stop()
print("REPORT " + json.dumps({"before": before, "after": after, "blocks": report.blocks, "bytes": report.bytes,
                             "expect": expect,
                             "top": [s.where for s in report.top]}))
"""


def test_a_report_leaves_nothing_of_its_own_behind():
    """Whatever a report allocates is gone when it returns: traced memory after a report is what it was
    before (a report that read the sources of our blocks' frames through linecache kept them, ~18 KB of
    ours per update in the server's memory test)."""
    proc = subprocess.run([sys.executable, "-c", REPORT_TWICE], capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert line is not None, (proc.returncode, proc.stderr[-3000:])
    report = json.loads(line[len("REPORT ") :])
    before, after = report["before"], report["after"]
    assert report["blocks"] > 0 and any("spans.py" in where for where in report["top"]), report
    # what the walk block by block counts, give or take the walk's own few blocks still alive
    assert abs(report["blocks"] - report["expect"][1]) <= 8, report
    assert abs(report["bytes"] - report["expect"][0]) <= 2048, report
    assert after - before < 4 * 1024, (before, after)


TENSOR_BYTES = """
import torch
from vllm_delta.vllm.shared import heap

before = heap._tensor_bytes()
x = torch.empty(1 << 20, dtype=torch.uint8)
views = [x[10:], x.view(torch.int32)]  # the same storage: counted once
meta = torch.empty(1 << 30, dtype=torch.uint8, device="meta")  # no storage of the process's
class Sub(torch.Tensor):  # a subclass counts like a tensor
    pass
y = torch.empty(4096, dtype=torch.uint8).as_subclass(Sub)
print("GREW", heap._tensor_bytes() - before)
"""


def test_tensor_bytes_counts_each_cpu_storage_once():
    """The torch CPU storages a report adds up: a tensor's storage once however many views it has,
    subclasses too, meta tensors not at all."""
    proc = subprocess.run([sys.executable, "-c", TENSOR_BYTES], capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("GREW ")), None)
    assert line is not None, (proc.returncode, proc.stderr[-3000:])
    assert int(line.split()[1]) == (1 << 20) + 4096, line
