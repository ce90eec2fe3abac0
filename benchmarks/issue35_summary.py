#!/usr/bin/env python
"""The short table of an issue-35 GPU call (`STAGES=issue35 bash benchmarks/gpu_session.sh`): every
publish_gpu.py run it made, old tree beside new, as step end -> live p50 / p95 over its steady syncs, the
named share of the wall, the publish's device-wide memory and whether every live checksum agreed.

    python benchmarks/issue35_summary.py OUT_DIR      # reads OUT_DIR/**/publish_gpu*.json, syncs*.json, mem*.json

Runs of a tree from before issue 35 report medians only: their p50 / p95 are computed here from the
rows they kept (rank 0's timed steps).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np


def rows_of(run: dict) -> list[dict]:
    """Rank 0's timed rows of one codec configuration (any tree's JSON)."""
    return [r for r in run.get("rows", []) if "live_ms" in r or "wall" in r]


def lines_of(path: str) -> list[str]:
    with open(path) as f:
        doc = json.load(f)
    tree = "old" if "/old" in path else "new"
    name = os.path.relpath(path, sys.argv[1])
    out = []
    for world in doc.get("runs", []):
        ranks = world.get("ranks") or []
        if not ranks:
            continue
        for s in world.get("summary", []):
            if "skipped" in s:
                out.append(f"{tree:>4} {name[-28:]:>28} {'':>3} {s['codec']:>12}  skipped: {s['skipped']}")
                continue
            rows = rows_of(ranks[0]["runs"].get(s["codec"], {}))
            live = [r.get("wall", r.get("live_ms")) for r in rows]
            p50, p95 = (np.percentile(live, 50), np.percentile(live, 95)) if live else (float("nan"),) * 2
            named = s.get("named_p50", float("nan"))
            dev = s.get("publish_device_mb", float("nan"))
            ok = "equal" if s.get("checksum_ok") else "DIFFER"
            for frames, (mb, _, wall) in sorted((s.get("memory") or {}).items()):
                if int(frames):
                    label = f"gpu_encode_frames={frames}"
                    out.append(f"{'':>4} {label:>28} {'':>3} {'':>12} {'':>5} {wall:>8.1f} {'':>24} {mb:>7.0f}")
            out.append(
                f"{tree:>4} {name[-28:]:>28} {s.get('world', 1):>3} {s['codec']:>12} {len(live):>5} {p50:>8.1f} "
                f"{p95:>8.1f} {named:>6.1%} {s.get('publish_peak_mb', float('nan')):>8.0f} {dev:>7.0f} {ok:>9}"
            )
    return out


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp/out")
    paths = sorted(set(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)))
    paths = [p for p in paths if os.path.basename(p).startswith(("publish_gpu", "syncs", "mem"))]
    print(f"# issue 35: step end -> live over the steady syncs (first excluded), ms; {len(paths)} runs in {root}")
    print(
        f"{'tree':>4} {'run':>28} {'W':>3} {'codec':>12} {'syncs':>5} {'p50':>8} {'p95':>8} {'named':>6} "
        f"{'torch MB':>8} {'dev MB':>7} {'checksums':>9}"
    )
    for path in paths:
        try:
            for line in lines_of(path):
                print(line)
        except (OSError, ValueError, KeyError) as exc:
            print(f"{path}: unreadable ({type(exc).__name__}: {exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
