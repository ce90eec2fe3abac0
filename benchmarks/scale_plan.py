"""One scenario of the 1T plan (benchmarks/scale_model.py) computed: `plan` (sizes, the time per phase,
the stores' requests, memory, every limit), the replica count a fleet can grow to, and the scenarios
of docs/SCALE.md."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from scale_costs import KEPT_PHASES, STAGE_PHASES, MeasuredCosts
from scale_inputs import GB, GIB, KIMI_K2, QWEN3_8B, QWEN3_30B_A3B, QWEN3_235B_A22B, Decode, Fleet, ModelShape


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


@dataclass(frozen=True)
class _Sizes:
    """One scenario's sizes per version, and how many read each store. Changed elements are spread over
    tensors and ranks in proportion to their parameters (uniform density)."""

    changed: float  # changed elements per version
    kept: float  # per rank: the changes its layout holds
    decoded: float  # per rank: the changes it decodes
    rank_tensors: float  # tensors a rank's layout holds any of
    bpe: float  # bytes per changed element
    vbytes: float  # a version's bytes
    abytes: float  # an anchor's bytes
    files: int  # data files per version (one part per trainer rank)
    host_bytes: float  # what a host downloads per version
    mirrored: bool
    readers_hosts: float  # hosts reading one store
    readers_replicas: float  # replicas reading one store
    lat: float  # a GET's first byte, in seconds


def _sizes(s: Scenario, c: MeasuredCosts) -> _Sizes:
    m, f = s.model, s.fleet
    P, E, T, TE = m.params, m.expert_params, m.tensors, m.expert_tensors
    D = P - E  # attention, embeddings, norms, routers, dense and shared MLPs: sliced by tp
    changed = s.density * P
    kept = s.density * (D / f.tp + E / f.ep_size)
    bpe = c.bytes_per_changed(s.density)
    vbytes = changed * bpe
    host_share = 1.0 if f.download == "whole" else min(1.0, f.ranks_per_host * kept / changed)
    mirrored = f.regional_stores > 0  # stores: who reads which one
    return _Sizes(
        changed=changed,
        kept=kept,
        decoded=changed if s.decode == "whole" else kept,
        rank_tensors=(T - TE) + TE / f.ep_size if f.ep else T,
        bpe=bpe,
        vbytes=vbytes,
        abytes=2.0 * P,  # an anchor: every bf16 tensor in full
        files=f.trainer_gpus,
        host_bytes=vbytes * host_share,
        mirrored=mirrored,
        readers_hosts=f.hosts / f.regional_stores if mirrored else f.hosts,
        readers_replicas=f.replicas / f.regional_stores if mirrored else f.replicas,
        lat=f.get_latency_ms / 1e3,
    )


@dataclass(frozen=True)
class _Times:
    """Per version: the time of each phase (ms), and the spans the limits weigh."""

    phases: dict[str, float]
    stage_ms: float  # open, inflate, decode and the rest of staging on a rank
    download: float  # ms
    verify: float  # ms
    pause: float  # ms
    mirror_busy: float  # s a mirror spends on a version (anchors amortized)


def _trainer_ms(s: Scenario, c: MeasuredCosts, z: _Sizes) -> tuple[float, float]:
    """The trainer: its training thread (agree, detect, encode), then the upload of each rank's part."""
    m, f = s.model, s.fleet
    P, T = m.params, m.tensors
    w = f.trainer_gpus
    publish = (
        c.agree_ms.value
        + c.agree_ms_per_tensor.value * T
        + c.detect_ms_per_gparam.value * P / w / GB
        + c.detect_ms_per_tensor.value * T
    )
    rank_bytes = z.vbytes / w
    trainer_ranks_per_host = min(w, f.gpus_per_host)
    up_gbps = min(f.stream_gbps, f.host_nic_gbps / trainer_ranks_per_host, f.store_egress_gbps / w)
    upload = (
        c.upload_ms_per_mb.value * rank_bytes / 1e6
        + c.upload_ms_per_tensor.value * T
        + 1e3 * _transfer_s(rank_bytes, up_gbps)
        + c.commit_local_ms.value
        + 1e3 * 3 * z.lat  # the part's upload, the record, the head
    )
    return publish, upload


def _transfer_ms(f: Fleet, c: MeasuredCosts, z: _Sizes) -> tuple[float, float, float, float]:
    """The mirror hop (one per regional store) and the servers' download: (mirror ms, mirror busy s per
    version, download ms, verify ms)."""
    stream = f.download_streams * f.stream_gbps
    sha = c.sha256_gb_per_s.value * GB * f.hash_threads  # bytes per second
    mirror = mirror_busy = 0.0
    if z.mirrored:
        in_gbps = min(f.host_nic_gbps, stream, f.store_egress_gbps / f.regional_stores)
        out_gbps = min(f.host_nic_gbps, stream)

        def copy_s(nbytes: float, nfiles: float) -> float:
            """A mirror's copy: download, verify (sha256), upload, file after file."""
            fetched = nbytes * c.mirror_reads_per_version.value
            return _transfer_s(fetched, in_gbps) + fetched / sha + _transfer_s(nbytes, out_gbps) + 2 * nfiles * z.lat

        mirror = 1e3 * (f.mirror_poll_s / 2 + copy_s(z.vbytes, z.files + 2))
        mirror_busy = copy_s(z.vbytes, z.files + 2) + copy_s(z.abytes, z.files + 2) / f.anchor_every  # per version
    down_gbps = min(f.host_nic_gbps, stream, f.store_egress_gbps / z.readers_hosts)
    download = 1e3 * (f.poll_s / 2 + (2 + z.files) * z.lat + _transfer_s(z.host_bytes, down_gbps))
    verify = 1e3 * c.sha256_passes.value * z.host_bytes / sha
    return mirror, mirror_busy, download, verify


def _times(s: Scenario, c: MeasuredCosts, z: _Sizes) -> _Times:
    """Every phase from the end of a training step to live: the trainer, the mirror, the download,
    staging on each rank, then the pause."""
    publish, upload = _trainer_ms(s, c, z)
    mirror, mirror_busy, download, verify = _transfer_ms(s.fleet, c, z)
    opened = c.open_ms.value + c.open_ms_per_tensor.value * s.model.tensors
    stage = {ph: c.stage_fixed_ms[ph].value for ph in STAGE_PHASES}
    for ph in STAGE_PHASES:
        stage[ph] += c.stage_ns_per_elem[ph].value * (z.kept if ph in KEPT_PHASES else z.decoded) / 1e6
    rest = c.stage_rest_ms.value + c.stage_rest_ms_per_tensor.value * z.rank_tensors
    rest += c.stage_rest_ns_per_elem.value * z.decoded / 1e6
    pause = c.pause_ns_per_elem(s.density) * z.kept / 1e6
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
    return _Times(phases, stage_ms, download, verify, pause, mirror_busy)


def _requests(f: Fleet, c: MeasuredCosts, z: _Sizes) -> dict[str, dict[str, float]]:
    """Requests per second and egress, per store kind (the origin; the regional stores when mirrored)."""
    step = f.step_s
    anchor_files_per_s = z.files / (f.anchor_every * step)
    region: dict[str, float] = {
        "polls": z.readers_replicas * c.gets_per_poll.value / f.poll_s,
        "full listings": z.readers_replicas * 2 / f.full_listing_s,
        "records": z.readers_replicas * 2 / step,
        "data files": z.readers_hosts * z.files / step,
    }
    region_put = {"ledger reports": z.readers_replicas * (1 / f.report_s + 1 / step)}
    region_egress = z.readers_hosts * z.host_bytes * 8 / step / GB
    if z.mirrored:
        region["mirror ledger reads"] = z.readers_replicas / f.mirror_poll_s
        n = f.regional_stores
        origin = {
            "mirror polls": n * c.gets_per_poll.value / f.mirror_poll_s,
            "mirror listings": n * 2 / f.full_listing_s,
            "mirror records": n * 2 / step,
            "mirror data files": n * z.files / step + n * anchor_files_per_s,
        }
        origin_put = {"forwarded reports": f.replicas * (1 / f.report_s + 1 / step)}
        origin_egress = n * (z.vbytes * c.mirror_reads_per_version.value + z.abytes / f.anchor_every) * 8 / step / GB
    else:
        origin, origin_put, origin_egress = dict(region), dict(region_put), region_egress
    if f.staleness_gate:
        origin["trainer ledger reads"] = f.replicas / step
    origin_put["trainer writes"] = (z.files + 2) / step + anchor_files_per_s
    requests = {"origin": {**_tagged(origin, "GET"), **_tagged(origin_put, "PUT"), "egress Gbit/s": origin_egress}}
    if z.mirrored:
        requests["regional"] = {**_tagged(region, "GET"), **_tagged(region_put, "PUT"), "egress Gbit/s": region_egress}
    return requests


def plan(s: Scenario, c: MeasuredCosts) -> Plan:
    """Everything per version for one scenario (`_sizes`, `_times`, `_requests`, memory, `_limits`);
    GPU costs are the H200's."""
    m, f = s.model, s.fleet
    z = _sizes(s, c)
    t = _times(s, c, z)
    # -- memory
    peak = c.peak_fixed_gb.value * GB + c.peak_bytes_per_kept.value * z.kept
    held = c.held_bytes_per_kept.value * z.kept
    rank_file = z.vbytes if s.decode == "whole" else z.vbytes * z.kept / z.changed
    pinned = f.ranks_per_host * c.pinned_per_file_byte.value * rank_file
    weights = 2.0 * ((m.params - m.expert_params) / f.tp + m.expert_params / f.ep_size)
    p = Plan(
        scenario=s,
        params=m.params,
        tensors=m.tensors,
        changed=z.changed,
        bytes_per_changed=z.bpe,
        version_bytes=z.vbytes,
        anchor_bytes=z.abytes,
        files=z.files,
        hosts=f.hosts,
        kept_per_rank=z.kept,
        decoded_per_rank=z.decoded,
        weights_per_gpu_gb=weights / GB,
        staging_peak_gb=peak / GB,
        staging_held_gb=held / GB,
        pinned_per_host_gb=pinned / GB,
        requests=_requests(f, c, z),
        phases_ms=t.phases,
    )
    p.limits = _limits(p, c, z, t, peak, pinned, weights)
    return p


def _limits(p: Plan, c: MeasuredCosts, z: _Sizes, t: _Times, peak: float, pinned: float, weights: float) -> list[Limit]:
    """Every limit of the update path as demand / capacity, then the fleet check (whether the fleet's
    layout holds the model at all)."""
    f = p.scenario.fleet
    step, w = f.step_s, f.trainer_gpus
    hbm = c.card_memory_gib.value * GIB
    store_kinds = list(p.requests.items())
    busiest_get = max(store_kinds, key=lambda kv: _total(kv[1], "GET"))
    busiest_put = max(store_kinds, key=lambda kv: _total(kv[1], "PUT"))
    busiest_egress = max(store_kinds, key=lambda kv: kv[1]["egress Gbit/s"])
    rank_bytes = z.vbytes / w
    anchor_rank = z.abytes / w / f.anchor_every  # a rank's share of an anchor, per version
    trainer_up = min(w, f.gpus_per_host) * (rank_bytes + anchor_rank) * 8 / step / GB
    limits = [
        Limit(f"store egress ({busiest_egress[0]})", busiest_egress[1]["egress Gbit/s"], f.store_egress_gbps, "Gbit/s"),
        Limit(f"store GET rate ({busiest_get[0]})", _total(busiest_get[1], "GET"), f.store_get_rps, "GET/s"),
        Limit(f"store PUT rate ({busiest_put[0]})", _total(busiest_put[1], "PUT"), f.store_put_rps, "PUT/s"),
        Limit("server download + verify per version", (t.download - 500 * f.poll_s + t.verify) / 1e3, step, "s"),
        Limit("server host NIC", z.host_bytes * 8 / step / GB, f.host_nic_gbps, "Gbit/s"),
        Limit("trainer upload stream", (rank_bytes + anchor_rank) * 8 / step / GB, f.stream_gbps, "Gbit/s"),
        Limit("trainer host NIC", trainer_up, f.host_nic_gbps, "Gbit/s"),
        Limit("GPU memory for staging", peak / GB, (1 - f.gpu_memory_utilization) * hbm / GB, "GB"),
        Limit("pinned host memory", pinned / GIB, f.host_pinned_budget_gib, "GiB"),
        Limit("pause budget", t.pause, f.pause_budget_ms, "ms"),
        Limit("staging's share of GPU time", (t.stage_ms + t.pause) / 1e3 / step, f.staging_share_budget, "of a step"),
    ]
    if z.mirrored:
        limits.append(Limit("mirror busy per version (anchors amortized)", t.mirror_busy, step, "s"))
    # not a limit of the update path: whether the fleet's layout holds the model at all
    limits.append(Limit(FLEET_CHECK + "weights per GPU", weights / GB, f.gpu_memory_utilization * hbm / GB, "GB"))
    return limits


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
