"""The one-launch staging of a decoded unit (apply/stage_unit.py) compiled for a GPU: the same cases as
test_stage_unit.py (interpreted on the CPU there), on CUDA, against the engine's general path bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_stage_unit import CASES, _assert_same_outputs, _chunk, _emit

from vllm_delta.apply import stage_unit
from vllm_delta.codec.decoding import Chunk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or stage_unit.triton is None, reason="needs CUDA and Triton"),
]


def _on(chunk: Chunk, dev: torch.device) -> Chunk:
    move = lambda t: None if t is None else t.to(dev)  # noqa: E731
    return Chunk(move(chunk.t_idx), move(chunk.p), move(chunk.diffs), move(chunk.values), chunk.runs)


@pytest.mark.parametrize("block", [32, 1024])
@pytest.mark.parametrize("kind", ["diffs", "undo", "values"])
@pytest.mark.parametrize("mid", [False, True], ids=["whole", "mid"])
@pytest.mark.parametrize("case", list(CASES))
def test_unit_kernel_on_cuda_is_the_general_path(case, mid, kind, block):
    make, names = CASES[case]
    dev = torch.device("cuda")
    engine = make(block, "cuda")
    assert stage_unit.available(dev)
    chunk = _on(_chunk(engine, names, seed=len(case) + 7 * mid, kind=kind, mid=mid), dev)
    undo = kind == "undo"
    fast, width = _emit(engine, chunk, True, undo)
    slow, _ = _emit(engine, chunk, False, undo)
    _assert_same_outputs(fast, slow, width)
    assert bool(fast.sums.any()) == (case != "not-owned")
