"""Code that runs in vLLM's worker processes (one per rank): the load format, the replica and its
worker methods, the layout probe, vLLM's sparse path, the weight-transfer backend."""
