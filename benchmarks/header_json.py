"""A version header's JSON: parse (`VersionHeader.from_json`, what every reader of a version file pays)
and write (`to_json`, once per published file), in this tree and in the code of `--old-rev`.

Issue 23: the store's documents and the header moved onto wire.py's generic codec. A header lists
every tensor of the model (a mixture of experts: tens of thousands), so its codec must not cost
much more than the hand-written one it replaced. Each row is a header of N tensors shaped like a
chunked delta's (shape, dtype, checksum, nnz, enc); the times are the best of `--repeat` runs in CPU
time (`time.process_time`: the machine is shared), in a fresh process per tree.

    python benchmarks/header_json.py                         # 1,000 / 20,000 / 100,000 tensors, vs 5ffad64
    python benchmarks/header_json.py --tensors 20000 --old-rev HEAD~3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(n: int, repeat: int) -> dict[str, float]:
    """ms of CPU to parse and to write a header of `n` tensors (best of `repeat`), with the code on sys.path."""
    from vllm_delta.format import TensorEntry, VersionHeader

    tensors = {
        f"model.layers.{i // 64}.mlp.experts.{i % 64}.down_proj.weight": TensorEntry(
            [2048, 768], "BF16", "0123456789abcdef", 3000 + i, {"at": i * 3000, "start": 0}
        )
        for i in range(n)
    }
    header = VersionHeader(
        version=5,
        kind="delta",
        tensors=tensors,
        checksum="0123456789abcdef",
        base=4,
        base_checksum="0123456789abcdef",
        codec="chunked",
        format_version=3,
        created=1764123456.7,
        enc={"chunk_elems": 65536, "elems": n * 3000},
    )
    text = header.to_json()
    parse = write = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        VersionHeader.from_json(text)
        parse = min(parse, time.process_time() - t)
        t = time.process_time()
        header.to_json()
        write = min(write, time.process_time() - t)
    return {"parse_ms": parse * 1e3, "write_ms": write * 1e3, "mb": len(text) / 1e6}


def run(tree: str, n: int, repeat: int) -> dict[str, float]:
    """`measure` in a fresh process whose `vllm_delta` is the one in `tree`."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", str(n), "--repeat", str(repeat)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, nargs="+", default=[1000, 20000, 100000])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--old-rev", default="5ffad64", help="the code before the change ('' to skip it)")
    ap.add_argument("--measure", type=int, help=argparse.SUPPRESS)  # one measurement, in this process
    args = ap.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.repeat)))
        return
    with tempfile.TemporaryDirectory() as old:
        trees = [("this tree", ROOT)]
        if args.old_rev:
            archive = subprocess.run(
                ["git", "-C", ROOT, "archive", args.old_rev, "vllm_delta"], check=True, capture_output=True
            )
            subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
            trees.insert(0, (args.old_rev, old))
        print(f"{'code':>12} {'tensors':>8} {'MB':>6} {'parse ms':>9} {'write ms':>9}")
        for n in args.tensors:
            for name, tree in trees:
                r = run(tree, n, args.repeat)
                print(f"{name:>12} {n:>8} {r['mb']:>6.1f} {r['parse_ms']:>9.0f} {r['write_ms']:>9.0f}")


if __name__ == "__main__":
    main()
