"""Pooled vLLM servers for test modules (imported by name: tests/ is on sys.path).

    llama_server = pooled_server("llama_server", build)      # in a conftest or a test module

declares a module-scoped fixture `llama_server`: a server of the session's pool (server_pool,
vllm_delta/testing/pool.py) built by `build(**session_fixtures) -> (ServerSpec, reset or None)`,
whose parameters name session-scoped fixtures only. So the session can

* share it: modules using the same fixture get the same server (the pool's `reset` puts a reused
  one back where a fresh one would be), and run back to back (tests/conftest.py orders them);
* start it ahead: at the first test of a module, the server of the next module that uses a pooled
  fixture starts in the background (`prestart_next`), so that its start-up (mostly one process
  importing vLLM and torch at a time) overlaps the tests before it;
* stop it after its last user.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from vllm_delta.testing.pool import ServerSpec
from vllm_delta.testing.server import VllmServer

log = logging.getLogger(__name__)

Reset = Callable[[VllmServer], None]
Build = Callable[..., tuple[ServerSpec, Reset | None]]


@dataclass(frozen=True)
class Pooled:
    name: str
    build: Build
    params: tuple[str, ...]


REGISTRY: dict[str, Pooled] = {}


def pooled_server(name: str, build: Build):
    """The module-scoped fixture `name` (assign it to that name in a conftest or test module)."""
    pooled = REGISTRY[name] = Pooled(name, build, tuple(inspect.signature(build).parameters))

    @pytest.fixture(scope="module", name=name)
    def fixture(request, server_pool):
        spec, reset = plan(pooled, request.getfixturevalue)
        srv = server_pool.acquire(spec, reset=reset)
        yield srv
        if later_users(request, name):
            server_pool.release(srv)
        else:
            server_pool.discard(srv)

    return fixture


def plan(pooled: Pooled, value: Callable[[str], object]) -> tuple[ServerSpec, Reset | None]:
    return pooled.build(**{p: value(p) for p in pooled.params})


def later_users(request, fixture: str) -> bool:
    """Whether a test that runs after the module of `request` (a module-scoped fixture's) uses `fixture`."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    return any(fixture in getattr(item, "fixturenames", ()) for item in items[max(mine) + 1 :])


def pooled_fixtures(item) -> set[str]:
    return {f for f in getattr(item, "fixturenames", ()) if f in REGISTRY}


def prestart_next(item) -> None:
    """At the first test of a module: start the pooled servers of the module that runs next (those this
    module does not use itself), through the next module's own view of the session fixtures. Only the
    next module's: a server started further ahead would sit idle, holding its memory, for longer."""
    items = item.session.items
    index = items.index(item)
    if index and items[index - 1].module is item.module:
        return  # not the module's first test
    nxt = next((other for other in items[index + 1 :] if other.module is not item.module), None)
    if nxt is None:
        return
    mine = {f for other in items if other.module is item.module for f in pooled_fixtures(other)}
    names = sorted({f for other in items if other.module is nxt.module for f in pooled_fixtures(other)} - mine)
    if not names:
        return
    pool = item._request.getfixturevalue("server_pool")
    for name in names:
        try:
            spec, _ = plan(REGISTRY[name], nxt._request.getfixturevalue)
        except Exception as exc:  # noqa: BLE001 - the module's own fixture raises it where it belongs
            log.warning("cannot start %s ahead: %s", name, exc)
            continue
        pool.prestart(spec)
