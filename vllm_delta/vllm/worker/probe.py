"""Learn where each Hugging Face tensor lands in this worker's parameters, from the model's own loaders.

vLLM's weight loaders end in `narrow(...).copy_(narrow(...))`: an affine map from checkpoint
coordinates to a strided region of one local parameter (fused qkv_proj / gate_up_proj, tensor-parallel
shards, vocab padding). `probe_layout` feeds each HF name to `model.load_weights` as a *meta* tensor
of the checkpoint's shape, with `torch.Tensor.copy_` replaced by a recorder: the destination is a real
view of the live parameter, the source a meta view whose offset and strides encode the narrow. Each
recorded copy becomes a `Segment`. Nothing is written (meta sources are recorded, not copied).

`validate_layout` then checks the map against vLLM's own sparse path
(`load_checkpoint_weight_patches`): a random sparse patch goes in through vLLM, and the elements
that changed must be exactly those the layout predicts, with the patch's values; the previous
values are restored afterwards. Tensors the probe can't express as segments, or where the check
disagrees, are returned as `fallback`: they are applied through `load_checkpoint_weight_patches`.

This module runs synchronously on the worker's main thread only: it swaps `torch.Tensor.copy_`
process-wide for the duration of one call, which must not overlap a forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...apply.layout import Layout, Segment, hf_2d
from ...bits import bit_view
from ...errors import ShapeMismatchError, UnsupportedModelError

log = logging.getLogger(__name__)


@dataclass
class CopyRecord:
    """One `dst.copy_(src)` a loader made for a probed HF tensor."""

    dst: torch.Tensor  # a view of a live parameter
    src_shape: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int  # element offset into the (contiguous) checkpoint tensor


@dataclass
class ProbeResult:
    layout: Layout  # mapped tensors have segments; fallback tensors are listed with none
    targets: dict[str, torch.Tensor]  # vLLM parameter name -> its live tensor (same storage)
    fallback: dict[str, str] = field(default_factory=dict)  # HF name -> why it can't be scattered
    writes: dict[str, list[str]] = field(default_factory=dict)  # HF name -> parameters its loader copies into


@contextmanager
def _recording_copies(records: list[CopyRecord]) -> Iterator[None]:
    original = torch.Tensor.copy_

    def record_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if isinstance(src, torch.Tensor) and src.is_meta and not dst.is_meta:
            records.append(CopyRecord(dst, tuple(src.shape), tuple(src.stride()), int(src.storage_offset())))
            return dst
        return original(dst, src, non_blocking)

    setattr(torch.Tensor, "copy_", record_copy)  # noqa: B010 - a deliberate, scoped monkeypatch
    try:
        yield
    finally:
        setattr(torch.Tensor, "copy_", original)  # noqa: B010


def check_supported(model: torch.nn.Module) -> None:
    """Refuse quantized models: their loaders and post-processing don't allow in-place bf16 updates."""
    quant = getattr(model, "quant_config", None)
    if quant is not None:
        raise UnsupportedModelError(f"quantized models can't take in-place bf16 deltas ({type(quant).__name__})")
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.element_size() not in (2, 4):
            raise UnsupportedModelError(f"parameter {name} has dtype {p.dtype}; only bf16/fp16/fp32 can be updated")
        if p.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
            raise UnsupportedModelError(f"parameter {name} is fp8")


def _collapse(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    """A view as (rows, cols, row stride, col stride): leading dims must merge into one."""
    if len(shape) == 0:
        return 1, 1, 1, 1
    if len(shape) == 1:
        return shape[0], 1, stride[0], 1
    for i in range(len(shape) - 2):
        if shape[i] != 1 and stride[i] != stride[i + 1] * shape[i + 1]:
            return None
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1], stride[-2], stride[-1]


def record_to_segment(
    hf_shape: tuple[int, ...], rec: CopyRecord, target: int, param: torch.Tensor, dtype: torch.dtype
) -> Segment | str:
    """The segment a recorded copy describes, or the reason it is not a plain strided box copy."""
    if tuple(rec.dst.shape) != rec.src_shape:
        return f"copy between shapes {tuple(rec.dst.shape)} and {rec.src_shape}"
    if rec.dst.dtype != dtype:
        return f"destination dtype {rec.dst.dtype} differs from the checkpoint's {dtype}"
    if not param.is_contiguous():
        return "destination parameter is not contiguous"
    R, C = hf_2d(hf_shape)
    dst_offset = int(rec.dst.storage_offset() - param.storage_offset())
    src = _collapse(rec.src_shape, rec.src_stride)
    dst = _collapse(tuple(rec.dst.shape), tuple(rec.dst.stride()))
    if src is None or dst is None:
        return "a view whose leading dimensions do not merge"
    rows, cols, s_row, s_col = src
    d_row, d_col = dst[2], dst[3]
    if len(rec.src_shape) == 1 and C > 1:
        # A 1-D piece of a 2-D checkpoint tensor: part of one row.
        rows, cols, s_row, s_col, d_row, d_col = 1, rec.src_shape[0], C, rec.src_stride[0], 0, rec.dst.stride()[0]
    if rows * cols == 0:
        return "empty copy"
    if (cols > 1 and s_col != 1) or (rows > 1 and s_row != C):
        return f"source view strides {rec.src_stride} are not a box of the checkpoint tensor"
    row0, col0 = divmod(rec.src_offset, C)
    if row0 + rows > R or col0 + cols > C:
        return "source view leaves the checkpoint tensor"
    last = dst_offset + (rows - 1) * d_row + (cols - 1) * d_col
    if dst_offset < 0 or last >= param.numel() or min(d_row, d_col) < 0:
        return "destination view leaves its parameter"
    return Segment(target, row0, rows, col0, cols, dst_offset, d_row if rows > 1 else cols * d_col, d_col)


def _param_index(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, list[tuple[str, torch.Tensor]]]]:
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in params.items():
        if p.numel():
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((name, p))
    return params, by_storage


def _owning_param(
    dst: torch.Tensor, by_storage, aliases: frozenset[str] = frozenset()
) -> tuple[str, torch.Tensor] | None:
    """The parameter a loader's copy wrote into. Where several share the storage (MLA's `W_UV` and
    `W_UK_T` are registered views of `kv_b_proj.weight`), the real one: not a known alias
    (derived.py), contiguous, the largest."""
    lo = dst.storage_offset()
    hits = [
        (name, p)
        for name, p in by_storage.get(dst.untyped_storage().data_ptr(), ())
        if p.storage_offset() <= lo < p.storage_offset() + p.numel()
    ]
    if not hits:
        return None
    return min(hits, key=lambda np_: (np_[0] in aliases, not np_[1].is_contiguous(), -np_[1].numel()))


@torch.no_grad()
def probe_layout(model: torch.nn.Module, hf_shapes: dict[str, tuple[int, ...]], dtype=torch.bfloat16) -> ProbeResult:
    """Map every HF tensor in `hf_shapes` onto this worker's parameters (see the module docstring).

    Every segment is marked `owner`; `assign_owners` fixes that up across tensor-parallel ranks.
    Raises UnsupportedModelError for a tensor the model does not load at all."""
    from ..postprocess.derived import report_of

    check_supported(model)
    _, by_storage = _param_index(model)
    report = report_of(model)
    aliases = frozenset(report.aliases) if report is not None else frozenset()
    target_names: list[str] = []
    targets: dict[str, torch.Tensor] = {}
    segments: dict[str, list[Segment]] = {}
    fallback: dict[str, str] = {}
    writes: dict[str, list[str]] = {}
    for name, shape in hf_shapes.items():
        records: list[CopyRecord] = []
        try:
            with _recording_copies(records):
                load_weights: Any = model.load_weights  # vLLM models define it; nn.Module does not
                loaded = load_weights([(name, torch.empty(tuple(shape), dtype=dtype, device="meta"))])
        except Exception as exc:  # noqa: BLE001 - any loader failure on a meta tensor means "not plain"
            fallback[name] = f"its loader failed on a probe tensor: {type(exc).__name__}: {exc}"
            continue
        if not records:
            if loaded is not None and not loaded:
                continue  # not on this rank (pipeline parallel): `finalize_layout` checks coverage
            fallback[name] = "its loader made no plain copy"
            continue
        segs: list[Segment] = []
        owners = [_owning_param(rec.dst, by_storage, aliases) for rec in records]
        writes[name] = list(dict.fromkeys(o[0] for o in owners if o is not None))
        for rec, owner in zip(records, owners):
            if owner is None:
                why: Segment | str = "its loader writes into something that is not a model parameter"
            else:
                pname, param = owner
                if pname not in targets:
                    targets[pname] = param.data
                    target_names.append(pname)
                why = record_to_segment(tuple(shape), rec, target_names.index(pname), param.data, dtype)
            if isinstance(why, str):
                fallback[name] = why
                break
            segs.append(why)
        else:
            segments[name] = _dedupe_owners(segs)
    layout = Layout(targets=target_names, hf_shapes={n: tuple(s) for n, s in hf_shapes.items()}, segments=segments)
    return ProbeResult(layout=layout, targets=targets, fallback=fallback, writes=writes)


def _dedupe_owners(segs: list[Segment]) -> list[Segment]:
    """Within one rank, an HF element copied to two places (untied copies) counts once."""
    out: list[Segment] = []
    for seg in segs:
        if any(_overlap(seg, o) for o in out if o.owner):
            seg = _replace(seg, owner=False)
        out.append(seg)
    return out


def _overlap(a: Segment, b: Segment) -> bool:
    return (
        a.row0 < b.row0 + b.rows and b.row0 < a.row0 + a.rows and a.col0 < b.col0 + b.cols and b.col0 < a.col0 + a.cols
    )


def _replace(seg: Segment, **changes) -> Segment:
    from dataclasses import replace

    return replace(seg, **changes)


Box = tuple[int, int, int, int]  # (row0, rows, col0, cols) in the HF tensor's 2-D view


def local_boxes(layout: Layout) -> dict[str, list[Box]]:
    """Per HF tensor, the boxes this rank holds (owners within the rank): what ranks exchange."""
    return {name: [(s.row0, s.rows, s.col0, s.cols) for s in segs if s.owner] for name, segs in layout.segments.items()}


def _box_overlap(a: Box, b: Box) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


def finalize_layout(
    result: ProbeResult, rank: int, gathered: list[tuple[dict[str, list[Box]], list[str]]]
) -> ProbeResult:
    """Combine what every tensor-parallel rank probed (`gathered[r]` = (local_boxes, fallback names)).

    - A tensor that falls back on any rank falls back on all (vLLM's sparse path runs on every rank).
    - The lowest rank holding an HF element owns it (counts it in checksums). Shards are disjoint
      boxes and replicas identical ones; a box partly overlapping a lower rank's is refused.
    - The owned boxes of all ranks must tile each mapped tensor exactly, else an update could never
      be verified: refused with the tensor's name."""
    fallback = dict(result.fallback)
    for _, names in gathered:
        for name in names:
            fallback.setdefault(name, "another rank could not map it")
    segments: dict[str, list[Segment]] = {}
    for name, shape in result.layout.hf_shapes.items():
        if name in fallback:
            continue
        owned: list[Box] = []  # distinct boxes, lowest rank first
        for r, (bx, _) in enumerate(gathered):
            for box in bx.get(name, ()):
                hits = [o for o in owned if _box_overlap(o, box)]
                if hits and any(o != box for o in hits):
                    raise UnsupportedModelError(
                        f"rank {r} holds box {box}, which partly overlaps {hits[0]}", tensor=name
                    )
                if not hits:
                    owned.append(box)
        rows, cols = hf_2d(shape)
        if sum(b[1] * b[3] for b in owned) != rows * cols:  # another model's shape: the version does not fit
            raise ShapeMismatchError(
                f"the workers' parameters hold {sum(b[1] * b[3] for b in owned)} of its {rows * cols} elements",
                tensor=name,
            )
        mine = []
        lower = [b for r in range(rank) for b in gathered[r][0].get(name, ())]
        for seg in result.layout.segments.get(name, ()):
            box = (seg.row0, seg.rows, seg.col0, seg.cols)
            mine.append(_replace(seg, owner=seg.owner and not any(_box_overlap(b, box) for b in lower)))
        segments[name] = mine
    layout = Layout(targets=result.layout.targets, hf_shapes=result.layout.hf_shapes, segments=segments)
    return ProbeResult(layout=layout, targets=result.targets, fallback=fallback, writes=result.writes)


@torch.no_grad()
def validate_layout(model: torch.nn.Module, result: ProbeResult, *, samples: int = 48, seed: int = 0) -> ProbeResult:
    """Check every mapped tensor against vLLM's `load_checkpoint_weight_patches` (see the module docstring).

    A random sparse patch (always including the first and last element) goes in through vLLM's
    sparse path; the elements that changed in the tensor's targets must be exactly the layout's
    translation of the patch's positions held by this rank, holding the patch's values. The targets
    are restored bit for bit afterwards. Disagreeing tensors move to `fallback`."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    layout = result.layout
    gen = torch.Generator().manual_seed(seed)
    fallback = dict(result.fallback)
    for name, segs in layout.segments.items():
        if name in fallback or not segs:
            continue
        shape = layout.hf_shapes[name]
        numel = 1
        for d in shape:
            numel *= d
        k = min(numel, samples)
        pos = torch.unique(torch.cat([torch.tensor([0, numel - 1]), torch.randint(0, numel, (k,), generator=gen)]))
        touched = sorted({s.target for s in segs})
        flats = {t: bit_view(result.targets[layout.targets[t]]).reshape(-1) for t in touched}
        before = {t: f.clone() for t, f in flats.items()}
        translated = layout.translate(name, pos)
        # New bit patterns: the current value (read through the first segment holding it) with some
        # low mantissa bits flipped, so every held position really changes and stays finite.
        cur = torch.zeros(pos.shape, dtype=torch.int64)
        held = torch.zeros(pos.shape, dtype=torch.bool)
        for seg, mask, dst in translated:
            fresh = mask & ~held
            cur[fresh] = flats[seg.target][dst[fresh[mask]]].to(torch.int64)
            held |= mask
        flip = torch.randint(1, 8, pos.shape, generator=gen)
        new_bits = (cur ^ flip).to(torch.int16)
        values = new_bits.view(torch.bfloat16)
        why = None
        try:
            load_checkpoint_weight_patches(
                model, [CheckpointWeightPatch(name, tuple(shape), torch.bfloat16, values, pos.to(torch.int64))]
            )
            why = _compare(flats, before, translated, new_bits)
        except Exception as exc:  # noqa: BLE001 - vLLM's sparse path refusing the tensor is a disagreement too
            why = f"vLLM's sparse patch path failed: {type(exc).__name__}: {exc}"
        finally:
            for t, f in flats.items():
                f.copy_(before[t])
        if why:
            log.warning("vllm-delta: %s goes through vLLM's sparse path: %s", name, why)
            fallback[name] = why
    segments = {n: s for n, s in layout.segments.items() if n not in fallback}
    out = Layout(targets=layout.targets, hf_shapes=layout.hf_shapes, segments=segments)
    return ProbeResult(layout=out, targets=result.targets, fallback=fallback, writes=result.writes)


def _compare(flats, before, translated, new_bits) -> str | None:
    expected: dict[int, dict[int, int]] = {t: {} for t in flats}
    for seg, mask, dst in translated:
        for off, bits in zip(dst.tolist(), new_bits[mask].tolist()):
            expected[seg.target][off] = bits
    for t, flat in flats.items():
        changed = (flat != before[t]).nonzero().reshape(-1).tolist()
        want = expected[t]
        if set(changed) != set(want):
            extra = sorted(set(changed) - set(want))[:3]
            missing = sorted(set(want) - set(changed))[:3]
            return f"target {t}: vLLM changed offsets the layout does not predict {extra}, missed {missing}"
        got = flat[torch.tensor(changed, dtype=torch.int64)].tolist() if changed else []
        bad = [o for o, g in zip(changed, got) if (g & 0xFFFF) != (want[o] & 0xFFFF)]
        if bad:
            return f"target {t}: values differ at offsets {bad[:3]}"
    return None
