"""Trainer tests work on tiny tensors: one torch thread. On a shared, oversubscribed CPU, OpenMP's
second thread only spins waiting for a core (measured here: 10-50x slower replays and staging)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
