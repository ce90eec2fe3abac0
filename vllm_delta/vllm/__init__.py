"""vLLM glue, laid out by the process each module runs in (docs/VLLM.md, "Where the code lives").

    plugin.py      every vLLM process: the general plugin's entry point (registers what follows)
    shared/        imported by all three: typed messages and their codec, the RPC declarations, the
                   two-phase update, the server's options, the successor rule
    api_server/    the API server process: HTTP routes (the endpoint plugin), the update service,
                   follow mode, weight-version spans on completions, metrics
    engine_core/   the engine-core process: reserved collective_rpc names (writes, labels)
    worker/        the worker processes: the load format, the replica and its RPC methods, the layout
                   probe, vLLM's sparse path, the weight-transfer backend
    postprocess/   vLLM's post-processing observed, and the handlers that keep such models correct

vLLM types appear only under this package."""
