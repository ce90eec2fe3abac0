"""Code that runs in vLLM's engine-core process: the reserved collective_rpc names (commits between two
engine steps, the weight-version label) and the prefix-cache taint check."""
