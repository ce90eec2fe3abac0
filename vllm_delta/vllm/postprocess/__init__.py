"""What vLLM's post-processing did to the loaded weights, and the handlers that keep such models correct
under in-place updates (derived tensors, plain-kept layers)."""
