"""Code that runs in vLLM's engine-core process: the reserved collective_rpc names (writes between two
engine steps, the weight-version label) and the prefix-cache taint check."""
