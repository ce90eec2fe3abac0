"""Pooled vLLM servers for test modules (imported by name: tests/ is on sys.path).

    llama_server = pooled_server("llama_server", plan)      # in a conftest or a test module

declares a module-scoped fixture `llama_server`: a server of the session's pool (server_pool,
vllm_delta/testing/pool.py) as `plan(tmp_path_factory) -> (ServerSpec, reset or None)` describes it.
A plan builds what the server needs (published runs, stores) through `once` (vllm_helpers.py), so the
session fixtures and the plans share them, and it can run from any test. So the session can

* share a server: modules using the same fixture get the same server (the pool's `reset` puts a
  reused one back where a fresh one would be), and run back to back (tests/conftest.py orders them);
* start it ahead: during the first test of a module, the server of the module that runs next starts
  in the background (`prestart_next`), so that its start-up (mostly one process importing vLLM and
  torch at a time) overlaps the tests before it;
* stop it after its last user.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from vllm_delta.testing.pool import ServerSpec
from vllm_delta.testing.server import VllmServer

log = logging.getLogger(__name__)
T = TypeVar("T")

Reset = Callable[[VllmServer], None]
Plan = Callable[[Any], tuple[ServerSpec, Reset | None]]  # tmp_path_factory -> the server, its reset

REGISTRY: dict[str, Plan] = {}


def pooled_server(name: str, plan: Plan):
    """The module-scoped fixture `name` (assign it to that name in a conftest or test module)."""
    REGISTRY[name] = plan

    @pytest.fixture(scope="module", name=name)
    def fixture(request, server_pool, tmp_path_factory):
        spec, reset = plan(tmp_path_factory)
        srv = server_pool.acquire(spec, reset=reset)
        yield srv
        if later_users(request, name):
            server_pool.release(srv)
        else:
            server_pool.discard(srv)

    return fixture


def later_users(request, fixture: str) -> bool:
    """Whether a test that runs after the module of `request` (a module-scoped fixture's) uses `fixture`."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    return any(fixture in getattr(item, "fixturenames", ()) for item in items[max(mine) + 1 :])


def pooled_fixtures(item) -> set[str]:
    return {f for f in getattr(item, "fixturenames", ()) if f in REGISTRY}


def prestart_next(item) -> None:
    """During the first test of a module: start the pooled servers of the module that runs next (those
    this module does not use itself). Only the next module's: a server started further ahead would sit
    idle, holding its memory, for longer."""
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
    tmp_path_factory = item._request.getfixturevalue("tmp_path_factory")
    for name in names:
        try:
            spec, _ = REGISTRY[name](tmp_path_factory)
        except Exception as exc:  # noqa: BLE001 - the module's own fixture raises it where it belongs
            log.warning("cannot start %s ahead: %s", name, exc)
            continue
        pool.prestart(spec)


def once(key: str, make: Callable[[], T]) -> T:
    """`make()`'s value, made once per session (a published run, a store): what a session fixture and
    a plan that runs before its module both need."""
    if key not in _ONCE:
        _ONCE[key] = make()
    return _ONCE[key]


_ONCE: dict[str, Any] = {}
