"""What publish reads from the model is resolved once and reused while it holds (trainer/sources.py).

Every change that could make a reused resolution publish stale data must resolve again: each is
made here, and the published checksum is compared with the checksum of the live weights.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_delta import Publisher, ShardedTensor, checksum
from vllm_delta.trainer.sources import SourceCache


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 4, bias=False)
        self.register_buffer("scale", torch.ones(3))


def live_checksum(model: nn.Module) -> str:
    return checksum({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})


def test_the_same_model_resolves_once():
    model, cache = Tiny(), SourceCache()
    first = cache.ownership(model, 0, 1)
    for _ in range(3):
        assert cache.ownership(model, 0, 1) is first
    assert (cache.hits, cache.misses) == (3, 1)
    assert cache.ownership(Tiny(), 0, 1) is not first  # another model object


def test_every_change_that_matters_resolves_again():
    model, cache = Tiny(), SourceCache()
    own = cache.ownership(model, 0, 1)
    with torch.no_grad():
        model.a.weight.add_(1.0)  # in place (an optimizer step): the same resolution
    assert cache.ownership(model, 0, 1) is own
    model.a.weight.data = torch.randn(6, 8)  # the same Parameter, new memory
    own2 = cache.ownership(model, 0, 1)
    assert own2 is not own and own2.owned[0].source.data_ptr() == model.a.weight.data_ptr()
    model.b.weight = nn.Parameter(torch.randn(4, 6))  # a replaced Parameter
    own3 = cache.ownership(model, 0, 1)
    assert own3 is not own2
    model.c = nn.Linear(2, 2)  # a new submodule: a new tensor to publish
    own4 = cache.ownership(model, 0, 1)
    assert "c.weight" in own4.names and "c.weight" not in own3.names
    del model.c
    assert "c.weight" not in cache.ownership(model, 0, 1).names
    model.b._parameters["weight"] = nn.Parameter(torch.randn(4, 6))  # a direct table write (FSDP2 does)
    own5 = cache.ownership(model, 0, 1)
    assert own5.owned[-1].source.data_ptr() == model.b.weight.data_ptr()
    assert cache.ownership(model, 1, 2) is not own5  # another rank's view


def test_mappings_are_reused_while_they_hold_the_same_tensors():
    w, u = torch.randn(4, 3), torch.randn(5)
    cache = SourceCache()
    own = cache.ownership({"w": w, "u": u}, 0, 1)
    assert cache.ownership({"w": w, "u": u}, 0, 1) is own  # a new dict of the same tensors
    assert cache.ownership([("w", w), ("u", u)], 0, 1) is own
    assert cache.ownership({"u": u, "w": w}, 0, 1) is not own  # another order
    assert cache.ownership({"w": w.clone(), "u": u}, 0, 1) is not own
    sharded = {"w": ShardedTensor(w, (4, 3), 0)}
    own = cache.ownership(sharded, 0, 1)
    assert cache.ownership({"w": ShardedTensor(w, (4, 3), 0)}, 0, 1) is own  # equal fields
    assert cache.ownership({"w": ShardedTensor(w[:2], (4, 3), 0)}, 0, 2) is not own


def test_publishing_after_each_kind_of_change_publishes_the_live_weights(tmp_path):
    """End to end: the version's checksum is the live weights' after each change, and the versions
    replay to them bit for bit."""
    from vllm_delta import replay
    from vllm_delta.store import DeltaStore

    torch.manual_seed(0)
    model = Tiny()
    model.scale = None  # buffers are not published for plain modules
    changes = [
        lambda: model.a.weight.data.add_(0.25),  # in place
        lambda: setattr(model.a.weight, "data", torch.randn(6, 8)),  # new memory, same Parameter
        lambda: setattr(model.b, "weight", nn.Parameter(torch.randn(4, 6))),  # a new Parameter
    ]
    with Publisher(str(tmp_path), anchor_every=100) as pub:
        infos = [pub.publish(model, version=0)]
        for v, change in enumerate(changes, start=1):
            with torch.no_grad():
                change()
            infos.append(pub.publish(model, version=v))
            assert infos[-1].checksum == live_checksum(model), v
            want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
            pub.flush()
            _, got = replay(DeltaStore(str(tmp_path)), v)
            for n, t in want.items():
                assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), (v, n)
    assert [i.kind for i in infos] == ["anchor", "delta", "delta", "delta"]
