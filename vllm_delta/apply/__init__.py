"""Inference side: where Hugging Face tensors land (layout), staging, the fused in-place scatter."""
