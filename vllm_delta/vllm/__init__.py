"""vLLM glue: the general plugin (plugin.py), the load format "delta" (loader.py), the HTTP routes
(api.py, service.py), the native weight-transfer backend (backend.py) and what each worker holds
(replica.py, probe.py, worker.py). vLLM types appear only under this package. docs/VLLM.md explains it."""
