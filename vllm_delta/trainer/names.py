"""Publish what vLLM loads: a transformers model's in-memory tensors under their checkpoint names.

transformers 5 converts some checkpoints when it loads them: a Qwen3-MoE's per-expert
`mlp.experts.<e>.gate_proj.weight` / `up_proj.weight` become one fused `mlp.experts.gate_up_proj`
`[E, 2I, H]` in memory, `down_proj.weight`s one `mlp.experts.down_proj` `[E, H, I]`. vLLM's loaders,
and everything `save_pretrained` writes, use the checkpoint form. So the Publisher publishes the
checkpoint form, computed with transformers' own machinery (`revert_weight_conversion` and the
model's conversion mapping, exactly what `save_pretrained` runs), never with a table per model.

Reverting copies (`Chunk` makes each half `.contiguous()`), so the map is *learned* once per model
instead: every in-memory tensor that a conversion touches is passed through `revert_weight_conversion`
as an index-coded tensor (element i holds i), and each checkpoint tensor that comes out is recognised
as a strided box of its source (offset + strides). Each publish then reads views of the live
parameters, with no copy beyond the bf16 cast the Publisher makes anyway. Layers of the same shape
share one learned box map (the index-coded pass runs once per distinct tensor, not once per layer),
and each learned map is checked once against what the conversion makes of the live values.
A checkpoint tensor that is not a box of one source (a conversion that merges or interleaves) is
produced by running the conversion on the live values at every publish (correct, with copies).

Models without conversions (Llama, Qwen3 dense, ...) publish `named_parameters()` exactly as before.
Sharded (DTensor) parameters of a converted model are refused for now (see docs/VLLM.md).
"""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..bits import bit_view

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Box:
    """A checkpoint tensor as a strided view of one in-memory tensor (element offsets of a contiguous source)."""

    name: str  # checkpoint name
    source: str  # in-memory (state_dict) name
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None  # None: not a view; converted from live values at every publish
    offset: int = 0


@dataclass
class CheckpointMap:
    """In-memory state_dict names -> checkpoint tensors, for one model (learned by `learn`)."""

    boxes: list[Box]  # in checkpoint (save_pretrained) order
    signature: tuple  # (name, shape, dtype) of the sources it was learned for
    converted: bool  # False: the identity (no conversion applies)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.boxes]

    def tensors(
        self, model: nn.Module, sources: dict[str, torch.Tensor] | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of the model's current values: views where the map allows."""
        sources = _sources(model) if sources is None else sources
        copied = [b for b in self.boxes if b.stride is None]
        converted = _revert(model, {b.source: sources[b.source] for b in copied}) if copied else {}
        out = []
        for b in self.boxes:
            if b.stride is None:
                out.append((b.name, converted[b.name]))
                continue
            src = sources[b.source]
            if not src.is_contiguous():
                raise ValueError(
                    f"{b.source} is not contiguous: its checkpoint views were learned for contiguous storage"
                )
            out.append((b.name, torch.as_strided(src, b.shape, b.stride, src.storage_offset() + b.offset)))
        return out


def conversions(model: nn.Module) -> list:
    """The conversions `save_pretrained` would revert for this model (empty: names are the checkpoint's)."""
    known = getattr(model, "_weight_conversions", None)  # set by from_pretrained
    if known is not None:
        return list(known)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return []
    if not hasattr(model, "config") or not hasattr(model, "get_parameter_or_buffer"):
        return []  # not a transformers PreTrainedModel
    found = get_model_conversion_mapping(model, add_legacy=False)
    return [c for c in found if not isinstance(c, PrefixChange)]  # as revert_weight_conversion does


def _sources(model: nn.Module) -> dict[str, torch.Tensor]:
    """What save_pretrained starts from: state_dict without ignored keys and without tied duplicates."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    sd = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        sd.pop(key, None)
    return dict(remove_tied_weights_from_state_dict(sd, model))


def _revert(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(state_dict)))


def _signature(sources: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, tuple(t.shape), str(t.dtype)) for n, t in sources.items())


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _template(name: str) -> str:
    return _DIGITS.sub("#", name)


def _box_of(coded: torch.Tensor, out: torch.Tensor) -> tuple[tuple[int, ...], int] | None:
    """(strides, offset) such that coded.view(-1).as_strided(out.shape, strides, offset) == out, or None."""
    if out.dtype != coded.dtype or out.numel() == 0:
        return None
    zero = (0,) * out.ndim
    offset = int(out[zero]) if out.ndim else int(out)
    strides = []
    for d in range(out.ndim):
        if out.shape[d] > 1:
            idx = tuple(1 if i == d else 0 for i in range(out.ndim))
            strides.append(int(out[idx]) - offset)
        else:
            strides.append(1)
    try:
        view = torch.as_strided(coded.reshape(-1), tuple(out.shape), tuple(strides), offset)
    except RuntimeError:
        return None
    return (tuple(strides), offset) if torch.equal(view, out) else None


def learn(model: nn.Module) -> CheckpointMap:
    """Learn the map once (see the module docstring)."""
    sources = _sources(model)
    signature = _signature(sources)
    if not conversions(model):
        return CheckpointMap(
            [Box(n, n, tuple(t.shape), tuple(t.stride())) for n, t in sources.items()], signature, False
        )
    if any(type(t).__name__ == "DTensor" for t in sources.values()):
        raise NotImplementedError(
            "checkpoint names for sharded (DTensor) parameters of a model whose checkpoint form differs from its "
            "in-memory form are not supported yet: publish full tensors (e.g. a state dict gathered on one rank)"
        )
    # The whole model on meta tensors: the checkpoint's names, shapes and order (cheap, no data).
    full = {n: t for n, t in _revert(model, {n: _meta(t) for n, t in sources.items()}).items()}
    boxes: dict[str, Box] = {}
    learned: dict[tuple, list[tuple[tuple[int, ...], int] | None]] = {}
    for name, t in sources.items():
        outs = _revert(model, {name: _meta(t)})
        if any(o not in full or tuple(full[o].shape) != tuple(v.shape) for o, v in outs.items()):
            for o in outs:
                if o in full:
                    boxes.setdefault(o, Box(o, name, tuple(full[o].shape), None))
            continue  # the conversion needs other tensors too: converted from live values at every publish
        if list(outs) == [name] and tuple(outs[name].shape) == tuple(t.shape):
            boxes[name] = Box(name, name, tuple(t.shape), tuple(t.stride()))  # untouched
            continue
        key = (_template(name), tuple(t.shape), tuple(_template(o) for o in outs))
        if key not in learned:
            learned[key] = _learn_boxes(model, name, t)
            _check_boxes(model, name, t, learned[key])
        for (o, v), found in zip(outs.items(), learned[key]):
            boxes[o] = Box(o, name, tuple(v.shape), found[0] if found else None, found[1] if found else 0)
    missing = set(full) - set(boxes)
    if missing:
        raise ValueError(f"could not trace checkpoint tensors {sorted(missing)[:5]} to in-memory tensors")
    ordered = [boxes[n] for n in full]
    views = sum(b.stride is not None for b in ordered)
    log.info("vllm-delta: %d in-memory tensors -> %d checkpoint tensors (%d views)", len(sources), len(ordered), views)
    return CheckpointMap(ordered, signature, True)


def _learn_boxes(model: nn.Module, name: str, t: torch.Tensor) -> list[tuple[tuple[int, ...], int] | None]:
    """Run the conversion on an index-coded tensor of `t`'s shape: each output as a box of it."""
    dtype = torch.int32 if t.numel() < 2**31 else torch.int64
    coded = torch.arange(t.numel(), dtype=dtype).reshape(t.shape)
    return [_box_of(coded, out) for out in _revert(model, {name: coded}).values()]


def _check_boxes(model: nn.Module, name: str, t: torch.Tensor, found: list) -> None:
    """Once per learned map: the views must equal what the conversion itself makes of the live values
    (what save_pretrained writes); a box that does not is dropped (converted at every publish)."""
    real = list(_revert(model, {name: t}).values())
    for i, (box, out) in enumerate(zip(found, real)):
        if box is None:
            continue
        stride, offset = box
        if t.is_contiguous():
            view = torch.as_strided(t, tuple(out.shape), stride, t.storage_offset() + offset)
            if view.dtype == out.dtype and _same_bits(view, out):
                continue
        log.warning("vllm-delta: checkpoint tensor %d of %s is not the view learned for it; converting it", i, name)
        found[i] = None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() and a.element_size() in (2, 4):
        return torch.equal(bit_view(a), bit_view(b))  # NaNs compare too
    return torch.equal(a, b)


_CACHE: weakref.WeakKeyDictionary[nn.Module, CheckpointMap] = weakref.WeakKeyDictionary()


def checkpoint_map(model: nn.Module, sources: dict[str, torch.Tensor] | None = None) -> CheckpointMap:
    """The model's map, learned on first use and kept while its tensors keep their names and shapes."""
    cached = _CACHE.get(model)
    if cached is not None and cached.signature == _signature(_sources(model) if sources is None else sources):
        return cached
    found = learn(model)
    _CACHE[model] = found
    return found


def checkpoint_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs to publish for a module: its checkpoint form (what vLLM and save_pretrained
    use). For a model without conversions: `named_parameters()`, unchanged."""
    if not conversions(model):
        return list(model.named_parameters())
    sources = _sources(model)
    return checkpoint_map(model, sources).tensors(model, sources)


def reads_live_memory(model: nn.Module) -> bool:
    """Whether every tensor `checkpoint_tensors(model)` returns reads the live parameters' memory (plain
    names or learned views), so a list of them stays right while the parameters stay where they are;
    False where a checkpoint tensor is converted from live values, a copy, at every publish."""
    if not conversions(model):
        return True
    return all(b.stride is not None for b in checkpoint_map(model).boxes)
