"""`make test`: the CPU suite in lanes that run side by side, then the slowest tests of all lanes.

    python tests/run_lanes.py [--lanes 1|2|3] [--durations N]

Why lanes: most of the suite's time is vLLM server start-ups, and a start-up is one process importing
vLLM and torch at a time (three in a row: API server, engine core, worker); the tests that start no
server are single-threaded. So one core mostly idles while either runs alone.

* `--lanes 1`: one pytest over everything (what `pytest -m "not gpu" tests` does).
* `--lanes 2` (default): the tests marked `vllm` in one lane, streamed live; in the other, with one
  OpenMP thread (so torch there never spins against a server's OpenMP threads): lint, the tests
  without a server, then the benchmarks' smoke runs. One vLLM lane: servers never start side by side
  beyond what a module does itself.
  The vLLM-marked modules that start no server and no engine (SERVERLESS_VLLM) run in the rest lane
  too, after its own tests: the vLLM lane is the longer one.
* `--lanes 3`: as 2, with the vLLM modules split in two lanes; the second (TP=1 servers only) binds
  its servers' engines to core 1 (VLLM_CPU_OMP_THREADS_BIND), the first leaves vLLM's default (TP=1 on
  core 0, TP=2 on both). Up to two modules' servers run at once: more memory, and timing-sensitive
  tests share the cores.

Each lane's pytest writes a JUnit XML; the N slowest tests over all lanes are printed last. The exit
status is the first non-zero one of the lanes.
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
    ({}, [PY, "benchmarks/open_headers.py", "--model", "qwen3-moe-tiny", "--repeat", "1"]),
    ({}, [PY, "benchmarks/publish_sharded_cpu.py", "--model", "qwen3-moe-tiny", "--div", "1", "--steps", "1"]),
]
# Modules marked `vllm` that start no server and no engine (vLLM's own classes, the plugin's code on toy
# replicas): single-threaded like the rest, so with --lanes 2 or 3 they run in the rest lane, which
# ends minutes before the vLLM lane (that lane is server start-ups and tests against servers).
SERVERLESS_VLLM = (
    "tests/vllm/test_data_parallel_units.py",
    "tests/vllm/test_gating_units.py",
    "tests/vllm/test_vllm_derived.py",
    "tests/vllm/test_vllm_round_trips.py",
)
# The vLLM modules of the second lane with --lanes 3, about half of the vLLM lane's time: TP=1 servers
# only (the lane binds them to core 1; the TP=2 modules stay in the first lane, on both cores).
SECOND_VLLM_LANE = (
    "tests/integrations/test_trl.py",
    "tests/test_examples.py",
    "tests/vllm/test_fleet.py",
    "tests/vllm/test_regions.py",
    "tests/vllm/test_vllm_sharded.py",
)


@dataclass
class Lane:
    name: str
    steps: list[tuple[dict[str, str], list[str]]]  # (extra environment, command), run in order
    live: bool = False  # stream its output as it comes (else print it when the lane ends)
    junit: list[str] = field(default_factory=list)
    code: int = 0
    log: str = ""
    seconds: float = 0.0


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lanes", type=int, choices=(1, 2, 3), default=2)
    ap.add_argument("--durations", type=int, default=15, help="list the N slowest tests of all lanes")
    ap.add_argument("--no-lint", action="store_true", help="skip ruff and mypy")
    ap.add_argument("--no-smoke", action="store_true", help="skip the benchmarks' smoke runs")
    args, extra = ap.parse_known_args(argv)
    # Paths among the other arguments replace `tests` (e.g. one module); the rest go to every pytest.
    paths = [a for a in extra if not a.startswith("-") and os.path.exists(os.path.join(ROOT, a.split("::")[0]))]
    extra = [a for a in extra if a not in paths]
    paths = paths or ["tests"]
    tmp = tempfile.mkdtemp(prefix="vllm-delta-lanes-")
    lint = [] if args.no_lint else [({}, c) for c in LINT]
    smokes = [] if args.no_smoke else SMOKES
    interpret = {"TRITON_INTERPRET": "1"}
    lanes: list[Lane] = []
    if args.lanes == 1:
        cmd, junit = pytest_step("all", "not gpu", paths, extra, tmp)
        lanes.append(Lane("all", [*lint, (interpret, cmd), *smokes], live=True, junit=[junit]))
    else:
        serverless = [p for p in SERVERLESS_VLLM if within(p, paths)]
        vllm_paths = [*(f"--deselect={p}" for p in serverless), *paths]
        if args.lanes == 3:
            second = [p for p in SECOND_VLLM_LANE if within(p, paths)]
            cmd, junit = pytest_step("vllm-b", "vllm and not gpu", second, extra, tmp)
            if second:
                lanes.append(Lane("vllm-b", [({**interpret, "VLLM_CPU_OMP_THREADS_BIND": "1"}, cmd)], junit=[junit]))
            vllm_paths = [*(f"--deselect={p}" for p in second), *vllm_paths]
        cmd, junit = pytest_step("vllm", "vllm and not gpu", vllm_paths, extra, tmp)
        lanes.insert(0, Lane("vllm", [(interpret, cmd)], live=True, junit=[junit]))
        quiet = {"OMP_NUM_THREADS": "1"}
        cmd, junit = pytest_step("rest", "not vllm and not gpu", paths, extra, tmp)
        steps = [*lint, ({**interpret, **quiet}, cmd)]
        junits = [junit]
        if serverless:
            cmd, junit = pytest_step("rest-vllm", "vllm and not gpu", serverless, extra, tmp)
            steps.append(({**interpret, **quiet}, cmd))
            junits.append(junit)
        steps += [({**env, **quiet}, c) for env, c in smokes]
        lanes.append(Lane("rest", steps, junit=junits))
    for lane in lanes:
        lane.log = os.path.join(tmp, f"{lane.name}.log")
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
    if args.durations:
        print(f"\n========== the {args.durations} slowest tests (setup + call + teardown), all lanes ==========")
        for seconds, name in slowest([j for lane in lanes for j in lane.junit], args.durations):
            print(f"{seconds:9.2f}s  {name}")
    print()
    for lane in lanes:
        status = "ok" if lane.code == 0 else f"FAILED (exit {lane.code})"
        print(f"lane {lane.name}: {status} in {lane.seconds:.0f} s")
    return next((lane.code for lane in lanes if lane.code), 0)


if __name__ == "__main__":
    raise SystemExit(main())
