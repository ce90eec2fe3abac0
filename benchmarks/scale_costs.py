"""The measured costs of the 1T plan (benchmarks/scale_model.py): every per-element and per-tensor cost
the benchmarks measured, read from benchmarks/results/ as an `Input` with its source."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from scale_inputs import GB, QWEN3_8B, QWEN3_30B_A3B, RESULTS, Input, lstsq, read_result

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
        return cls(
            **_payload_costs(results),
            **_trainer_costs(results),
            **_staging_costs(results),
            **_store_costs(results),
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


def _measured(name: str, value: float, unit: str, file: str, what: str) -> Input:
    return Input(name, value, unit, "measured", f"{file}: {what}", (file,))


def _derived(name: str, value: float, unit: str, formula: str, *files: str) -> Input:
    return Input(name, value, unit, "derived", formula, files)


def _payload_costs(results: str) -> dict[str, Input]:
    """Bytes per changed element, a line in ln(1/density) through the AdamW steps."""
    payload = read_result(PAYLOAD, results)
    pts = [(r["density"], r["chunked"]) for r in payload["rows"]]
    a, b = lstsq([[1.0, math.log(1 / d)] for d, _ in pts], [y for _, y in pts])
    byte_src = (
        f"least-squares line B = a + b ln(1/density) through the {len(pts)} AdamW steps of {PAYLOAD} "
        f"(chunked codec, densities {min(d for d, _ in pts):.2%}-{max(d for d, _ in pts):.2%})"
    )
    return {
        "bytes_a": _derived("bytes_per_changed_a", a, "B", byte_src, PAYLOAD),
        "bytes_b": _derived("bytes_per_changed_b", b, "B per ln(1/density)", byte_src, PAYLOAD),
    }


def _trainer_costs(results: str) -> dict[str, Input]:
    """The trainer: two runs of chunked:gpu on one H200, 399 and 4,719 checkpoint tensors, ~8.1B params each."""
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
    return {
        "agree_ms": _derived("publish_agree_ms", agree[0], "ms", f"line through {runs2}: pub_agree_ms", *pubs),
        "agree_ms_per_tensor": _derived("publish_agree_ms_per_tensor", agree[1], "ms", "the same line", *pubs),
        "detect_ms_per_gparam": _derived(
            "publish_detect_ms_per_gparam",
            detect[0],
            "ms per 1e9 parameters of a rank",
            f"solved from {runs2}: pub_detect_ms + pub_prepare_ms + pub_sums_ms = x params + y tensors",
            *pubs,
        ),
        "detect_ms_per_tensor": _derived("publish_detect_ms_per_tensor", detect[1], "ms", "the same system", *pubs),
        "upload_ms_per_mb": _derived(
            "upload_ms_per_mb",
            upload[0],
            "ms per MB of a rank's file",
            f"solved from {runs2}: upload_ms - up_write_ms = x MB + y tensors (the nvCOMP pack, the header, "
            "the records; the write itself is modelled as the transfer)",
            *pubs,
        ),
        "upload_ms_per_tensor": _derived("upload_ms_per_tensor", upload[1], "ms", "the same system", *pubs),
        "commit_local_ms": _measured(
            "commit_local_ms", s8["up_commit_ms"], "ms", PUBLISH_8B, "up_commit_ms, chunked:gpu"
        ),
        "open_ms": _derived("open_ms", opened[0], "ms", f"line through {runs2}: open_ms", *pubs),
        "open_ms_per_tensor": _derived("open_ms_per_tensor", opened[1], "ms", "the same line", *pubs),
    }


def _staging_costs(results: str) -> dict[str, Any]:
    """The server: staging by phase, memory and pause, four runs on one H200."""
    rows = read_result(APPLY, results)["rows"]
    tensors_of = {"qwen3-8b": QWEN3_8B.tensors, "qwen3-30b-a3b": QWEN3_30B_A3B.tensors}
    nnz = [float(r["nnz"]) for r in rows]
    runs4 = f"the {len(rows)} runs of {APPLY} (qwen3-8b, qwen3-30b-a3b at 1%, 3%; chunked:gpu)"
    fixed, per = {}, {}
    for ph in STAGE_PHASES:
        c = lstsq([[1.0, n] for n in nnz], [r["stage_phases"][ph] for r in rows])
        over = "kept" if ph in KEPT_PHASES else "decoded"
        src = f"least-squares line ms = fixed + per x elements through {runs4}; scales with the {over} elements"
        fixed[ph] = _derived(f"stage_{ph}_fixed_ms", c[0], "ms", src, APPLY)
        per[ph] = _derived(f"stage_{ph}_ns_per_elem", c[1] * 1e6, "ns", src, APPLY)
    rest_y = [r["stage_ms"] - sum(r["stage_phases"][p] for p in STAGE_PHASES) for r in rows]
    rest = lstsq([[1.0, tensors_of[r["model"]], n] for r, n in zip(rows, nnz)], rest_y)
    rest_src = f"least-squares fit (stage total - named phases) = a + b x tensors + c x elements through {runs4}"
    return {
        "stage_fixed_ms": fixed,
        "stage_ns_per_elem": per,
        "stage_rest_ms": _derived("stage_rest_ms", rest[0], "ms", rest_src, APPLY),
        "stage_rest_ms_per_tensor": _derived("stage_rest_ms_per_tensor", rest[1], "ms", rest_src, APPLY),
        "stage_rest_ns_per_elem": _derived("stage_rest_ns_per_elem", rest[2] * 1e6, "ns", rest_src, APPLY),
        **_memory_costs(rows, nnz, runs4),
    }


def _memory_costs(rows: list[Any], nnz: list[float], runs4: str) -> dict[str, Input]:
    """Staging's device memory, its pinned host memory, and the pause per element (the apply runs)."""
    mem = [r["stage_memory"] for r in rows]
    peak = lstsq([[1.0, n] for n in nnz], [m["device_peak_bytes"] for m in mem])
    peak_src = f"least-squares line device_peak_bytes = fixed + per x elements through {runs4}"

    def pause_at(density: float) -> float:
        at = [r for r in rows if abs(r["density"] - density) < 1e-9]
        return sum(r["pause_ms"] for r in at) / sum(r["nnz"] for r in at) * 1e6

    return {
        "peak_fixed_gb": _derived(
            "staging_peak_fixed_gb", peak[0] / GB, "GB", peak_src + " (decode temporaries: one nvCOMP run)", APPLY
        ),
        "peak_bytes_per_kept": _derived(
            "staging_peak_bytes_per_kept",
            peak[1],
            "B",
            peak_src + " (the kept changes' pieces and their concatenation at the end of staging)",
            APPLY,
        ),
        "held_bytes_per_kept": _measured(
            "staging_held_bytes_per_kept",
            sum(m["device_held_bytes"] for m in mem) / sum(nnz),
            "B",
            APPLY,
            "sum of stage_memory.device_held_bytes / sum of nnz",
        ),
        "pinned_per_file_byte": _measured(
            "pinned_host_per_file_byte",
            sum(m["host_bytes"] for m in mem) / sum(r["file_bytes"] for r in rows),
            "B",
            APPLY,
            "sum of stage_memory.host_bytes / sum of file_bytes (the compressed chunks a rank reads)",
        ),
        "pause_ns_per_elem_1pct": _measured(
            "pause_ns_per_elem_at_1pct", pause_at(0.01), "ns", APPLY, "pause_ms / nnz of the 1% rows"
        ),
        "pause_ns_per_elem_3pct": _measured(
            "pause_ns_per_elem_at_3pct", pause_at(0.03), "ns", APPLY, "pause_ms / nnz of the 3% rows"
        ),
    }


def _store_costs(results: str) -> dict[str, Input]:
    """The store's polls and reads, the card, the whole-file hash."""
    poll = next(r for r in read_result(POLL, results)["rows"] if r["store"] == "s3" and r["code"] == "new")
    regions = read_result(REGIONS, results)

    def reads(topology: str) -> float:
        at = [r for r in regions["rows"] if r["topology"] == topology]
        return sum(r["data_bytes"] for r in at) / sum(r["bytes_version"] for r in at)

    card = read_result(CARDS, results)["cards"]["NVIDIA H200"]
    sha = read_result(SHA256, results)
    passes = read_result(ROUND_TRIPS, results)["sha256_passes_per_version"]
    return {
        "gets_per_poll": _measured("gets_per_poll", poll["requests_per_poll"], "GET", POLL, "s3/new requests_per_poll"),
        "get_latency_local_ms": _measured(
            "get_latency_local_ms",
            poll["p50_ms"] / poll["requests_per_poll"],
            "ms",
            POLL,
            "s3/new p50_ms / requests_per_poll (rclone on 127.0.0.1: a floor, not a remote store)",
        ),
        "mirror_reads_per_version": _measured(
            "mirror_reads_per_version",
            reads("regional"),
            "x version bytes",
            REGIONS,
            "data bytes read from the trainer's store / version bytes, the regional rows (one mirror)",
        ),
        "direct_reads_per_follower": _measured(
            "direct_reads_per_follower",
            reads("direct") / regions["meta"]["followers"],
            "x version bytes",
            REGIONS,
            "the same, direct rows, / meta.followers (each follower on its own cache: one read each)",
        ),
        "card_memory_gib": _measured("card_memory_gib", card["memory_mib"] / 1024, "GiB", CARDS, "NVIDIA H200"),
        "sha256_gb_per_s": _measured(
            "sha256_gb_per_s", sha["gb_per_s"], "GB/s", SHA256, "gb_per_s (one thread of the H200 machine's CPU)"
        ),
        "sha256_passes": _measured(
            "sha256_passes_per_version",
            passes,
            "passes",
            ROUND_TRIPS,
            "the API process hashes its download, then the worker re-hashes the cached file",
        ),
    }
