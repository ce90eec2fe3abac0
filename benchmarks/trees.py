"""Old beside new in one run: a benchmark measures another checkout (`--tree DIR`) in a child process
that has that checkout's package first on its path, and gets its results back as JSON.

    from trees import in_tree, child_output
    other = in_tree(tree, __file__, ["--model", m])      # in the parent: the child's JSON
    ...
    if args.child: child_output(args.child, results)     # in the child: what it measured

The child runs this checkout's benchmark script with `--child PATH` added (the script decides what a
child measures); its working folder is the other tree (Python puts the working folder first on a
forkserver's path) and `TREE_ENV` names it, so that the child can check which package it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

TREE_ENV = "BENCH_TREE"  # set in a child run: the checkout it measures


def tree_first() -> None:
    """Put the checkout a child measures first on sys.path (call before importing vllm_delta)."""
    tree = os.environ.get(TREE_ENV)
    if tree:
        sys.path.insert(0, tree)


def in_tree(tree: str, script: str, args: list[str], timeout: float = 1800.0) -> Any:
    """Run `script --child OUT args` with `tree`'s package first on the path; its JSON output."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env = {**os.environ, TREE_ENV: tree, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # leave the other checkout as it is
    try:
        subprocess.run(
            [sys.executable, os.path.abspath(script), "--child", path, *args],
            env=env,
            cwd=tree,
            check=True,
            timeout=timeout,
        )
        with open(path) as f:
            out = json.load(f)
    finally:
        os.unlink(path)
    want = os.path.join(os.path.realpath(tree), "vllm_delta")
    got = out.get("package") if isinstance(out, dict) else None
    if got is not None and os.path.realpath(got) != want:
        raise RuntimeError(f"the child imported {got}, not {want}")
    return out


def child_output(path: str, results: Any) -> None:
    """In a child: write `results` (with the package it imported, which the parent checks)."""
    import vllm_delta

    if isinstance(results, dict):
        results = {**results, "package": os.path.dirname(vllm_delta.__file__)}
    with open(path, "w") as f:
        json.dump(results, f)
