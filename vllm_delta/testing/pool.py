"""vLLM servers for a test session, shared by configuration.

A server start-up costs 25-35 s on 2 cores (three processes, each importing vLLM and torch), so test
modules whose servers would be started with the same arguments share one:

    pool = ServerPool()
    spec = ServerSpec(model_dir, store=store, version=0, dev_mode=True)
    srv = pool.acquire(spec, reset=lambda s: s.update(0, allow_reanchor=True))   # started, or reused
    ...
    pool.release(srv)        # back to the pool, still running: the next acquire of `spec` reuses it
    pool.discard(srv)        # stopped (a test killed or damaged it)
    pool.prestart(spec)      # started in the background now, for an acquire to come
    pool.close()             # every server stopped

`reset` runs on a reused server before it is handed out: it puts the server back where a fresh start
would have it (through the plugin's own endpoints, e.g. a rollback to the first version). A reused
server that fails its health check or its reset is stopped and replaced by a fresh one.

Servers the pool holds and nobody uses are stopped once more than `max_idle` are idle, least recently
used first (never one started ahead and not yet acquired); `stop(spec)` stops one whose last user is
done (the test session knows: tests/pooled.py).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .server import VllmServer

log = logging.getLogger(__name__)


def _frozen(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class ServerSpec:
    """What a server is started with (VllmServer's arguments), hashable: two equal specs give
    interchangeable servers. Dicts are kept as canonical JSON."""

    model: str
    store: str | None = None
    version: int | str | None = "latest"
    load_format: str | None = "delta"
    tensor_parallel_size: int = 1
    api_key: str | None = None
    weight_transfer: bool = False
    dev_mode: bool = False
    loader_config: str = "{}"  # JSON of extra_loader_config
    extra_args: tuple[str, ...] = ()
    env: str = "{}"  # JSON of the extra environment
    max_model_len: int = 256
    worker_process: bool | None = None  # None: VllmServer's default (own processes only with several ranks)
    startup_timeout: float = field(default=300.0, compare=False)

    @classmethod
    def of(
        cls,
        model: str,
        *,
        extra_loader_config: dict | None = None,
        env: dict[str, str] | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        **kwargs: Any,
    ) -> ServerSpec:
        """VllmServer's keyword arguments, as a spec."""
        return cls(
            model,
            loader_config=_frozen(extra_loader_config or {}),
            env=_frozen(env or {}),
            extra_args=tuple(extra_args),
            **kwargs,
        )

    def server(self, log_path: str | None = None) -> VllmServer:
        return VllmServer(
            self.model,
            store=self.store,
            version=self.version,
            load_format=self.load_format,
            tensor_parallel_size=self.tensor_parallel_size,
            api_key=self.api_key,
            weight_transfer=self.weight_transfer,
            dev_mode=self.dev_mode,
            extra_loader_config=json.loads(self.loader_config),
            extra_args=list(self.extra_args),
            env=json.loads(self.env),
            max_model_len=self.max_model_len,
            startup_timeout=self.startup_timeout,
            log_path=log_path,
            worker_process=self.worker_process,
        )


@dataclass
class _Entry:
    spec: ServerSpec
    server: VllmServer
    busy: bool = False
    uses: int = 0
    reserved: bool = False  # started ahead of its user: never evicted before it is acquired
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class ServerPool:
    def __init__(self, max_idle: int = 1):
        self.max_idle = max_idle
        self._entries: list[_Entry] = []  # least recently used first
        self._lock = threading.Lock()
        self.started: list[ServerSpec] = []  # every start-up, in order
        self.reused = 0  # acquires answered by a server another user had
        self.prestarted = 0  # acquires answered by a server started ahead for them

    # -- handing servers out ------------------------------------------------------------------
    def acquire(self, spec: ServerSpec, *, reset: Callable[[VllmServer], None] | None = None) -> VllmServer:
        """A running server for `spec`: one started ahead for it (`prestart`), an idle one of the pool
        (after `reset`), or a new one."""
        entry = self._take_idle(spec)
        if entry is not None and entry.uses == 1 and entry.reserved:
            entry.ready.wait()
            entry.reserved = False
            if entry.error is None:
                self.prestarted += 1
                return entry.server  # fresh: nothing to reset
            log.warning("the vLLM server started ahead for %s failed (%s): starting it again", spec.model, entry.error)
            self._remove(entry)
            entry = None
        if entry is not None:
            try:
                if entry.server.get("/health", timeout=10).status_code != 200:
                    raise RuntimeError("not healthy")
                if reset is not None:
                    reset(entry.server)
            except Exception as exc:  # noqa: BLE001 - a broken pooled server is replaced, not fatal
                log.warning("pooled vLLM server %s could not be reused (%s): starting a new one", spec.model, exc)
                self._remove(entry)
            else:
                self.reused += 1
                return entry.server
        self._evict(keep=self.max_idle - 1)
        server = spec.server().start()
        with self._lock:
            self.started.append(spec)
            self._entries.append(_Entry(spec, server, busy=True, uses=1))
        return server

    def prestart(self, spec: ServerSpec) -> bool:
        """Start a server for `spec` in the background, for an `acquire` to come (unless the pool has
        one for it already). A failed start is raised by that `acquire`'s own new start."""
        with self._lock:
            if any(e.spec == spec and (e.reserved or not e.busy) for e in self._entries):
                return False
            entry = _Entry(spec, spec.server(), reserved=True)
            self._entries.append(entry)
            self.started.append(spec)

        def start() -> None:
            try:
                entry.server.start()
            except BaseException as exc:  # noqa: BLE001 - kept for the acquire that comes for it
                entry.error = exc
            finally:
                entry.ready.set()

        threading.Thread(target=start, name=f"prestart {spec.model}", daemon=True).start()
        return True

    def release(self, server: VllmServer) -> None:
        """Back to the pool, running. A server whose process is gone is dropped."""
        entry = self._entry_of(server)
        if server.proc is None or server.proc.poll() is not None:
            self._remove(entry)
            return
        with self._lock:
            entry.busy = False
            self._entries.remove(entry)
            self._entries.append(entry)  # most recently used last
        self._evict(keep=self.max_idle)

    def discard(self, server: VllmServer) -> None:
        """Stopped and forgotten (a test killed it, or left it in a state no reset undoes)."""
        self._remove(self._entry_of(server))

    @contextmanager
    def lease(self, spec: ServerSpec, *, reset: Callable[[VllmServer], None] | None = None) -> Iterator[VllmServer]:
        """`acquire` ... `release`; a server whose user raised is discarded."""
        server = self.acquire(spec, reset=reset)
        try:
            yield server
        except BaseException:
            self.discard(server)
            raise
        if self._has(server):
            self.release(server)

    def stop(self, spec: ServerSpec) -> None:
        """Stop the idle servers of `spec` (their last user is done)."""
        with self._lock:
            doomed = [e for e in self._entries if e.spec == spec and not e.busy]
        for entry in doomed:
            self._remove(entry)

    def close(self) -> None:
        with self._lock:
            entries, self._entries = self._entries, []
        for entry in entries:
            if entry.reserved:  # still starting, maybe: let it finish, then stop it
                entry.ready.wait(timeout=entry.spec.startup_timeout)
            entry.server.stop()

    # -- bookkeeping ----------------------------------------------------------------------------
    def _take_idle(self, spec: ServerSpec) -> _Entry | None:
        with self._lock:
            for entry in self._entries:
                if entry.spec == spec and not entry.busy:
                    entry.busy = True
                    entry.uses += 1
                    return entry
        return None

    def _entry_of(self, server: VllmServer) -> _Entry:
        with self._lock:
            for entry in self._entries:
                if entry.server is server:
                    return entry
        raise KeyError("this server is not the pool's")

    def _has(self, server: VllmServer) -> bool:
        with self._lock:
            return any(e.server is server for e in self._entries)

    def _remove(self, entry: _Entry) -> None:
        with self._lock:
            if entry in self._entries:
                self._entries.remove(entry)
        entry.server.stop()

    def _evict(self, keep: int) -> None:
        with self._lock:
            idle = [e for e in self._entries if not e.busy and not e.reserved]
            doomed = idle[: max(0, len(idle) - max(0, keep))]
        for entry in doomed:
            self._remove(entry)

    def summary(self) -> str:
        return (
            f"{len(self.started)} start-ups by the pool, {self.prestarted} of them ahead of their module, "
            f"{self.reused} reuses of a server another module had"
        )


__all__ = ["ServerPool", "ServerSpec"]
