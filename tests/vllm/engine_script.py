"""In-process vLLM engines for the tests (run in a fresh process by vllm_helpers.run_engine_script).

Tasks (JSON argument):
  fresh     an engine started with --load-format delta at each version: greedy outputs, live checksum
  fallback  tensors forced through vLLM's sparse path: updates, rollback, the "vllm" commit method
  refuse    an engine whose store is corrupt must refuse to start
  plain     an engine loaded from a plain HF checkpoint (store from VLLM_DELTA_STORE): vLLM's native
            weight-transfer API (LLM.update_weights) with the "delta" backend
  walk      one engine through a list of versions (worker RPCs), then fresh engines: outputs, checksums
  plain_checkpoint  an engine loaded from a plain HF directory: outputs, then the layout probe
  mla       an MLA model: its derived W_UV / W_UK_T after in-place updates
Prints one line "VLLM_DELTA_RESULT <json>".

`engine_script.py --serve` is the engine host the tests use: it imports vLLM once, then reads one
request per line on stdin ({"args": <task>, "env": {...}}) and runs each in a process forked for it
(with `env` added to its environment): a fresh process per task, as `python engine_script.py <task>`
would give, without paying vLLM's and torch's import each time. It prints "VLLM_DELTA_CHILD <pid>"
when it forks, then the child's "VLLM_DELTA_RESULT <json>" line (or "VLLM_DELTA_FAILED <json>").
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine runs in this process: fast start
os.environ.update(IN_PROCESS)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MAX_TOKENS = 16


def make_llm(model: str, store: str, version, **extra):
    from vllm import LLM

    return LLM(
        model=model,
        load_format="delta",
        model_loader_extra_config={"delta_store": store, "delta_version": version, **extra},
        enforce_eager=True,
        max_model_len=256,
        gpu_memory_utilization=0.1,
        dtype="bfloat16",
        seed=0,
    )


def greedy(llm, prompts) -> list[str]:
    from vllm import SamplingParams

    outs = llm.generate(list(prompts), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def live_checksum(llm) -> str:
    from vllm_delta.checksums import MASK64, combine, to_hex

    total: dict[str, int] = {}
    for part in llm.collective_rpc("delta_live_sums"):
        assert "error" not in part, part
        for name, s in part["sums"].items():
            total[name] = (total.get(name, 0) + int(s, 16)) & MASK64
    return to_hex(combine(total.items()))


def segments_of(llm) -> dict:
    """The probed layout of a few tensors: (target parameter, row0, rows, dst_offset) per segment."""

    def read(worker):
        replica = worker.get_model()._vllm_delta_replica
        layout = replica.probe.layout
        out = {}
        for name, segs in layout.segments.items():
            if ".layers.0." in name or "embed" in name or "lm_head" in name:
                out[name] = [[layout.targets[s.target], s.row0, s.rows, s.dst_offset, s.owner] for s in segs]
        return {"segments": out, "fallback": sorted(replica.probe.fallback)}

    return llm.collective_rpc(read)[0]


def stage_commit(llm, store: dict, ticket: str, versions: list[int], method: str = "delta") -> dict:
    r = llm.collective_rpc(
        "delta_stage_start", kwargs=dict(ticket=ticket, store=store, versions=versions, method=method)
    )
    assert "error" not in r[0], r
    deadline = time.monotonic() + 120
    while True:
        p = llm.collective_rpc("delta_stage_poll", kwargs=dict(ticket=ticket))[0]
        if "error" in p:
            return p
        if p["done"]:
            break
        assert time.monotonic() < deadline, "staging did not finish"
        time.sleep(0.01)
    return llm.collective_rpc("delta_patch", kwargs=dict(ticket=ticket, method=method))[0]


def task_fresh(args: dict) -> dict:
    out = {}
    for v in args["versions"]:
        llm = make_llm(args["model"], args["store"], v)
        out[str(v)] = {"outputs": greedy(llm, args["prompts"]), "checksum": live_checksum(llm), **segments_of(llm)}
        del llm
        gc.collect()
    return out


def task_fallback(args: dict) -> dict:
    """Start at args.start with args.fallback forced through vLLM's sparse path, then apply updates."""
    llm = make_llm(args["model"], args["store"], args["start"], delta_fallback=args["fallback"])
    store = {"uri": args["store"], "storage_options": {}, "cache_dir": args["cache_dir"]}
    res = {"start": live_checksum(llm), "layout": segments_of(llm), "steps": []}
    for i, (versions, method) in enumerate(args["updates"]):
        commit = stage_commit(llm, store, f"t{i}", versions, method)
        step = {"versions": versions, "method": method, "commit": commit, "checksum": live_checksum(llm)}
        if i == len(args["updates"]) - 1:
            # Undo the last update as a failing peer rank would make us do.
            step["rollback"] = llm.collective_rpc("delta_rollback", kwargs=dict(ticket=f"t{i}"))[0]
            step["after_rollback"] = live_checksum(llm)
            step["status"] = llm.collective_rpc("delta_status")[0]
        llm.collective_rpc("delta_release", kwargs=dict(ticket=f"t{i}"))
        res["steps"].append(step)
    res["outputs"] = greedy(llm, args["prompts"])
    return res


def task_walk(args: dict) -> dict:
    """One engine started at args.start walks through args.updates (one version per update, through the
    worker RPCs); then fresh engines at args.fresh versions. Outputs, live checksums, coverage."""
    llm = make_llm(args["model"], args["store"], args["start"])
    store = {"uri": args["store"], "storage_options": {}, "cache_dir": args["cache_dir"]}
    status = llm.collective_rpc("delta_status")[0]
    res = {
        "start": {"checksum": live_checksum(llm), "outputs": greedy(llm, args["prompts"])},
        "coverage": status["coverage"],
        "layout": segments_of(llm),
        "steps": [],
    }
    for i, version in enumerate(args["updates"]):
        commit = stage_commit(llm, store, f"w{i}", [version])
        llm.collective_rpc("delta_release", kwargs=dict(ticket=f"w{i}"))
        step = {"version": version, "commit": commit, "checksum": live_checksum(llm)}
        step["outputs"] = greedy(llm, args["prompts"])
        res["steps"].append(step)
    del llm
    gc.collect()
    res["fresh"] = task_fresh({**args, "versions": args["fresh"]})
    return res


def mla_views(worker) -> list[dict]:
    """Per MLA layer: are W_UV / W_UK_T views of kv_b_proj.weight, equal to what they are derived from?"""
    import torch

    out = []
    for name, module in worker.get_model().named_modules():
        if not hasattr(module, "W_UV") or not hasattr(module, "W_UK_T"):
            continue
        layer = name.split(".self_attn.")[0]
        kv_b = worker.get_model().get_submodule(layer + ".self_attn.kv_b_proj").weight
        heads, rank, v_dim = module.W_UV.shape
        nope = module.W_UK_T.shape[1]
        # vLLM's split_kv_b_proj: kv_b.T viewed (rank, heads, nope + v), split, transposed / permuted.
        kv = kv_b.T.reshape(rank, heads, nope + v_dim)
        w_uk, w_uv = kv.split([nope, v_dim], dim=-1)
        out.append(
            {
                "layer": layer,
                "alias": module.W_UV.untyped_storage().data_ptr() == kv_b.untyped_storage().data_ptr(),
                "W_UV": bool(torch.equal(module.W_UV, w_uv.transpose(0, 1))),
                "W_UK_T": bool(torch.equal(module.W_UK_T, w_uk.permute(1, 2, 0))),
                "W_UV_sum": float(module.W_UV.float().sum()),
            }
        )
    return out


def task_mla(args: dict) -> dict:
    """An MLA model started at args.start; its derived W_UV / W_UK_T must follow in-place updates."""
    llm = make_llm(args["model"], args["store"], args["start"])
    store = {"uri": args["store"], "storage_options": {}, "cache_dir": args["cache_dir"]}
    res = {
        "coverage": llm.collective_rpc("delta_status")[0]["coverage"],
        "start": live_checksum(llm),
        "views_before": llm.collective_rpc(mla_views)[0],
        "steps": [],
    }
    for i, version in enumerate(args["updates"]):
        commit = stage_commit(llm, store, f"m{i}", [version])
        step = {"version": version, "commit": commit, "checksum": live_checksum(llm)}
        step["views"] = llm.collective_rpc(mla_views)[0]
        res["steps"].append(step)
    res["outputs"] = greedy(llm, args["prompts"])
    return res


def task_plain_checkpoint(args: dict) -> dict:
    """An engine loaded from a plain HF directory (a materialized version): outputs, then the layout
    probe (`delta_probe`, as the first update or status would run it) and the live checksum."""
    from vllm import LLM

    os.environ["VLLM_DELTA_STORE"] = args["store"]
    llm = LLM(
        model=args["model"], enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.1, dtype="bfloat16", seed=0
    )
    res = {"outputs": greedy(llm, args["prompts"])}
    store = {"uri": args["store"], "storage_options": {}, "cache_dir": args["cache_dir"]}
    res["prepare"] = llm.collective_rpc("delta_probe", kwargs=dict(store=store, version=args["version"]))[0]
    if "error" not in res["prepare"]:
        res["checksum"] = live_checksum(llm)
        res["coverage"] = llm.collective_rpc("delta_status")[0]["coverage"]
    return res


def task_refuse(args: dict) -> dict:
    """One store, or several (`cases`: [{"store", "version", "extra"?}, ...]) tried one after another in this
    process (`extra`: more --model-loader-extra-config keys)."""
    cases = args.get("cases") or [{"store": args["store"], "version": args["version"]}]
    results = []
    for case in cases:
        try:
            make_llm(args["model"], case["store"], case["version"], **case.get("extra", {}))
        except Exception as exc:  # noqa: BLE001 - the point: what did start-up raise?
            results.append({"started": False, "error": f"{type(exc).__name__}: {exc}"})
        else:
            results.append({"started": True})
        gc.collect()
    return results[0] if "cases" not in args else {"cases": results}


def task_plain(args: dict) -> dict:
    import shutil

    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from vllm_delta.reconstruct import materialize
    from vllm_delta.store import DeltaStore

    ckpt = materialize(DeltaStore(args["store"]), args["start"], args["out"], progress=False)
    for name in os.listdir(args["model"]):  # config and tokenizer as the run wrote them
        shutil.copy(os.path.join(args["model"], name), ckpt)
    os.environ["VLLM_DELTA_STORE"] = args["store"]
    llm = LLM(
        model=ckpt,
        enforce_eager=True,
        max_model_len=256,
        gpu_memory_utilization=0.1,
        dtype="bfloat16",
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="delta"),
    )
    res = {"status": llm.collective_rpc("delta_status")[0]}
    llm.init_weight_transfer_engine({"init_info": {}})
    steps = []
    for update_info in args["updates"]:
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": update_info})
            llm.finish_weight_update()
            error = None
        except Exception as exc:  # noqa: BLE001 - the test asserts on refusals too (vLLM ends the session itself)
            error = f"{type(exc).__name__}: {exc}"
        st = llm.collective_rpc("delta_status")[0]
        steps.append(
            {"update_info": update_info, "error": error, "version": st["version"], "checksum": live_checksum(llm)}
        )
    res["steps"] = steps
    res["outputs"] = greedy(llm, args["prompts"])
    return res


def run(request: dict) -> dict:
    tasks = {
        "fresh": task_fresh,
        "fallback": task_fallback,
        "refuse": task_refuse,
        "plain": task_plain,
        "walk": task_walk,
        "plain_checkpoint": task_plain_checkpoint,
        "mla": task_mla,
    }
    if request["task"] == "sequence":  # several tasks in one process
        return {"results": [tasks[sub["task"]](sub) for sub in request["tasks"]]}
    return tasks[request["task"]](request)


def serve() -> None:
    """The engine host (module docstring). vLLM is imported here, before any fork; nothing here starts
    an engine, loads the plugins or runs a torch operation, so each child starts them itself."""
    import traceback

    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import WeightTransferConfig  # noqa: F401

    print("VLLM_DELTA_READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.environ.clear()  # the environment the test gives this task, as a subprocess would get it
                os.environ.update(request["env"])
                os.environ.update(IN_PROCESS)
                print("VLLM_DELTA_RESULT " + json.dumps(run(request["args"])), flush=True)
            except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
                print("VLLM_DELTA_FAILED " + json.dumps(traceback.format_exc()), flush=True)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(f"VLLM_DELTA_CHILD {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"VLLM_DELTA_DONE {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print("VLLM_DELTA_RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
