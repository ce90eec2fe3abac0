#!/usr/bin/env python
"""Header cost of a version at mixture-of-experts scale, format 3 beside format 4, the collector
paused or not (issue 25: `open` of W parts; docs/FORMAT.md "Columns"). CPU only, no GPU, no model:
the headers of a W-part version of a model's shapes (Qwen3-30B-A3B by default: 18,867 checkpoint
tensors) with random nnz and codec places, written as part files of an empty payload.

    python benchmarks/open_headers.py [--model qwen3-30b-a3b] [--parts 2] [--repeat 5] [--tree DIR] [--out DIR]

Per format (3, 4 and, where the tree has it, 5: packed arrays): the writer's `VersionHeader.to_json`
of one part, and the reader's open of all parts (`VersionFile` per part + `Version`, what
`DeltaStore.open` does after the files are local), with the collector paused as the reader pauses it
(`gc_pause`) and with the pause turned off. Least of `--repeat` runs (the machine is shared; the least
is the code's own cost), ms. --tree DIR measures another checkout too (benchmarks/trees.py), in the
same run. Prints a table; with --out, writes open_headers.json and open_headers.png there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from trees import child_output, in_tree, tree_first  # noqa: E402

tree_first()  # a child run: the measured checkout's package first

import torch  # noqa: E402

from vllm_delta import format as fmt  # noqa: E402
from vllm_delta import gc_pause  # noqa: E402
from vllm_delta.format import (  # noqa: E402
    COLUMNS_FORMAT_VERSION,
    STREAMS_FORMAT_VERSION,
    PartInfo,
    TensorTable,
    Version,
    VersionFile,
    VersionHeader,
    write,
)

ARRAYS = getattr(fmt, "ARRAYS_FORMAT_VERSION", None)  # format 5, in trees that have it
from vllm_delta.testing.apply_fixtures import QWEN3, QWEN3_MOE, model_layout  # noqa: E402

sys.path.insert(0, HERE)
from open_parts import least  # noqa: E402  (the least of repeated runs, in ms)


def part_headers(model: str, parts: int, fv: int, seed: int = 0) -> list[VersionHeader]:
    """The W part headers of one delta of `model`'s shapes: rows of dim 0 split evenly, 1% changed."""
    _, layout = model_layout({**QWEN3, **QWEN3_MOE}[model])
    names = sorted(layout.hf_shapes)
    shapes = [list(layout.hf_shapes[n]) for n in names]
    rng = random.Random(seed)
    checksums = [f"{rng.getrandbits(64):016x}" for _ in names]
    out = []
    for k in range(parts):
        rows, nnz, encs, at = {}, [], [], 0
        for name, shape in zip(names, shapes):
            n_rows = shape[0] if shape else 1
            r0, r1 = n_rows * k // parts, n_rows * (k + 1) // parts
            size = 1
            for d in shape[1:]:
                size *= d
            owned = (r1 - r0) * size
            changed = rng.randrange(1, max(2, owned // 50)) if owned else 0
            if r1 > r0:
                rows[name] = [r0, r1]
            nnz.append(changed)
            encs.append({"at": at, "start": r0 * size} if changed else {})
            at += changed
        table = TensorTable(list(names), [list(s) for s in shapes], ["BF16"] * len(names), checksums, nnz, encs)
        if fv == ARRAYS:  # what the format-5 writer holds: the columns as arrays (writer.TableTemplate)
            table = TensorTable.from_arrays(table.arrays())
        out.append(
            VersionHeader(
                version=5,
                kind="delta",
                tensors=table,
                checksum="0" * 16,
                base=4,
                base_checksum="0" * 16,
                codec="chunked",
                format_version=fv,
                part=PartInfo(index=k, count=parts, checksum="0" * 16, rows=rows),
                enc={"chunk_elems": 65536, "elems": at},
            )
        )
    return out  # every part's checksum and the version's are 0: the parts add up


def measure(model: str, parts: int, fv: int, repeat: int, folder: str) -> dict[str, float | int | str]:
    headers = part_headers(model, parts, fv)
    paths = []
    for h in headers:
        path = os.path.join(folder, f"f{fv}-part{h.part.index if h.part else 0}.safetensors")
        write(path, h, {"::blob": torch.zeros(8, dtype=torch.uint8)})
        paths.append(path)

    def open_all() -> None:
        Version([VersionFile(p, expect_version=5) for p in paths], expect_version=5)

    paused = least(open_all, repeat)
    real = gc_pause.paused
    gc_pause.paused = contextlib.nullcontext  # type: ignore[assignment]
    try:
        unpaused = least(open_all, repeat)
    finally:
        gc_pause.paused = real
    return {
        "format": fv,
        "parts": parts,
        "tensors": len(headers[0].tensors),
        "kb_per_part": len(headers[0].to_json()) / 1e3,
        "to_json": least(headers[0].to_json, repeat),
        "open_gc_paused": paused,
        "open_gc_on": unpaused,
    }


def formats() -> list[int]:
    return [STREAMS_FORMAT_VERSION, COLUMNS_FORMAT_VERSION] + ([ARRAYS] if ARRAYS is not None else [])


def measure_all(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="open-headers-") as folder:
        return [measure(args.model, args.parts, fv, args.repeat, folder) for fv in formats()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted({**QWEN3, **QWEN3_MOE}))
    ap.add_argument("--parts", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tree", default="", help="another checkout, measured beside this one")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_output(args.child, {"rows": measure_all(args)})
        return 0
    rows = [{"tree": "this", **r} for r in measure_all(args)]
    if args.tree:
        child_args = ["--model", args.model, "--parts", str(args.parts), "--repeat", str(args.repeat)]
        other = in_tree(os.path.abspath(args.tree), __file__, child_args)
        rows += [{"tree": "other", **r} for r in other["rows"]]
    print(f"# {args.model}, a version of {args.parts} parts; least of {args.repeat}; ms; cpus={os.cpu_count()}")
    if args.tree:
        print(f"# this: {os.path.dirname(HERE)}; other: {os.path.abspath(args.tree)}")
    cols = ["tensors", "kb_per_part", "to_json", "open_gc_on", "open_gc_paused"]
    print(f"{'tree':>6} {'format':>6} " + " ".join(f"{c:>15}" for c in cols))
    for r in rows:
        print(f"{r['tree']:>6} {r['format']:>6} " + " ".join(f"{float(r[c]):>15.1f}" for c in cols))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "open_headers.json"), "w") as f:
            json.dump({"model": args.model, "parts": args.parts, "tree": args.tree, "rows": rows}, f, indent=1)
        plot(rows, args)
    return 0


def plot(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    labels = ["to_json (1 part)", "open, collector on", "open, paused"]
    keys = ["to_json", "open_gc_on", "open_gc_paused"]
    width = 0.8 / len(rows)
    for j, r in enumerate(rows):
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(3)]
        ax.bar(xs, [r[k] for k in keys], width=width, label=f"{r['tree']}: format {r['format']}")
    ax.set_xticks(range(3), labels)
    ax.set_ylabel("ms")
    ax.set_title(f"{args.model}: headers of a {args.parts}-part version", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "open_headers.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
