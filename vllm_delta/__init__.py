"""vllm-delta: publish sparse bf16 weight deltas, apply them in place inside vLLM."""

__version__ = "0.1.0"
