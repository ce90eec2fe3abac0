"""Code that runs in vLLM's API server process: the HTTP routes, the update service, follow mode,
weight-version spans on completions, metrics."""
