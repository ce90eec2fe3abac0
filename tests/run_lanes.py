"""`make test`: the CPU suite in lanes chosen by the machine's cores, then the slowest tests of all lanes,
the wall time and the count of vLLM server start-ups.

    python tests/run_lanes.py [--lanes auto|1|2|3] [--durations N] [PATHS] [pytest arguments]

Why lanes: most of the suite's time is vLLM server start-ups, and a start-up is mostly one process
importing vLLM and torch at a time (API server, then engine core); the tests that start no server are
single-threaded. On more than 2 cores one core would mostly idle while either runs alone.

* `--lanes 1` (auto on 2 cores): first the tests that start no vLLM engine, alone, one xdist worker per
  core (one OpenMP thread each); then the vLLM tests in one pytest, and beside them lint, the
  benchmarks' smoke runs and the README's programs (tests/test_examples.py: each starts its own server
  as a user's does, and checks its output). The vLLM tests mostly wait (polls, streams, store
  timeouts): they used under half a core over a whole run (2026-11-29). Servers beside the other tests
  (LANES=2) were measured no faster on 2 cores (45 min either way, 2026-11-27, when a start-up cost
  30-50 s of imports) and their contention failed timing-bound tests.
* `--lanes 2` (auto on 3-4 cores): the tests marked `vllm` in one lane, streamed live; in the other,
  with one OpenMP thread (so torch there never spins against a server's OpenMP threads): lint, the
  tests without a server, then the benchmarks' smoke runs.
* `--lanes 3` (auto above 4 cores): as 2, with the vLLM modules split in two lanes; the second (TP=1
  servers only) binds its servers' engines to core 1 (VLLM_CPU_OMP_THREADS_BIND), the first leaves
  vLLM's default (TP=1 on core 0, TP=2 on both).

Each lane's pytest writes a JUnit XML and its count of server start-ups (tests/conftest.py); the N
slowest tests over all lanes are printed, then the wall time and the start-ups, last. The exit status
is the first non-zero one of the lanes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TESTS = 5  # pytest's exit status when nothing was selected
PY = sys.executable
LINT = [
    [PY, "-m", "ruff", "check", "vllm_delta", "tests", "benchmarks"],
    [PY, "-m", "ruff", "format", "--check", "vllm_delta", "tests", "benchmarks"],
    [PY, "-m", "mypy"],
]
SMOKE_STORES = os.path.join(tempfile.gettempdir(), "vllm-delta-smoke-stores")  # publish_gpu clears its own
SMOKES = [
    ({"TRITON_INTERPRET": "1"}, [PY, "benchmarks/apply_gpu.py", "--smoke"]),
    ({}, [PY, "benchmarks/publish_gpu.py", "--smoke", "--store", SMOKE_STORES]),  # kept: open_parts reads them
    ({}, [PY, "benchmarks/open_parts.py", SMOKE_STORES, "--repeat", "2"]),
    ({}, [PY, "benchmarks/detect_gpu.py", "--smoke"]),
    ({"TRITON_INTERPRET": "1"}, [PY, "benchmarks/undo_gpu.py", "--smoke"]),
    ({}, [PY, "benchmarks/open_headers.py", "--model", "qwen3-moe-tiny", "--repeat", "1"]),
    ({}, [PY, "benchmarks/publish_sharded_cpu.py", "--model", "qwen3-moe-tiny", "--div", "1", "--steps", "1"]),
]
# The vLLM modules of the second lane with --lanes 3, about half of the vLLM lane's time: TP=1 servers
# only (the lane binds them to core 1; the TP=2 modules stay in the first lane, on both cores).
SECOND_VLLM_LANE = (
    "tests/integrations/test_trl.py",
    "tests/test_examples.py",
    "tests/vllm/test_fleet.py",
    "tests/vllm/test_regions.py",
    "tests/vllm/test_vllm_sharded.py",
)
EXAMPLES = "tests/test_examples.py"  # `make demo`, `make example`, `make example-trl`, as a user runs them
STARTUPS_FILE_ENV = "VLLM_DELTA_STARTUPS_FILE"  # where a pytest session writes its count of server start-ups


def lanes_for(cores: int) -> int:
    """One lane on 2 cores (two lanes were measured no faster there, and the contention failed timing-bound
    tests: docs/VLLM.md), two on 3-4 cores, three above."""
    return 1 if cores <= 2 else 2 if cores <= 4 else 3


@dataclass
class Lane:
    name: str
    steps: list[tuple[dict[str, str], list[str]]]  # (extra environment, command), run in order
    live: bool = False  # stream its output as it comes (else print it when the lane ends)
    junit: list[str] = field(default_factory=list)
    code: int = 0
    log: str = ""
    seconds: float = 0.0
    startups: str = ""  # the file its pytest writes its count of vLLM server start-ups to


def pytest_step(lane: str, marks: str, paths: list[str], extra: list[str], tmp: str) -> tuple[list[str], str]:
    junit = os.path.join(tmp, f"{lane}.xml")
    cmd = [PY, "-m", "pytest", "-q", "-m", marks, "-o", f"cache_dir=.pytest_cache/{lane}", f"--junitxml={junit}"]
    return [*cmd, *extra, *paths], junit


def within(module: str, paths: list[str]) -> bool:
    """Whether `module` is one of the test paths given or under one of them (a folder)."""
    module = os.path.normpath(module)
    for path in paths:
        path = os.path.normpath(path.split("::")[0])
        if module == path or module.startswith(path + os.sep):
            return True
    return False


def run_lane(lane: Lane) -> None:
    t0 = time.monotonic()
    out = sys.stdout if lane.live else open(lane.log, "w")
    try:
        for env, cmd in lane.steps:
            print(f"[{lane.name}] $ {' '.join(cmd)}", file=out, flush=True)
            code = subprocess.call(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
            if code == NO_TESTS and "pytest" in cmd:
                code = 0  # every test of the paths given is in another lane
            if code and not lane.code:
                lane.code = code
    finally:
        if out is not sys.stdout:
            out.close()
        lane.seconds = time.monotonic() - t0


def slowest(junits: list[str], n: int) -> list[tuple[float, str]]:
    times = []
    for path in junits:
        if not os.path.exists(path):
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            parts = (case.get("classname") or "").split(".")
            # tests.vllm.test_fleet, or tests.test_store_s3.TestS3Store: the module is the longest prefix
            # that is a file
            cut = next(
                (i for i in range(len(parts), 0, -1) if os.path.isfile(os.path.join(ROOT, *parts[:i]) + ".py")), 0
            )
            where = "/".join(parts[:cut]) + ".py::" + "::".join([*parts[cut:], case.get("name") or ""])
            times.append((float(case.get("time") or 0), where))
    return sorted(times, reverse=True)[:n]


def plan(
    lanes_n: int, paths: list[str], extra: list[str], tmp: str, lint: list, smokes: list
) -> tuple[Lane | None, list[Lane]]:
    """What runs first (alone), then the lanes that run side by side."""
    interpret = {"TRITON_INTERPRET": "1"}
    quiet = {"OMP_NUM_THREADS": "1"}  # torch there never spins against a server's OpenMP threads
    checks = [*lint, *[({**env, **quiet}, c) for env, c in smokes]]
    if lanes_n == 1:
        # The tests that start no vLLM engine first, alone, one xdist worker per core (each test single-
        # threaded; a module's tests in one worker: its module fixtures are made once). Then the vLLM tests
        # in one process (one server start-up at a time, beside the module's tests that run before it:
        # pooled.py), and beside them lint and the smoke runs, single-threaded: the vLLM tests keep about
        # one core busy (CPU 70% of one core over a run, 2026-11-29), the checks take the other.
        workers = ["-n", str(os.cpu_count() or 1), "--dist", "loadfile"]
        rest, rest_junit = pytest_step("rest", "not vllm and not gpu", paths, [*workers, *extra], tmp)
        first = Lane("rest", [({**interpret, **quiet}, rest)], live=True, junit=[rest_junit])
        # The programs the README runs (EXAMPLES: each starts its own server, as a user's does) run in the
        # checks' lane, after them: their servers are not the session's, and their checks are their output.
        examples = [p for p in (EXAMPLES,) if within(p, paths)]
        vllm, vllm_junit = pytest_step("vllm", "vllm and not gpu", paths, [f"--deselect={EXAMPLES}", *extra], tmp)
        lanes = [Lane("vllm", [(interpret, vllm)], live=True, junit=[vllm_junit]), Lane("checks", checks)]
        if examples:
            cmd, junit = pytest_step("examples", "vllm and not gpu", examples, extra, tmp)
            lanes[1].steps.append(({}, cmd))
            lanes[1].junit.append(junit)
        return first, lanes
    lanes: list[Lane] = []
    vllm_paths = list(paths)
    if lanes_n == 3:
        second = [p for p in SECOND_VLLM_LANE if within(p, paths)]
        cmd, junit = pytest_step("vllm-b", "vllm and not gpu", second, extra, tmp)
        if second:
            lanes.append(Lane("vllm-b", [({**interpret, "VLLM_CPU_OMP_THREADS_BIND": "1"}, cmd)], junit=[junit]))
        vllm_paths = [*(f"--deselect={p}" for p in second), *vllm_paths]
    cmd, junit = pytest_step("vllm", "vllm and not gpu", vllm_paths, extra, tmp)
    lanes.insert(0, Lane("vllm", [(interpret, cmd)], live=True, junit=[junit]))
    cmd, junit = pytest_step("rest", "not vllm and not gpu", paths, extra, tmp)
    lanes.append(Lane("rest", [*lint, ({**interpret, **quiet}, cmd), *checks[len(lint) :]], junit=[junit]))
    return None, lanes


def run_all(lanes: list[Lane], tmp: str) -> None:
    for lane in lanes:
        lane.log = os.path.join(tmp, f"{lane.name}.log")
        lane.startups = os.path.join(tmp, f"{lane.name}.startups")
        lane.steps = [({**env, STARTUPS_FILE_ENV: lane.startups}, cmd) for env, cmd in lane.steps]
    threads = [threading.Thread(target=run_lane, args=(lane,), name=lane.name) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lane in lanes:
        if not lane.live:
            print(f"\n========== lane {lane.name} ==========", flush=True)
            with open(lane.log) as f:
                sys.stdout.write(f.read())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lanes", default="auto", help="1, 2, 3 or auto (by the machine's cores: lanes_for)")
    ap.add_argument("--durations", type=int, default=15, help="list the N slowest tests of all lanes")
    ap.add_argument("--no-lint", action="store_true", help="skip ruff and mypy")
    ap.add_argument("--no-smoke", action="store_true", help="skip the benchmarks' smoke runs")
    args, extra = ap.parse_known_args(argv)
    t_start = time.monotonic()
    lanes_n = lanes_for(os.cpu_count() or 1) if args.lanes == "auto" else int(args.lanes)
    if lanes_n not in (1, 2, 3):
        ap.error(f"--lanes {args.lanes}: 1, 2, 3 or auto")
    # Paths among the other arguments replace `tests` (e.g. one module); the rest go to every pytest.
    paths = [a for a in extra if not a.startswith("-") and os.path.exists(os.path.join(ROOT, a.split("::")[0]))]
    extra = [a for a in extra if a not in paths]
    paths = paths or ["tests"]
    tmp = tempfile.mkdtemp(prefix="vllm-delta-lanes-")
    lint = [] if args.no_lint else [({}, c) for c in LINT]
    first, lanes = plan(lanes_n, paths, extra, tmp, lint, [] if args.no_smoke else SMOKES)
    done = [first] if first is not None else []
    if first is not None:
        run_all([first], tmp)
    run_all(lanes, tmp)
    done += lanes
    if args.durations:
        print(f"\n========== the {args.durations} slowest tests (setup + call + teardown), all lanes ==========")
        for seconds, name in slowest([j for lane in done for j in lane.junit], args.durations):
            print(f"{seconds:9.2f}s  {name}")
    print()
    for lane in done:
        status = "ok" if lane.code == 0 else f"FAILED (exit {lane.code})"
        print(f"lane {lane.name}: {status} in {lane.seconds:.0f} s")
    startups = sum(read_count(lane.startups) for lane in done)
    wall = time.monotonic() - t_start
    print(
        f"make test: {wall / 60:.1f} min ({wall:.0f} s) on {os.cpu_count()} cores ({len(lanes)} lanes side by side), "
        f"{startups} vLLM server start-ups (the budget: 20 min on 2 cores, docs/VLLM.md)"
    )
    return next((lane.code for lane in done if lane.code), 0)


def read_count(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
