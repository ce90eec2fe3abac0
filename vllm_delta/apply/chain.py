"""Several versions in one update: a chain's changes merged by element before anything is planned.

A reader several versions behind stages the deltas after its version (or an anchor and its deltas)
as one update, so it catches up in one pause. Each element's final bits are what the last version
touching it says: deltas add their differences to the bits so far (the live bits, or an earlier
version's new bits), anchors replace everything with their values where they differ from the live
weights. The result is one sorted set of changed elements per element width, in global ids
(`DeviceLayout`): what the engine then plans like a single delta.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..bits import int_view, wrap_add
from ..format import VersionLike
from .layout import DeviceLayout, Selection
from .staging import Decoder, changed_items, item_indices

Pending = dict[int, tuple[torch.Tensor, torch.Tensor]]  # element width -> (sorted global ids, final bits)
LiveBits = Callable[[int, list[Selection], int], torch.Tensor]  # (width, selections, n) -> live bits
ReadTarget = Callable[[int, torch.Tensor], torch.Tensor]  # (target index, offsets) -> live bits


def merge(
    prev: tuple[torch.Tensor, torch.Tensor] | None, ids: torch.Tensor, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of pending changes (global ids, sorted); later values win."""
    if prev is not None and prev[0].numel():
        ids = torch.cat([prev[0], ids])
        new = torch.cat([prev[1], new])
    order = torch.sort(ids, stable=True).indices
    ids, new = ids[order], new[order]
    last = torch.ones_like(ids, dtype=torch.bool)
    last[:-1] = ids[1:] != ids[:-1]
    return ids[last], new[last]


def merge_chain(
    files: list[VersionLike],
    layout: DeviceLayout,
    decoder: Decoder,
    live: LiveBits,
    read_target: ReadTarget,
    timings: dict[str, float],
    changed: set[int],
) -> Pending:
    """The final bits of every element the chain changes, by element width. `changed` collects the
    indices of the HF tensors the chain touches (their checksum partials are reported)."""
    pending: Pending = {}
    for vf in files:
        if vf.header.kind == "anchor":
            pending = _anchor_changes(vf, layout, read_target, changed)
            continue
        for width, items in changed_items(vf, layout).items():
            changed.update(item_indices(items))
            ids, news = [], []
            prev = pending.get(width)
            for chunk in decoder.decode(vf.version, vf.header.codec or "", items, width, timings):
                g = layout.starts_t[chunk.t_idx] + chunk.p
                if chunk.values is not None:
                    new = chunk.values
                else:
                    base = live(width, layout.translate(chunk.t_idx, chunk.p, chunk.tensors), chunk.p.numel())
                    if prev is not None and prev[0].numel():
                        i = torch.searchsorted(prev[0], g).clamp_(max=prev[0].numel() - 1)
                        base = torch.where(prev[0][i] == g, prev[1][i], base)
                    assert chunk.diffs is not None
                    new = wrap_add(base, chunk.diffs, width)
                ids.append(g)
                news.append(new)
            if ids:
                pending[width] = merge(prev, torch.cat(ids), torch.cat(news))
    return pending


def _anchor_changes(vf: VersionLike, layout: DeviceLayout, read_target: ReadTarget, changed: set[int]) -> Pending:
    """Elements whose anchor bits differ from the live bits, in global ids, by width."""
    parts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for name in vf.header.tensors:
        segs = layout.layout.segments.get(name, ())
        if not segs:
            continue
        t = layout.index[name]
        changed.add(t)
        dense = int_view(vf.dense(name)).reshape(-1)
        ids, values = parts.setdefault(dense.element_size(), ([], []))
        for seg in segs:
            for pos, dst in layout.layout.segment_blocks(name, seg, layout.device):
                current = read_target(seg.target, dst)
                new = dense[pos.cpu()].to(layout.device)
                diff = new != current
                if bool(diff.any()):
                    ids.append(pos[diff] + layout.starts[t])
                    values.append(new[diff])
    return {width: merge(None, torch.cat(ids), torch.cat(values)) for width, (ids, values) in parts.items() if ids}
