"""The inputs of the 1T plan (benchmarks/scale_model.py): `Input`, reading benchmarks/results/ and the
package's defaults (with `ast`, nothing imported), the models' shapes and the fleet's assumptions."""

from __future__ import annotations

import ast
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
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
