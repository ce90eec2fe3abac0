#!/usr/bin/env python
"""The 1T plan, computed (issue 26 item 3): what a fleet of vLLM servers following one trainer through a
store costs per version, and the first limit it hits, from the per-element costs measured in
benchmarks/results/ and a model's shape and fleet.

Every number the model uses is an `Input` with a kind and a source:

  measured  read from a file in benchmarks/results/ (the file and the field are named)
  derived   a formula over measured numbers (least-squares lines through named runs, a code default)
  assumed   a deployment choice (yours to set: replicas, NICs, step time) or a published limit, with its source

It prints, per scenario (model x fleet x density x how ranks decode): bytes per version, store requests
per second (GETs and PUTs of the busiest store: polls, records, data files, the ledger), store egress,
staging memory per GPU and pinned host memory per host, time per phase from the end of a training step
to the version being live, and every limit as demand / capacity, the largest first. It writes a PNG
and a JSON (benchmarks/results/scale_model.{png,json}).

    .venv/bin/python benchmarks/scale_model.py                  # table, PNG, JSON
    .venv/bin/python benchmarks/scale_model.py --inputs         # every input: value, kind, source (markdown)
    .venv/bin/python benchmarks/scale_model.py --markdown       # the tables of docs/SCALE.md

No torch, no GPU: the package's defaults (poll intervals, anchor cadence) are read from its source with
`ast`, not imported. docs/SCALE.md explains the model and its caveats.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

Kind = Literal["measured", "derived", "assumed"]
Decode = Literal["whole", "share"]  # every rank decodes every chunk (today) / only its rows and experts (item 1)
Download = Literal["whole", "share"]  # each host downloads the whole version (today) / its ranks' chunks (not built)

GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class Input:
    """One number of the model and where it comes from. `files`: the benchmarks/results/ files it
    rests on (a measured input names at least one; a derived one names those its formula reads)."""

    name: str
    value: float
    unit: str
    kind: Kind
    source: str
    files: tuple[str, ...] = ()


# -- reading results and the package's defaults -----------------------------------------------------


def read_result(name: str, results: str = RESULTS) -> Any:
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def code_default(path: str, owner: str, name: str) -> float:
    """A default written in the package's source: `owner.name` where owner is a class (a field's default),
    a function or method as `Class.method` (a keyword's default), or "" (a module-level constant). Read
    with `ast`, so that the model needs neither torch nor the package importable."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    scope: list[ast.stmt] = tree.body
    parts = owner.split(".") if owner else []
    for part in parts:
        node = _named(scope, part)
        if isinstance(node, ast.FunctionDef):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + list(node.args.defaults)
            defaults += list(node.args.kw_defaults)
            for arg, default in zip(args, defaults):
                if arg.arg == name and default is not None:
                    return float(ast.literal_eval(default))
            raise KeyError(f"{path}: {owner} has no default for {name}")
        scope = node.body
    for n in scope:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name and n.value:
            return float(ast.literal_eval(_declared_default(n.value)))
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return float(ast.literal_eval(n.value))
    raise KeyError(f"{path}: no default {owner}.{name}")


def _declared_default(value: ast.expr) -> ast.expr:
    """A field's default: the value itself, or the default of a server option's declaration
    (`option(key, default, doc, check)`, vllm_delta/vllm/shared/option_fields.py)."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "option":
        return value.args[1]
    return value


def _named(scope: list[ast.stmt], name: str) -> ast.ClassDef | ast.FunctionDef:
    for n in scope:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name:
            return n
    raise KeyError(name)


def lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least-squares coefficients c with sum_j c_j x_ij ~ y_i (exact when the system is square)."""
    a, b = np.asarray(rows, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    return [float(v) for v in np.linalg.lstsq(a, b, rcond=None)[0]]


# -- model shapes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape, as its HF config states it: enough to count parameters, routed-expert
    parameters and checkpoint tensors (the per-tensor costs of publishing and staging scale with those).
    Attention: "gqa" (Qwen3: q/k/v/o + q_norm, k_norm) or "mla" (DeepSeek-V3 / Kimi-K2 latent attention)."""

    name: str
    source: str
    hidden: int
    layers: int
    vocab: int
    tied: bool
    attention: Literal["gqa", "mla"]
    heads: int
    kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate: int = 0  # a dense layer's MLP
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    moe_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # the first layers of an MoE that have a dense MLP instead (first_k_dense_replace)
    router_bias: bool = False  # e_score_correction_bias (DeepSeek-V3 / Kimi-K2)

    def _attention(self) -> tuple[int, int]:
        """(parameters, tensors) of one layer's attention."""
        h = self.hidden
        if self.attention == "gqa":
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            return h * q + 2 * h * kv + q * h + 2 * self.head_dim, 6
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        params = (
            h * self.q_lora_rank  # q_a_proj
            + self.q_lora_rank  # q_a_layernorm
            + self.q_lora_rank * self.heads * qk  # q_b_proj
            + h * (self.kv_lora_rank + self.qk_rope_head_dim)  # kv_a_proj_with_mqa
            + self.kv_lora_rank  # kv_a_layernorm
            + self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
            + self.heads * self.v_head_dim * h  # o_proj
        )
        return params, 7

    def _counts(self) -> tuple[int, int, int, int]:
        """(parameters, routed-expert parameters, tensors, routed-expert tensors)."""
        h = self.hidden
        attn_p, attn_t = self._attention()
        params, tensors = self.vocab * h + h, 2  # embed_tokens, norm
        if not self.tied:
            params, tensors = params + self.vocab * h, tensors + 1
        expert_p = expert_t = 0
        for layer in range(self.layers):
            params, tensors = params + attn_p + 2 * h, tensors + attn_t + 2  # attention, two norms
            if self.experts == 0 or layer < self.dense_layers:
                params, tensors = params + 3 * h * self.intermediate, tensors + 3
                continue
            e_p, e_t = self.experts * 3 * h * self.moe_intermediate, self.experts * 3
            expert_p, expert_t = expert_p + e_p, expert_t + e_t
            params, tensors = params + e_p + self.experts * h, tensors + e_t + 1  # experts, router
            if self.router_bias:
                params, tensors = params + self.experts, tensors + 1
            if self.shared_experts:
                params += 3 * h * self.moe_intermediate * self.shared_experts
                tensors += 3
        return params, expert_p, tensors, expert_t

    @property
    def params(self) -> int:
        return self._counts()[0]

    @property
    def expert_params(self) -> int:
        return self._counts()[1]

    @property
    def tensors(self) -> int:
        return self._counts()[2]

    @property
    def expert_tensors(self) -> int:
        return self._counts()[3]


_HF = "its config.json on the Hugging Face Hub"
QWEN3_8B = ModelShape(
    "Qwen3-8B", f"Qwen/Qwen3-8B, {_HF}; = vllm_delta/testing/apply_fixtures.py QWEN3['qwen3-8b']",
    hidden=4096, layers=36, vocab=151936, tied=False, attention="gqa", heads=32, kv_heads=8, head_dim=128,
    intermediate=12288,
)  # fmt: skip
QWEN3_30B_A3B = ModelShape(
    "Qwen3-30B-A3B", f"Qwen/Qwen3-30B-A3B, {_HF}; = apply_fixtures.py QWEN3_MOE['qwen3-30b-a3b']",
    hidden=2048, layers=48, vocab=151936, tied=False, attention="gqa", heads=32, kv_heads=4, head_dim=128,
    experts=128, moe_intermediate=768,
)  # fmt: skip
QWEN3_235B_A22B = ModelShape(
    "Qwen3-235B-A22B", f"Qwen/Qwen3-235B-A22B, {_HF}",
    hidden=4096, layers=94, vocab=151936, tied=False, attention="gqa", heads=64, kv_heads=4, head_dim=128,
    experts=128, moe_intermediate=1536,
)  # fmt: skip
KIMI_K2 = ModelShape(
    "Kimi-K2 (1T)", f"moonshotai/Kimi-K2-Instruct, {_HF} (DeepSeek-V3 architecture)",
    hidden=7168, layers=61, vocab=163840, tied=False, attention="mla", heads=64, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate=18432,
    experts=384, moe_intermediate=2048, shared_experts=1, dense_layers=1, router_bias=True,
)  # fmt: skip
MODELS = (QWEN3_8B, QWEN3_30B_A3B, QWEN3_235B_A22B, KIMI_K2)


# -- the fleet -------------------------------------------------------------------------------------

_OPTIONS = "vllm_delta/vllm/shared/options.py"
_MIRROR = "vllm_delta/mirror/options.py"
_POLLING = "vllm_delta/store/polling.py"
_PUBLISHER = "vllm_delta/trainer/publisher.py"


@dataclass(frozen=True)
class Fleet:
    """Where the model is served and trained: every field is an assumption of the deployment (yours to
    set), a published limit, or a default of the package; FLEET_SOURCES says which."""

    name: str
    replicas: int  # vLLM servers (one API server each, fronting tp x dp GPUs)
    tp: int
    step_s: float  # one version per optimizer step
    trainer_gpus: int  # publisher ranks: one part file each per version
    dp: int = 1  # data-parallel engines behind one API server
    ep: bool = False  # expert parallel: routed experts spread over tp x dp ranks (vLLM's EP), not sliced by tp
    gpus_per_host: int = 8
    regions: int = 1
    mirrors_per_region: int = 0  # 0: hosts read the trainer's store; n: n regional stores a region, each with a mirror
    host_nic_gbps: float = 100.0  # a host's link to object storage
    stream_gbps: float = 2.5  # one GET (or PUT) stream
    download_streams: int = 1  # today a version's files are fetched one after another, one stream each
    download: Download = "whole"
    hash_threads: int = 1  # today one thread hashes a whole file
    store_egress_gbps: float = 800.0  # what one store serves in all
    store_get_rps: float = 5500.0
    store_put_rps: float = 3500.0
    get_latency_ms: float = 30.0
    gpu_memory_utilization: float = 0.90
    pause_budget_ms: float = 50.0
    host_pinned_budget_gib: float = 256.0
    staging_share_budget: float = 0.10  # GPU time staging may take from generation, per step
    staleness_gate: bool = True  # the trainer reads the ledger once per publish (Publisher(max_staleness=...))
    poll_s: float = code_default(_OPTIONS, "FollowOptions", "poll_s")
    report_s: float = code_default(_OPTIONS, "FollowOptions", "report_s")
    mirror_poll_s: float = code_default(_MIRROR, "MirrorOptions", "poll_s")
    full_listing_s: float = code_default(_POLLING, "", "FULL_LISTING_S")
    anchor_every: float = code_default(_PUBLISHER, "Publisher.__init__", "anchor_every")

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.dp

    @property
    def ep_size(self) -> int:
        """Ranks a layer's routed experts are spread over."""
        return self.tp * self.dp if self.ep else self.tp

    @property
    def hosts(self) -> int:
        if self.gpus_per_replica >= self.gpus_per_host:
            return self.replicas * math.ceil(self.gpus_per_replica / self.gpus_per_host)
        return math.ceil(self.replicas / (self.gpus_per_host // self.gpus_per_replica))

    @property
    def ranks_per_host(self) -> int:
        return min(self.gpus_per_host, self.gpus_per_replica * self.replicas)

    @property
    def regional_stores(self) -> int:
        return self.regions * self.mirrors_per_region


_DEPLOY = "assumed: a deployment choice, set yours"
FLEET_SOURCES: dict[str, str] = {
    "replicas": _DEPLOY + " (issue 26 asks for 1,000 servers)",
    "tp": _DEPLOY,
    "dp": _DEPLOY,
    "ep": _DEPLOY,
    "step_s": _DEPLOY + " (seconds per optimizer step, so per version)",
    "trainer_gpus": _DEPLOY + " (Kimi-K2: 256, the trainer of Perplexity's 1T weight-transfer post, peers_2026-11b.md)",
    "gpus_per_host": _DEPLOY,
    "regions": _DEPLOY + " (Fireworks runs 3-4 clusters, peers_2026-11.md)",
    "mirrors_per_region": _DEPLOY + " (`vllm-delta mirror`, docs/DEPLOY.md)",
    "host_nic_gbps": _DEPLOY + " (a GPU host's front-end link to object storage)",
    "stream_gbps": "assumed: one HTTP stream to an object store; order of magnitude from Materialize's GCS note "
    "(one connection carried 300-400 MiB/s, dev.materialize.com mz_persist_client blob_read); measure yours",
    "download_streams": "the package today: DeltaStore downloads a version's files one after another, one "
    "fsspec get_file each (vllm_delta/store/delta_store.py)",
    "download": "the package today: a host downloads every file of a version (ranged GETs by chunk: not built)",
    "hash_threads": "the package today: vllm_delta/store/cache.py file_sha256 hashes a file on one thread",
    "store_egress_gbps": "assumed: AWS publishes no per-bucket bandwidth limit; a private store's is its "
    "cluster's; set yours",
    "store_get_rps": "published: S3, at least 5,500 GET/HEAD per second per partitioned prefix "
    "(docs.aws.amazon.com AmazonS3 optimizing-performance); more partitions come with sustained load",
    "store_put_rps": "published: S3, at least 3,500 PUT/COPY/POST/DELETE per second per partitioned prefix (same page)",
    "get_latency_ms": "assumed: first byte from a remote store (measured on rclone at 127.0.0.1: see "
    "input get_latency_local_ms); no published S3 figure found",
    "gpu_memory_utilization": "vLLM's default --gpu-memory-utilization; staging lives in what vLLM leaves",
    "pause_budget_ms": "assumed: an in-flight update's engine stall worth one ordinary decode step",
    "host_pinned_budget_gib": _DEPLOY + " (pinned host memory staging may take on a host)",
    "staging_share_budget": "assumed: staging runs beside generation on a side stream; more than this share "
    "of the step's GPU time visibly slows generation",
    "staleness_gate": _DEPLOY + " (Publisher(max_staleness=K) reads every replica's report once per publish)",
    "poll_s": f"package default: {_OPTIONS} FollowOptions.poll_s (delta_poll_s)",
    "report_s": f"package default: {_OPTIONS} FollowOptions.report_s (ledger heartbeat)",
    "mirror_poll_s": f"package default: {_MIRROR} MirrorOptions.poll_s",
    "full_listing_s": f"package default: {_POLLING} FULL_LISTING_S (one full listing per reader this often)",
    "anchor_every": f"package default: {_PUBLISHER} Publisher(anchor_every=...)",
}


# -- measured costs --------------------------------------------------------------------------------

APPLY = "apply_gpu_codec2_h200.json"  # staging by phase, memory, pause: qwen3-8b and 30b-a3b at 1% and 3%
PUBLISH_8B = "publish_gpu_codec3_h200.json"  # 8B, all 36 layers, chunked:gpu (final code of issue 17)
PUBLISH_MOE = "publish_gpu_moe12_codec2_h200.json"  # 30B-A3B, 12 of 48 layers, chunked:gpu
PAYLOAD = "payload_cpu.json"  # bytes per changed element on realistic AdamW deltas
POLL = "poll_latest_cpu.json"  # requests and latency of a poll on an S3 server (rclone, 127.0.0.1)
REGIONS = "regions_cpu.json"  # bytes a mirror and direct followers read per version
CARDS = "cards.json"
ROUND_TRIPS = "round_trips_cpu.json"  # whole-file hash passes per update on a host
SHA256 = "sha256_h200_host.json"  # the download cache's and the mirror's whole-file hash, one thread
STAGE_PHASES = ("read", "h2d", "inflate", "decode", "translate", "gather", "partials", "plan")
KEPT_PHASES = ("plan",)  # run over the kept (local) elements only; the others over every decoded element


def _summary(doc: Any, codec: str) -> dict[str, float]:
    return next(s for s in doc["runs"][0]["summary"] if s["codec"] == codec)


@dataclass(frozen=True)
class MeasuredCosts:
    """The per-element and per-tensor costs the benchmarks measured (GPU costs: one NVIDIA H200), each
    an Input. `load` reads them from benchmarks/results/; nothing here is typed in by hand."""

    bytes_a: Input  # bytes per changed element = a + b ln(1/density)
    bytes_b: Input
    agree_ms: Input  # the training thread: agree + detect + encode, per rank
    agree_ms_per_tensor: Input
    detect_ms_per_gparam: Input
    detect_ms_per_tensor: Input
    upload_ms_per_mb: Input  # the upload thread, besides the write itself
    upload_ms_per_tensor: Input
    commit_local_ms: Input
    open_ms: Input
    open_ms_per_tensor: Input
    stage_fixed_ms: dict[str, Input]
    stage_ns_per_elem: dict[str, Input]
    stage_rest_ms: Input  # staging outside the named phases: header entries into the pieces table
    stage_rest_ms_per_tensor: Input
    stage_rest_ns_per_elem: Input
    peak_fixed_gb: Input
    peak_bytes_per_kept: Input
    held_bytes_per_kept: Input
    pinned_per_file_byte: Input
    pause_ns_per_elem_1pct: Input
    pause_ns_per_elem_3pct: Input
    gets_per_poll: Input
    get_latency_local_ms: Input
    mirror_reads_per_version: Input
    direct_reads_per_follower: Input
    card_memory_gib: Input
    sha256_gb_per_s: Input
    sha256_passes: Input

    @classmethod
    def load(cls, results: str = RESULTS) -> MeasuredCosts:
        def measured(name: str, value: float, unit: str, file: str, what: str) -> Input:
            return Input(name, value, unit, "measured", f"{file}: {what}", (file,))

        def derived(name: str, value: float, unit: str, formula: str, *files: str) -> Input:
            return Input(name, value, unit, "derived", formula, files)

        payload = read_result(PAYLOAD, results)
        pts = [(r["density"], r["chunked"]) for r in payload["rows"]]
        a, b = lstsq([[1.0, math.log(1 / d)] for d, _ in pts], [y for _, y in pts])
        byte_src = (
            f"least-squares line B = a + b ln(1/density) through the {len(pts)} AdamW steps of {PAYLOAD} "
            f"(chunked codec, densities {min(d for d, _ in pts):.2%}-{max(d for d, _ in pts):.2%})"
        )

        # the trainer: two runs of chunked:gpu on one H200, 399 and 4,719 checkpoint tensors, ~8.1B params each
        pub8, pubm = read_result(PUBLISH_8B, results), read_result(PUBLISH_MOE, results)
        s8, sm = _summary(pub8, "chunked:gpu"), _summary(pubm, "chunked:gpu")
        t8, tm = QWEN3_8B.tensors, dataclasses.replace(QWEN3_30B_A3B, layers=12).tensors
        pubs = (PUBLISH_8B, PUBLISH_MOE)
        runs2 = f"the chunked:gpu runs of {PUBLISH_8B} (8B, {t8} tensors) and {PUBLISH_MOE} (30B-A3B 12 layers, {tm})"
        agree = lstsq([[1.0, t8], [1.0, tm]], [s8["pub_agree_ms"], sm["pub_agree_ms"]])
        detect_y = [s["pub_detect_ms"] + s["pub_prepare_ms"] + s["pub_sums_ms"] for s in (s8, sm)]
        detect = lstsq([[s8["params"] / GB, t8], [sm["params"] / GB, tm]], detect_y)
        upload_y = [s["upload_ms"] - s["up_write_ms"] for s in (s8, sm)]  # the write: modelled as the transfer
        upload = lstsq([[s8["bytes"] / 1e6, t8], [sm["bytes"] / 1e6, tm]], upload_y)
        opened = lstsq([[1.0, t8], [1.0, tm]], [s8["open_ms"], sm["open_ms"]])

        # the server: staging by phase, memory and pause, four runs on one H200
        rows = read_result(APPLY, results)["rows"]
        tensors_of = {"qwen3-8b": QWEN3_8B.tensors, "qwen3-30b-a3b": QWEN3_30B_A3B.tensors}
        nnz = [float(r["nnz"]) for r in rows]
        runs4 = f"the {len(rows)} runs of {APPLY} (qwen3-8b, qwen3-30b-a3b at 1%, 3%; chunked:gpu)"
        fixed, per = {}, {}
        for ph in STAGE_PHASES:
            c = lstsq([[1.0, n] for n in nnz], [r["stage_phases"][ph] for r in rows])
            over = "kept" if ph in KEPT_PHASES else "decoded"
            src = f"least-squares line ms = fixed + per x elements through {runs4}; scales with the {over} elements"
            fixed[ph] = derived(f"stage_{ph}_fixed_ms", c[0], "ms", src, APPLY)
            per[ph] = derived(f"stage_{ph}_ns_per_elem", c[1] * 1e6, "ns", src, APPLY)
        rest_y = [r["stage_ms"] - sum(r["stage_phases"][p] for p in STAGE_PHASES) for r in rows]
        rest = lstsq([[1.0, tensors_of[r["model"]], n] for r, n in zip(rows, nnz)], rest_y)
        rest_src = f"least-squares fit (stage total - named phases) = a + b x tensors + c x elements through {runs4}"
        mem = [r["stage_memory"] for r in rows]
        peak = lstsq([[1.0, n] for n in nnz], [m["device_peak_bytes"] for m in mem])
        peak_src = f"least-squares line device_peak_bytes = fixed + per x elements through {runs4}"

        def pause_at(density: float) -> float:
            at = [r for r in rows if abs(r["density"] - density) < 1e-9]
            return sum(r["pause_ms"] for r in at) / sum(r["nnz"] for r in at) * 1e6

        # the store
        poll = next(r for r in read_result(POLL, results)["rows"] if r["store"] == "s3" and r["code"] == "new")
        regions = read_result(REGIONS, results)

        def reads(topology: str) -> float:
            at = [r for r in regions["rows"] if r["topology"] == topology]
            return sum(r["data_bytes"] for r in at) / sum(r["bytes_version"] for r in at)

        card = read_result(CARDS, results)["cards"]["NVIDIA H200"]
        sha = read_result(SHA256, results)
        passes = read_result(ROUND_TRIPS, results)["sha256_passes_per_version"]
        return cls(
            bytes_a=derived("bytes_per_changed_a", a, "B", byte_src, PAYLOAD),
            bytes_b=derived("bytes_per_changed_b", b, "B per ln(1/density)", byte_src, PAYLOAD),
            agree_ms=derived("publish_agree_ms", agree[0], "ms", f"line through {runs2}: pub_agree_ms", *pubs),
            agree_ms_per_tensor=derived("publish_agree_ms_per_tensor", agree[1], "ms", "the same line", *pubs),
            detect_ms_per_gparam=derived(
                "publish_detect_ms_per_gparam",
                detect[0],
                "ms per 1e9 parameters of a rank",
                f"solved from {runs2}: pub_detect_ms + pub_prepare_ms + pub_sums_ms = x params + y tensors",
                *pubs,
            ),
            detect_ms_per_tensor=derived("publish_detect_ms_per_tensor", detect[1], "ms", "the same system", *pubs),
            upload_ms_per_mb=derived(
                "upload_ms_per_mb",
                upload[0],
                "ms per MB of a rank's file",
                f"solved from {runs2}: upload_ms - up_write_ms = x MB + y tensors (the nvCOMP pack, the header, "
                "the records; the write itself is modelled as the transfer)",
                *pubs,
            ),
            upload_ms_per_tensor=derived("upload_ms_per_tensor", upload[1], "ms", "the same system", *pubs),
            commit_local_ms=measured(
                "commit_local_ms", s8["up_commit_ms"], "ms", PUBLISH_8B, "up_commit_ms, chunked:gpu"
            ),
            open_ms=derived("open_ms", opened[0], "ms", f"line through {runs2}: open_ms", *pubs),
            open_ms_per_tensor=derived("open_ms_per_tensor", opened[1], "ms", "the same line", *pubs),
            stage_fixed_ms=fixed,
            stage_ns_per_elem=per,
            stage_rest_ms=derived("stage_rest_ms", rest[0], "ms", rest_src, APPLY),
            stage_rest_ms_per_tensor=derived("stage_rest_ms_per_tensor", rest[1], "ms", rest_src, APPLY),
            stage_rest_ns_per_elem=derived("stage_rest_ns_per_elem", rest[2] * 1e6, "ns", rest_src, APPLY),
            peak_fixed_gb=derived(
                "staging_peak_fixed_gb", peak[0] / GB, "GB", peak_src + " (decode temporaries: one nvCOMP run)", APPLY
            ),
            peak_bytes_per_kept=derived(
                "staging_peak_bytes_per_kept",
                peak[1],
                "B",
                peak_src + " (the kept changes' pieces and their concatenation at the end of staging)",
                APPLY,
            ),
            held_bytes_per_kept=measured(
                "staging_held_bytes_per_kept",
                sum(m["device_held_bytes"] for m in mem) / sum(nnz),
                "B",
                APPLY,
                "sum of stage_memory.device_held_bytes / sum of nnz",
            ),
            pinned_per_file_byte=measured(
                "pinned_host_per_file_byte",
                sum(m["host_bytes"] for m in mem) / sum(r["file_bytes"] for r in rows),
                "B",
                APPLY,
                "sum of stage_memory.host_bytes / sum of file_bytes (the compressed chunks a rank reads)",
            ),
            pause_ns_per_elem_1pct=measured(
                "pause_ns_per_elem_at_1pct", pause_at(0.01), "ns", APPLY, "pause_ms / nnz of the 1% rows"
            ),
            pause_ns_per_elem_3pct=measured(
                "pause_ns_per_elem_at_3pct", pause_at(0.03), "ns", APPLY, "pause_ms / nnz of the 3% rows"
            ),
            gets_per_poll=measured("gets_per_poll", poll["requests_per_poll"], "GET", POLL, "s3/new requests_per_poll"),
            get_latency_local_ms=measured(
                "get_latency_local_ms",
                poll["p50_ms"] / poll["requests_per_poll"],
                "ms",
                POLL,
                "s3/new p50_ms / requests_per_poll (rclone on 127.0.0.1: a floor, not a remote store)",
            ),
            mirror_reads_per_version=measured(
                "mirror_reads_per_version",
                reads("regional"),
                "x version bytes",
                REGIONS,
                "data bytes read from the trainer's store / version bytes, the regional rows (one mirror)",
            ),
            direct_reads_per_follower=measured(
                "direct_reads_per_follower",
                reads("direct") / regions["meta"]["followers"],
                "x version bytes",
                REGIONS,
                "the same, direct rows, / meta.followers (each follower on its own cache: one read each)",
            ),
            card_memory_gib=measured("card_memory_gib", card["memory_mib"] / 1024, "GiB", CARDS, "NVIDIA H200"),
            sha256_gb_per_s=measured(
                "sha256_gb_per_s", sha["gb_per_s"], "GB/s", SHA256, "gb_per_s (one thread of the H200 machine's CPU)"
            ),
            sha256_passes=measured(
                "sha256_passes_per_version",
                passes,
                "passes",
                ROUND_TRIPS,
                "the API process hashes its download, then the worker re-hashes the cached file",
            ),
        )

    def inputs(self) -> list[Input]:
        out: list[Input] = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out.extend(v.values() if isinstance(v, dict) else [v])
        return out

    def bytes_per_changed(self, density: float) -> float:
        return self.bytes_a.value + self.bytes_b.value * math.log(1 / density)

    def pause_ns_per_elem(self, density: float) -> float:
        """Per changed element, by density: measured at 1% and 3% (the same at 8B and 30B-A3B), linear in
        ln(density) between them and held flat outside (optimistic below 1%: sparser scatters are slower)."""
        lo, hi = self.pause_ns_per_elem_1pct.value, self.pause_ns_per_elem_3pct.value
        t = min(1.0, max(0.0, math.log(density / 0.01) / math.log(3)))
        return lo + t * (hi - lo)


# -- one scenario ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    model: ModelShape
    fleet: Fleet
    density: float
    decode: Decode

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.density:.0%} {self.fleet.name} decode={self.decode}"


FLEET_CHECK = "fleet check: "


@dataclass(frozen=True)
class Limit:
    name: str
    demand: float
    capacity: float
    unit: str

    @property
    def ratio(self) -> float:
        return self.demand / self.capacity if self.capacity > 0 else math.inf


@dataclass
class Plan:
    scenario: Scenario
    params: int
    tensors: int
    changed: float  # changed elements per version
    bytes_per_changed: float
    version_bytes: float
    anchor_bytes: float
    files: int  # data files per version (one part per trainer rank)
    hosts: int
    kept_per_rank: float
    decoded_per_rank: float
    weights_per_gpu_gb: float
    staging_peak_gb: float
    staging_held_gb: float
    pinned_per_host_gb: float
    requests: dict[str, dict[str, float]]  # per store kind: GET/s, PUT/s, egress Gbit/s, by source
    phases_ms: dict[str, float]
    limits: list[Limit] = field(default_factory=list)

    @property
    def live_s(self) -> float:
        """From the end of a training step to the version live on the last server."""
        return sum(self.phases_ms.values()) / 1e3

    @property
    def first_limit(self) -> Limit:
        """The update path's limit nearest to (or furthest past) its capacity."""
        return max((lim for lim in self.limits if not lim.name.startswith(FLEET_CHECK)), key=lambda lim: lim.ratio)

    @property
    def behind(self) -> float:
        """Versions in flight between the trainer and the last server (step end to live, in steps)."""
        return self.live_s / self.scenario.fleet.step_s

    def to_json(self) -> dict[str, Any]:
        s = self.scenario
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("scenario", "limits")}
        fleet = dataclasses.asdict(s.fleet)
        out["scenario"] = {"model": s.model.name, "fleet": fleet, "density": s.density, "decode": s.decode}
        out["limits"] = [{**dataclasses.asdict(lim), "ratio": lim.ratio} for lim in self.limits]
        out["live_s"] = self.live_s
        out["first_limit"] = self.first_limit.name
        return out


def _transfer_s(nbytes: float, gbps: float) -> float:
    return nbytes * 8 / (gbps * GB)


def plan(s: Scenario, c: MeasuredCosts) -> Plan:
    """Everything per version for one scenario. Changed elements are spread over tensors and ranks in
    proportion to their parameters (uniform density); GPU costs are the H200's."""
    m, f = s.model, s.fleet
    P, E, T, TE = m.params, m.expert_params, m.tensors, m.expert_tensors
    D = P - E  # attention, embeddings, norms, routers, dense and shared MLPs: sliced by tp
    changed = s.density * P
    kept = s.density * (D / f.tp + E / f.ep_size)
    decoded = changed if s.decode == "whole" else kept
    rank_tensors = (T - TE) + TE / f.ep_size if f.ep else T  # tensors a rank's layout holds any of
    bpe = c.bytes_per_changed(s.density)
    vbytes = changed * bpe
    abytes = 2.0 * P  # an anchor: every bf16 tensor in full
    files = f.trainer_gpus
    hosts = f.hosts
    host_share = 1.0 if f.download == "whole" else min(1.0, f.ranks_per_host * kept / changed)
    host_bytes = vbytes * host_share

    # stores: who reads which one
    mirrored = f.regional_stores > 0
    readers_hosts = hosts / f.regional_stores if mirrored else hosts
    readers_replicas = f.replicas / f.regional_stores if mirrored else f.replicas
    lat = f.get_latency_ms / 1e3

    # -- the trainer: training thread, then the upload of each rank's part
    w = f.trainer_gpus
    publish = (
        c.agree_ms.value
        + c.agree_ms_per_tensor.value * T
        + c.detect_ms_per_gparam.value * P / w / GB
        + c.detect_ms_per_tensor.value * T
    )
    rank_bytes = vbytes / w
    trainer_ranks_per_host = min(w, f.gpus_per_host)
    up_gbps = min(f.stream_gbps, f.host_nic_gbps / trainer_ranks_per_host, f.store_egress_gbps / w)
    upload = (
        c.upload_ms_per_mb.value * rank_bytes / 1e6
        + c.upload_ms_per_tensor.value * T
        + 1e3 * _transfer_s(rank_bytes, up_gbps)
        + c.commit_local_ms.value
        + 1e3 * 3 * lat  # the part's upload, the record, the head
    )

    # -- the mirror hop (one per regional store) and the servers' download
    stream = f.download_streams * f.stream_gbps
    sha = c.sha256_gb_per_s.value * GB * f.hash_threads  # bytes per second
    mirror = mirror_busy = 0.0
    if mirrored:
        in_gbps = min(f.host_nic_gbps, stream, f.store_egress_gbps / f.regional_stores)
        out_gbps = min(f.host_nic_gbps, stream)

        def copy_s(nbytes: float, nfiles: float) -> float:
            """A mirror's copy: download, verify (sha256), upload, file after file."""
            fetched = nbytes * c.mirror_reads_per_version.value
            return _transfer_s(fetched, in_gbps) + fetched / sha + _transfer_s(nbytes, out_gbps) + 2 * nfiles * lat

        mirror = 1e3 * (f.mirror_poll_s / 2 + copy_s(vbytes, files + 2))
        mirror_busy = copy_s(vbytes, files + 2) + copy_s(abytes, files + 2) / f.anchor_every  # per version
    down_gbps = min(f.host_nic_gbps, stream, f.store_egress_gbps / readers_hosts)
    download = 1e3 * (f.poll_s / 2 + (2 + files) * lat + _transfer_s(host_bytes, down_gbps))
    verify = 1e3 * c.sha256_passes.value * host_bytes / sha

    # -- staging on each rank, then the pause
    opened = c.open_ms.value + c.open_ms_per_tensor.value * T
    stage = {ph: c.stage_fixed_ms[ph].value for ph in STAGE_PHASES}
    for ph in STAGE_PHASES:
        stage[ph] += c.stage_ns_per_elem[ph].value * (kept if ph in KEPT_PHASES else decoded) / 1e6
    rest = c.stage_rest_ms.value + c.stage_rest_ms_per_tensor.value * rank_tensors
    rest += c.stage_rest_ns_per_elem.value * decoded / 1e6
    pause = c.pause_ns_per_elem(s.density) * kept / 1e6
    other = sum(v for ph, v in stage.items() if ph not in ("inflate", "decode")) + rest
    phases = {
        "publish": publish,
        "upload": upload,
        "mirror": mirror,
        "download": download,
        "verify": verify,
        "open": opened,
        "inflate": stage["inflate"],
        "decode": stage["decode"],
        "stage, rest": other,
        "pause": pause,
    }
    stage_ms = opened + stage["inflate"] + stage["decode"] + other

    # -- memory
    peak = c.peak_fixed_gb.value * GB + c.peak_bytes_per_kept.value * kept
    held = c.held_bytes_per_kept.value * kept
    rank_file = vbytes if s.decode == "whole" else vbytes * kept / changed
    pinned = f.ranks_per_host * c.pinned_per_file_byte.value * rank_file
    weights = 2.0 * (D / f.tp + E / f.ep_size)

    # -- requests per second and egress, per store
    step = f.step_s
    anchor_files_per_s = files / (f.anchor_every * step)
    region: dict[str, float] = {
        "polls": readers_replicas * c.gets_per_poll.value / f.poll_s,
        "full listings": readers_replicas * 2 / f.full_listing_s,
        "records": readers_replicas * 2 / step,
        "data files": readers_hosts * files / step,
    }
    region_put = {"ledger reports": readers_replicas * (1 / f.report_s + 1 / step)}
    region_egress = readers_hosts * host_bytes * 8 / step / GB
    if mirrored:
        region["mirror ledger reads"] = readers_replicas / f.mirror_poll_s
        n = f.regional_stores
        origin = {
            "mirror polls": n * c.gets_per_poll.value / f.mirror_poll_s,
            "mirror listings": n * 2 / f.full_listing_s,
            "mirror records": n * 2 / step,
            "mirror data files": n * files / step + n * anchor_files_per_s,
        }
        origin_put = {"forwarded reports": f.replicas * (1 / f.report_s + 1 / step)}
        origin_egress = n * (vbytes * c.mirror_reads_per_version.value + abytes / f.anchor_every) * 8 / step / GB
    else:
        origin, origin_put, origin_egress = dict(region), dict(region_put), region_egress
    if f.staleness_gate:
        origin["trainer ledger reads"] = f.replicas / step
    origin_put["trainer writes"] = (files + 2) / step + anchor_files_per_s
    requests = {"origin": {**_tagged(origin, "GET"), **_tagged(origin_put, "PUT"), "egress Gbit/s": origin_egress}}
    if mirrored:
        requests["regional"] = {**_tagged(region, "GET"), **_tagged(region_put, "PUT"), "egress Gbit/s": region_egress}

    p = Plan(
        scenario=s,
        params=P,
        tensors=T,
        changed=changed,
        bytes_per_changed=bpe,
        version_bytes=vbytes,
        anchor_bytes=abytes,
        files=files,
        hosts=hosts,
        kept_per_rank=kept,
        decoded_per_rank=decoded,
        weights_per_gpu_gb=weights / GB,
        staging_peak_gb=peak / GB,
        staging_held_gb=held / GB,
        pinned_per_host_gb=pinned / GB,
        requests=requests,
        phases_ms=phases,
    )
    hbm = c.card_memory_gib.value * GIB
    store_kinds = list(requests.items())
    busiest_get = max(store_kinds, key=lambda kv: _total(kv[1], "GET"))
    busiest_put = max(store_kinds, key=lambda kv: _total(kv[1], "PUT"))
    busiest_egress = max(store_kinds, key=lambda kv: kv[1]["egress Gbit/s"])
    anchor_rank = abytes / w / f.anchor_every  # a rank's share of an anchor, per version
    trainer_up = trainer_ranks_per_host * (rank_bytes + anchor_rank) * 8 / step / GB
    p.limits = [
        Limit(f"store egress ({busiest_egress[0]})", busiest_egress[1]["egress Gbit/s"], f.store_egress_gbps, "Gbit/s"),
        Limit(f"store GET rate ({busiest_get[0]})", _total(busiest_get[1], "GET"), f.store_get_rps, "GET/s"),
        Limit(f"store PUT rate ({busiest_put[0]})", _total(busiest_put[1], "PUT"), f.store_put_rps, "PUT/s"),
        Limit("server download + verify per version", (download - 500 * f.poll_s + verify) / 1e3, step, "s"),
        Limit("server host NIC", host_bytes * 8 / step / GB, f.host_nic_gbps, "Gbit/s"),
        Limit("trainer upload stream", (rank_bytes + anchor_rank) * 8 / step / GB, f.stream_gbps, "Gbit/s"),
        Limit("trainer host NIC", trainer_up, f.host_nic_gbps, "Gbit/s"),
        Limit("GPU memory for staging", peak / GB, (1 - f.gpu_memory_utilization) * hbm / GB, "GB"),
        Limit("pinned host memory", pinned / GIB, f.host_pinned_budget_gib, "GiB"),
        Limit("pause budget", pause, f.pause_budget_ms, "ms"),
        Limit("staging's share of GPU time", (stage_ms + pause) / 1e3 / step, f.staging_share_budget, "of a step"),
    ]
    if mirrored:
        p.limits.append(Limit("mirror busy per version (anchors amortized)", mirror_busy, step, "s"))
    # not a limit of the update path: whether the fleet's layout holds the model at all
    p.limits.append(Limit(FLEET_CHECK + "weights per GPU", weights / GB, f.gpu_memory_utilization * hbm / GB, "GB"))
    return p


def _tagged(d: dict[str, float], verb: str) -> dict[str, float]:
    return {f"{verb} {k}": v for k, v in d.items()}


def _total(d: dict[str, float], verb: str) -> float:
    return sum(v for k, v in d.items() if k.startswith(verb + " "))


def with_replicas(s: Scenario, n: int) -> Scenario:
    return dataclasses.replace(s, fleet=dataclasses.replace(s.fleet, replicas=n))


def max_replicas(s: Scenario, c: MeasuredCosts, limit: float = 1.0, top: int = 1 << 20) -> int:
    """The largest replica count whose plan stays within every limit (0 if even one replica exceeds one)."""

    def ok(n: int) -> bool:
        return plan(with_replicas(s, n), c).first_limit.ratio <= limit

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi < top and ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


# -- the scenarios of docs/SCALE.md ----------------------------------------------------------------

FLEETS = {
    "8B": Fleet("1000 x TP1", replicas=1000, tp=1, step_s=30, trainer_gpus=8),
    "30B": Fleet("1000 x TP2", replicas=1000, tp=2, step_s=60, trainer_gpus=16),
    "235B": Fleet("1000 x TP8 EP8, 2 regions", replicas=1000, tp=8, ep=True, step_s=120, trainer_gpus=64, regions=2,
                  mirrors_per_region=1),
    "1T": Fleet("1000 x TP8 DP4 EP32, 4 regions", replicas=1000, tp=8, dp=4, ep=True, step_s=180, trainer_gpus=256,
                regions=4, mirrors_per_region=1),
}  # fmt: skip


def scenarios() -> list[Scenario]:
    out: list[Scenario] = []
    for model, key, densities in (
        (QWEN3_8B, "8B", (0.01,)),
        (QWEN3_30B_A3B, "30B", (0.01,)),
        (QWEN3_235B_A22B, "235B", (0.01,)),
        (KIMI_K2, "1T", (0.01, 0.02)),
    ):
        for d in densities:
            for mode in ("whole", "share"):
                out.append(Scenario(model, FLEETS[key], d, mode))  # type: ignore[arg-type]
    return out


def what_ifs() -> list[Scenario]:
    """The 1T at 2%, each rank decoding its share, with the levers the plan names added one after another
    (none of them is built; first, the same fleet on one store without mirrors)."""
    base = FLEETS["1T"]
    steps = [
        ("one store, no mirrors", dict(regions=1, mirrors_per_region=0)),
        ("mirrors (the fleet above)", {}),
        ("+ 16 streams and 16 hash threads", dict(download_streams=16, hash_threads=16)),
        ("+ an anchor every 200 versions", dict(anchor_every=200)),
        ("+ hosts fetch only their ranks' chunks", dict(download="share")),
        ("+ 4 stores per region", dict(mirrors_per_region=4)),
    ]
    out, changes = [], {}
    for name, change in steps:
        if name.startswith("one store"):
            fleet = dataclasses.replace(base, name=name, **change)  # type: ignore[arg-type]
        else:
            changes.update(change)
            fleet = dataclasses.replace(base, name=name, **changes)  # type: ignore[arg-type]
        out.append(Scenario(KIMI_K2, fleet, 0.02, "share"))
    return out


# -- output ----------------------------------------------------------------------------------------


def fmt(v: float, digits: int = 3) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def headline(plans: Iterable[Plan], c: MeasuredCosts) -> list[list[str]]:
    rows = [
        [
            "model", "density", "fleet", "decode", "hosts", "version GB", "GET/s (busiest store)",
            "egress Gbit/s (busiest)", "staging peak GB/GPU", "inflate+decode s/rank", "pause ms", "step end -> live s",
            "steps behind", "first limit (demand / capacity)", "max replicas",
        ]
    ]  # fmt: skip
    for p in plans:
        s = p.scenario
        get = max(_total(v, "GET") for v in p.requests.values())
        egress = max(v["egress Gbit/s"] for v in p.requests.values())
        lim = p.first_limit
        rows.append(
            [
                s.model.name,
                f"{s.density:.0%}",
                s.fleet.name,
                s.decode,
                fmt(p.hosts),
                fmt(p.version_bytes / GB),
                fmt(get),
                fmt(egress),
                fmt(p.staging_peak_gb),
                fmt((p.phases_ms["inflate"] + p.phases_ms["decode"]) / 1e3),
                fmt(p.phases_ms["pause"]),
                fmt(p.live_s),
                fmt(p.behind, 2),
                f"{lim.name}: {fmt(lim.demand)} / {fmt(lim.capacity)} {lim.unit} ({lim.ratio:.0%})",
                _max_replicas_text(max_replicas(s, c)),
            ]
        )
    return rows


def _max_replicas_text(n: int) -> str:
    return "none: a per-version limit" if n == 0 else fmt(n)


def phase_rows(plans: Sequence[Plan]) -> list[list[str]]:
    names = list(plans[0].phases_ms)
    rows = [["model", "density", "decode", "fleet", *[f"{n} s" for n in names], "total s"]]
    for p in plans:
        s = p.scenario
        rows.append(
            [s.model.name, f"{s.density:.0%}", s.decode, s.fleet.name]
            + [fmt(p.phases_ms[n] / 1e3) for n in names]
            + [fmt(p.live_s)]
        )
    return rows


def limit_rows(p: Plan) -> list[list[str]]:
    rows = [["limit", "demand", "capacity", "unit", "demand / capacity"]]
    for lim in sorted(p.limits, key=lambda x: -x.ratio):
        rows.append([lim.name, fmt(lim.demand), fmt(lim.capacity), lim.unit, f"{lim.ratio:.1%}"])
    return rows


def request_rows(p: Plan) -> list[list[str]]:
    rows = [["store", "what", "per second"]]
    for store, d in p.requests.items():
        for k, v in d.items():
            rows.append([store, k, fmt(v)])
    return rows


def shape_rows(models: Sequence[ModelShape]) -> list[list[str]]:
    rows = [["model", "parameters", "routed-expert parameters", "checkpoint tensors", "shape from"]]
    for m in models:
        rows.append([m.name, f"{m.params / GB:.2f}B", f"{m.expert_params / GB:.2f}B", f"{m.tensors:,}", m.source])
    return rows


def input_rows(c: MeasuredCosts, fleets: dict[str, Fleet]) -> list[list[str]]:
    """Every input but the staging phases' lines (stage_rows), then the fleet's fields."""
    rows = [["input", "value", "unit", "kind", "source"]]
    for i in c.inputs():
        if not i.name.startswith("stage_"):
            rows.append([i.name, fmt(i.value, 4), i.unit, i.kind, i.source])
    for name, src in FLEET_SOURCES.items():
        values = {key: str(getattr(fl, name)) for key, fl in fleets.items()}
        shown = (
            next(iter(values.values()))
            if len(set(values.values())) == 1
            else ", ".join(f"{k}: {v}" for k, v in values.items())
        )
        kind = "derived" if src.startswith(("package default", "the package")) else "assumed"
        rows.append([f"fleet.{name}", shown, "", kind, src])
    return rows


def stage_rows(c: MeasuredCosts) -> list[list[str]]:
    rows = [["staging phase", "fixed ms", "ns per element", "over the elements", "kind, source"]]
    for ph in STAGE_PHASES:
        over = "kept" if ph in KEPT_PHASES else "decoded"
        rows.append([ph, fmt(c.stage_fixed_ms[ph].value, 3), fmt(c.stage_ns_per_elem[ph].value, 3), over, ""])
    rows.append(
        [
            "rest (per tensor: " + fmt(c.stage_rest_ms_per_tensor.value * 1e3, 3) + " us)",
            fmt(c.stage_rest_ms.value, 3),
            fmt(c.stage_rest_ns_per_elem.value, 3),
            "decoded",
            "",
        ]
    )
    rows[1][4] = f"derived: {c.stage_fixed_ms[STAGE_PHASES[0]].source}"
    rows[-1][4] = f"derived: {c.stage_rest_ms.source}"
    return rows


def markdown(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows)


# the peers' published numbers (shared/notes/peers_2026-11*.md), beside ours for the same model and density
PEERS: list[dict[str, Any]] = [
    {
        "system": "NeMo-RL sparse refit (S3)",
        "published": "247.2 GB model (bf16), 3% changed: 20.2 s end to end; generation paused until the global flush",
        "model": QWEN3_235B_A22B, "density": 0.03, "key": "235B",
        "source": "NVIDIA-NeMo/RL docs/design-docs/sparse-delta-refit.md (peers_2026-11.md §3)",
    },
    {
        "system": "verl delta_sharded (NCCL)",
        "published": "Qwen3-235B: 11.4-14.9 s per sync (full: 246-266 s); 30B-A3B: 7.1 s (full 32.2 s)",
        "model": QWEN3_235B_A22B, "density": 0.01, "key": "235B",
        "source": "verl-project/verl docs/advance/delta_weight_sync.md (peers_2026-11.md §3)",
    },
    {
        "system": "vLLM P2P (sharded_rdt, NIXL)",
        "published": "Qwen3-235B, 8xH100 -> 8xH100, dense: 3.2-3.3 s per sync",
        "model": QWEN3_235B_A22B, "density": 0.01, "key": "235B",
        "source": "vllm-project/vllm #43375 (peers_2026-11c.md §0, §1)",
    },
    {
        "system": "Fireworks (S3/GCS, arc_v2 XOR deltas)",
        "published": "1T FP8: 20.3 GiB average delta (1.98% of 1,024 GiB); 3-4 clusters; swap < 60 s (secondary)",
        "model": KIMI_K2, "density": 0.02, "key": "1T",
        "source": "fireworks.ai blog; docs.fireworks.ai rl-rollout-delta-checkpoints (peers_2026-11.md §3)",
    },
    {
        "system": "AReaL (AReaL-DTE deltas; Awex transfer)",
        "published": "DTE: no sync time published, 6 B per changed element before zstd; Awex 1T FP8: NCCL 20 s, "
        "RDMA 6 s (dense)",
        "model": KIMI_K2, "density": 0.02, "key": "1T",
        "source": "areal-project/AReaL-DTE README; inclusionAI/Awex README (peers_2026-11c.md §3a; 11b §1)",
    },
    {
        "system": "ModelExpress (S3 XOR delta)",
        "published": "none published",
        "model": KIMI_K2, "density": 0.02, "key": "1T",
        "source": "ai-dynamo/modelexpress docs/S3_DELTA_WEIGHT_REFIT.md (peers_2026-11.md §3)",
    },
]  # fmt: skip


def one_replica(fleet: Fleet) -> Fleet:
    """The same replica alone on its store (what most peers' numbers describe: one trainer, one engine group)."""
    return dataclasses.replace(fleet, name="1 replica", replicas=1, regions=1, mirrors_per_region=0)


def peer_rows(c: MeasuredCosts) -> list[list[str]]:
    rows = [["peer", "published", "ours, same model and density (computed here)", "source"]]
    for peer in PEERS:
        fleet, model, d = FLEETS[peer["key"]], peer["model"], peer["density"]
        alone = plan(Scenario(model, one_replica(fleet), d, "share"), c)
        fast = dataclasses.replace(one_replica(fleet), download_streams=16, hash_threads=16)
        alone_fast = plan(Scenario(model, fast, d, "share"), c)
        fleet_share = plan(Scenario(model, fleet, d, "share"), c)
        fleet_whole = plan(Scenario(model, fleet, d, "whole"), c)
        net = (alone.phases_ms["download"] + alone.phases_ms["verify"]) / 1e3
        head = f"{model.name} at {d:.0%}: {fmt(alone.version_bytes / GB)} GB a version"
        pause = f"pause {fmt(alone.phases_ms['pause'])} ms"
        one = f"One replica: live {fmt(alone.live_s)} s after the step ({fmt(net)} s of it download + verify"
        one += f" on one stream), {fmt(alone_fast.live_s)} s with 16 streams and hash threads"
        many = f"{fleet.replicas} replicas: {fmt(fleet_share.live_s)} s"
        many += f" ({fmt(fleet_whole.live_s)} s as ranks decode today)"
        ours = f"{head}, {pause}. {one}. {many}"
        rows.append([peer["system"], peer["published"], ours, peer["source"]])
    return rows


def kimi_2pct_share(plans: Sequence[Plan]) -> Plan:
    return next(
        p for p in plans if p.scenario.model is KIMI_K2 and p.scenario.decode == "share" and p.scenario.density == 0.02
    )


def plot(plans: Sequence[Plan], c: MeasuredCosts, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 7))
    names = list(plans[0].phases_ms)
    colors = plt.get_cmap("tab20")
    labels = [f"{p.scenario.model.name} {p.scenario.density:.0%}, {p.scenario.decode}" for p in plans]
    left = np.zeros(len(plans))
    for k, name in enumerate(names):
        share = np.array([p.phases_ms[name] / 1e3 / p.live_s for p in plans])
        ax1.barh(labels, share, left=left, color=colors(k), label=name)
        left += share
    for i, p in enumerate(plans):
        ax1.text(1.01, i, f"{fmt(p.live_s)} s", va="center", fontsize=8)
    ax1.set_xlim(0, 1.12)
    ax1.set_xlabel("share of the time from the end of a training step to live on every server (total at the right)")
    ax1.invert_yaxis()
    ax1.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.09))
    ax1.set_title("time per phase, 1,000 replicas (GPU costs measured on one H200; fleet assumed)", fontsize=10)

    base = kimi_2pct_share(plans).scenario
    counts = [int(x) for x in np.unique(np.logspace(0, 4, 41).astype(int))]
    series: dict[str, list[float]] = {}
    for n in counts:
        pl = plan(with_replicas(base, n), c)
        for lim in pl.limits:
            series.setdefault(lim.name.split(" (")[0], []).append(lim.ratio)
    for k, (name, ys) in enumerate(series.items()):
        if max(ys) >= 0.01:
            ax2.plot(counts, ys, label=name, color=plt.get_cmap("tab20")(k))
    ax2.axhline(1.0, color="black", lw=1, ls="--")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("replicas (32 H200 each)")
    ax2.set_ylabel("demand / capacity")
    ax2.set_title(f"{KIMI_K2.name} at 2%, each rank its share, {base.fleet.name}: limits by fleet size", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS, help="where the measured inputs are read")
    ap.add_argument("--out", default=os.path.join(RESULTS, "scale_model"), help="PNG and JSON path, without suffix")
    ap.add_argument("--inputs", action="store_true", help="print every input as a markdown table and exit")
    ap.add_argument("--markdown", action="store_true", help="print the tables of docs/SCALE.md")
    ap.add_argument("--no-png", action="store_true")
    args = ap.parse_args(argv)
    c = MeasuredCosts.load(args.results)
    if args.inputs:
        print(markdown(input_rows(c, FLEETS)))
        print()
        print(markdown(stage_rows(c)))
        return 0
    plans = [plan(s, c) for s in scenarios()]
    extra = [plan(s, c) for s in what_ifs()]
    show: Callable[[list[list[str]]], str] = markdown if args.markdown else text_table
    kimi = kimi_2pct_share(plans)
    sections = [
        ("Model shapes", shape_rows(MODELS)),
        ("Headline", headline(plans, c)),
        ("Time per phase", phase_rows(plans)),
        (f"Limits: {kimi.scenario.label}", limit_rows(kimi)),
        (f"Store requests: {kimi.scenario.label}", request_rows(kimi)),
        ("What it takes: the 1T at 2%", headline(extra, c)),
        ("Peers", peer_rows(c)),
    ]
    for title, rows in sections:
        print(f"\n## {title}\n")
        print(show(rows))
    if not args.no_png:
        plot(plans, c, args.out + ".png")
        print(f"\nsaved {args.out}.png")
    with open(args.out + ".json", "w") as f:
        json.dump(
            {
                "command": "benchmarks/scale_model.py",
                "inputs": [dataclasses.asdict(i) for i in c.inputs()],
                "fleet_sources": FLEET_SOURCES,
                "models": {m.name: {"params": m.params, "expert_params": m.expert_params, "tensors": m.tensors,
                                    "source": m.source} for m in MODELS},
                "plans": [p.to_json() for p in plans],
                "what_ifs": [p.to_json() for p in extra],
            },
            f,
            indent=1,
        )  # fmt: skip
    print(f"saved {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
