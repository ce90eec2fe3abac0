#!/usr/bin/env python
"""Where a multi-part version's `open` goes (issue 25: `open` under 10 ms at any world size): per part
file, safetensors' own open, `json.loads` of our header, its decode into a `VersionHeader` (`from_plain_doc`),
its checks (`validate`), then the parts merged into one `Version`; and `DeltaStore.open` whole.
CPU only: it reads stores that `benchmarks/publish_gpu.py --store DIR` kept.

    python benchmarks/publish_gpu.py --world 1,2,4 --codecs chunked:gpu --store /dev/shm/open
    python benchmarks/open_parts.py /dev/shm/open       # every store in the folder, or name stores
    python benchmarks/open_parts.py NEW_STORE --tree /tmp/old --tree-stores OLD_STORE   # old beside new

Each time is the least of `--repeat` runs (the machine is shared; the least is the code's own cost),
in ms. One row per store: its newest version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from trees import child_output, in_tree, tree_first  # noqa: E402

tree_first()  # a child run: the measured checkout's package first

from safetensors import safe_open  # noqa: E402

from vllm_delta.format import Version, VersionFile, VersionHeader  # noqa: E402
from vllm_delta.store import DeltaStore  # noqa: E402


def least(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(store_dir: str, repeat: int) -> dict[str, float | int | str]:
    store = DeltaStore(store_dir)
    v = store.latest()
    if v is None:
        raise SystemExit(f"{store_dir}: no version")
    rec = store.record(v)
    paths = store.local_paths(v, record=rec)
    texts = []
    for p in paths:
        f = safe_open(p, framework="pt", device="cpu")
        texts.append((f.metadata() or {})["header"])
    raws = [json.loads(t) for t in texts]
    headers = [VersionHeader.from_plain_doc(r) for r in raws]

    def safetensors_open() -> None:
        for p in paths:
            f = safe_open(p, framework="pt", device="cpu")
            f.metadata()
            list(f.keys())

    def merge() -> None:
        files = [VersionFile(p, expect_version=v) for p in paths]
        Version(files, expect_version=v) if len(files) > 1 else None

    files_ms = least(lambda: [VersionFile(p, expect_version=v).close() for p in paths], repeat)
    return {
        "store": os.path.basename(store_dir.rstrip("/")),
        "version": v,
        "parts": len(paths),
        "tensors": len(headers[0].tensors),
        "header_kb": sum(map(len, texts)) / len(texts) / 1e3,
        "safetensors": least(safetensors_open, repeat),
        "json": least(lambda: [json.loads(t) for t in texts], repeat),
        "decode": least(lambda: [VersionHeader.from_plain_doc(r) for r in raws], repeat),
        "validate": least(lambda: [h.validate() for h in headers], repeat),
        "files": files_ms,
        "merge": max(0.0, least(merge, repeat) - files_ms),
        "open": least(lambda: store.open(v).close(), repeat),
    }


def stores_in(folders: list[str]) -> list[str]:
    stores = []
    for d in folders:
        if os.path.exists(os.path.join(d, "head.json")) or os.path.isdir(os.path.join(d, "versions")):
            stores.append(d)
        else:
            stores += sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith("store-"))
    return stores


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("stores", nargs="*", help="store folders (local), or folders of stores (publish_gpu's --store)")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--tree", default="", help="another checkout: it opens the --tree-stores, in the same run")
    ap.add_argument("--tree-stores", nargs="*", default=[], help="stores the other checkout opens")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_output(args.child, {"rows": [measure(d, args.repeat) for d in stores_in(args.stores)]})
        return 0
    cols = ["safetensors", "json", "decode", "validate", "files", "merge", "open"]
    print(f"# open of a version of W parts, least of {args.repeat} runs, ms (all parts); cpus={os.cpu_count()}")
    rows = [{"tree": "this", **measure(d, args.repeat)} for d in stores_in(args.stores)]
    if args.tree:
        other = in_tree(os.path.abspath(args.tree), __file__, [*args.tree_stores, "--repeat", str(args.repeat)])
        rows += [{"tree": "other", **r} for r in other["rows"]]
        print(f"# this: {os.path.dirname(HERE)}; other: {os.path.abspath(args.tree)}")
    if not rows:
        raise SystemExit(f"no store in {args.stores} {args.tree_stores}")
    print(f"{'tree':>5} {'store':>30} {'parts':>5} {'tensors':>7} {'KB/part':>7} " + " ".join(f"{c:>11}" for c in cols))
    for r in rows:
        print(
            f"{r['tree']:>5} {r['store'][-30:]:>30} {r['parts']:>5} {r['tensors']:>7} {r['header_kb']:>7.1f} "
            + " ".join(f"{float(r[c]):>11.2f}" for c in cols)
        )
    print("files: VersionFile per part (safetensors + json + decode + validate + its own checks); merge: Version()")
    return 0


if __name__ == "__main__":
    sys.exit(main())
