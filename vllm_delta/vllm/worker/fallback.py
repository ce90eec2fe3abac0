"""Tensors the layout probe can't map: applied through vLLM's own `load_checkpoint_weight_patches`.

That path is correct for every loader vLLM supports (it runs the model's own `load_weights` with a
NaN-masked full tensor), but it can't read current values back in checkpoint coordinates, and the
compact codec stores differences to them. So each fallback tensor keeps a host *shadow*: its
current Hugging Face image, taken from the version the server was loaded at. New values, checksum
partials and the rollback image all come from the shadow. Every rank holds the same shadows and
applies the same patches (vLLM's loaders pick the rank's shard); rank 0 alone counts them in
checksums, so the sums over ranks stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import codec as codecs
from ...bits import int_view
from ...checksums import MASK64, positional_sum, tensor_sum
from ...errors import ShapeMismatchError, UnsupportedModelError
from ...format import VersionLike


@dataclass
class FallbackStage:
    """New images of the fallback tensors an update changes (positions, new bits, old bits)."""

    changes: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    partials: dict[str, int] = field(default_factory=dict)
    decoded: int = 0  # changed elements decoded (every piece of the fallback tensors, whole)

    @property
    def nnz(self) -> int:
        return sum(int(c[0].numel()) for c in self.changes.values())


class FallbackApplier:
    def __init__(self, model: torch.nn.Module, reasons: dict[str, str], *, counts: bool):
        self.model = model
        self.reasons = dict(reasons)  # HF name -> why the probe could not map it
        self.shadows: dict[str, torch.Tensor] = {}  # HF name -> current image (host, checkpoint dtype)
        self.counts = counts  # this rank adds the fallback tensors to checksums (rank 0)

    @property
    def names(self) -> list[str]:
        return list(self.reasons)

    def set_shadow(self, name: str, image: torch.Tensor) -> None:
        self.shadows[name] = image.detach().to("cpu").clone()

    def live_sums(self) -> dict[str, int]:
        if not self.counts:
            return {n: 0 for n in self.reasons}
        return {n: tensor_sum(self.shadows[n]) if n in self.shadows else 0 for n in self.reasons}

    def stage(self, files: list[VersionLike], *, undo: bool = False) -> FallbackStage:
        """The fallback tensors after `files` (in order), or with `undo` before them (deltas undone newest
        first: their differences subtracted, as apply/chain.py does for the rest)."""
        out = FallbackStage()
        for name in self.reasons:
            image, decoded = self._image(name, files, undo)
            out.decoded += decoded
            if image is None:
                continue
            old = int_view(self.shadows[name]).reshape(-1)
            new = int_view(image).reshape(-1)
            pos = (new != old).nonzero().reshape(-1)
            if not pos.numel():
                continue
            out.changes[name] = (pos, new[pos].clone(), old[pos].clone())
            out.partials[name] = (
                (positional_sum(new[pos], pos) - positional_sum(old[pos], pos)) & MASK64 if self.counts else 0
            )
        return out

    def _image(self, name: str, files: list[VersionLike], undo: bool) -> tuple[torch.Tensor | None, int]:
        """(the tensor after `files` (in order; `undo`: before them), or None if they leave it unchanged;
        changed elements decoded)."""
        image, decoded = None, 0
        for vf in files:
            h = vf.header
            e = h.tensors.get(name)
            if e is None or (h.kind == "delta" and not e.nnz):
                continue
            if name not in self.shadows:
                # Without the current image there is neither a base for compact values nor a rollback image.
                raise UnsupportedModelError(
                    f"this tensor goes through vLLM's sparse path ({self.reasons[name]}), which needs its "
                    "current values: start the server with --load-format delta",
                    version=h.version,
                    tensor=name,
                )
            shadow = self.shadows[name]
            if e.torch_dtype != shadow.dtype or list(e.shape) != list(shadow.shape):
                raise ShapeMismatchError(
                    f"{e.dtype}{list(e.shape)} does not match the served {shadow.dtype}{list(shadow.shape)}",
                    version=h.version,
                    tensor=name,
                )
            if h.kind == "anchor":
                image = vf.dense(name).clone()
                continue
            if image is None:
                image = self.shadows[name].clone()
            ctx = {"version": h.version, "tensor": name}
            flat = int_view(image).reshape(-1)
            for piece in vf.pieces(name):  # one per part that changed the tensor
                changes = codecs.decode(
                    h.codec or "", piece.payload, piece.enc, numel=e.numel, nnz=piece.nnz, dtype=e.torch_dtype, ctx=ctx
                )
                codecs.check_piece(changes.positions, piece.start, piece.stop, ctx)
                at = flat[changes.positions]
                flat[changes.positions] = changes.old_bits(at) if undo else changes.new_bits(at)
                decoded += piece.nnz
        return image, decoded

    def patch(self, staged: FallbackStage) -> None:
        self._patch(staged, new=True)

    def rollback(self, staged: FallbackStage) -> None:
        self._patch(staged, new=False)

    @torch.no_grad()
    def _patch(self, staged: FallbackStage, *, new: bool) -> None:
        if not staged.changes:
            return
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        patches = []
        for name, (pos, new_bits, old_bits) in staged.changes.items():
            shadow = self.shadows[name]
            bits = new_bits if new else old_bits
            values = bits.view(shadow.dtype)
            patches.append(CheckpointWeightPatch(name, tuple(shadow.shape), shadow.dtype, values, pos))
        load_checkpoint_weight_patches(self.model, patches)
        for name, (pos, new_bits, old_bits) in staged.changes.items():
            int_view(self.shadows[name]).reshape(-1)[pos] = new_bits if new else old_bits
