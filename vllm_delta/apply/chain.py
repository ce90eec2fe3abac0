"""Several versions in one update: a chain's changes merged by element before anything is planned.

A reader several versions behind stages the deltas after its version (or an anchor and its deltas)
as one update, so it catches up in one pause. Each element's final bits are what the last version
touching it says: deltas add their differences to the bits so far (the live bits, or an earlier
version's new bits), anchors replace everything with their values where they differ from the live
weights. The result is one sorted set of changed elements per element width, in global ids
(`DeviceLayout`): what the engine then plans like a single delta.

Backward (`undo=True`): a reader going back to an older version N on its chain undoes the deltas from
its version down to N+1, newest first. Every stored difference is d = new - old (mod 2^bits), so a
delta's inverse is the same file read with its differences subtracted (old = new - d): the same merge,
walked in reverse with negated differences. Only deltas coded as differences can be undone
(`check_undo`): an anchor, or a codec that stores new values (raw), does not say what it replaced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import codec as codecs
from ..bits import int_view, wrap_add, wrap_sub
from ..errors import NotSuccessorError
from ..format import VersionHeader, VersionLike
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


def check_undo(files: list[VersionLike], target: VersionHeader) -> None:
    """That `files` can be undone down to `target`: deltas, newest first, each on the next one (the last on
    `target`), each coded as differences. NotSuccessorError (409) saying why not; nothing is read."""
    if not files:
        raise NotSuccessorError("nothing to undo", version=target.version)
    below = [vf.header.version for vf in files[1:]] + [target.version]
    for vf, base in zip(files, below):
        h = vf.header
        if h.kind != "delta":
            raise NotSuccessorError(
                f"version {h.version} is an anchor: it holds weights, not differences, so it cannot be undone",
                version=target.version,
            )
        if not codecs.get_codec(h.codec or "", {"version": h.version}).needs_base:
            raise NotSuccessorError(
                f"version {h.version} is coded with {h.codec!r}, which stores new values, not differences: "
                "it cannot be undone",
                version=target.version,
            )
        if h.base != base:
            raise NotSuccessorError(
                f"version {h.version} is a delta on version {h.base}, not on {base}: the versions to undo "
                "are not one chain down to the target",
                version=target.version,
            )


def step_bits(base: torch.Tensor, diffs: torch.Tensor, width: int, undo: bool) -> torch.Tensor:
    """The bits after one delta's differences: added (forward), or subtracted (undoing it)."""
    return wrap_sub(base, diffs, width) if undo else wrap_add(base, diffs, width)


def merge_chain(
    files: list[VersionLike],
    layout: DeviceLayout,
    decoder: Decoder,
    live: LiveBits,
    read_target: ReadTarget,
    timings: dict[str, float],
    changed: set[int],
    undo: bool = False,
) -> Pending:
    """The final bits of every element the chain changes, by element width. `changed` collects the
    indices of the HF tensors the chain touches (their checksum partials are reported). With `undo`,
    `files` are deltas undone newest first (`check_undo`): each one's differences are subtracted."""
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
                    new = step_bits(base, chunk.diffs, width, undo)
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
