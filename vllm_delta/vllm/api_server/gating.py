"""Version gating of generation requests: the oldest policy version a request accepts.

POST /v1/completions and /v1/chat/completions, streamed or not, may name a bound: the body field
`min_weight_version` (an OpenAI client sends it through `extra_body`) or the header
`X-Min-Weight-Version` (server_api.py names both; both at once must agree). Then:

    served >= bound   the request runs as usual (its `weight_versions` spans show the versions)
    served <  bound   it waits for an update that reaches the bound (woken by the update, never by
                      polling), at most `delta_min_version_wait_s` (default 5 s), then runs; or it is
                      answered 409 `WeightVersionBehindError` naming the served and required versions.
                      It never runs on older weights.
    malformed bound   400 (negative, not an integer, above any storable version, header and body
                      disagreeing); nothing else happens

    VersionGate            what the API process knows of the served version, the update in progress,
                           and the bounds of the requests running now
    VersionGateMiddleware  pure ASGI middleware in front of the two routes (inside vLLM's --api-key
                           check: endpoint plugins attach before vLLM adds its own middleware)

**A request admitted at >= N never runs on weights older than N, by construction:**

* the served version changes only through updates of the service (API updates and the follower),
  and every update tells the gate: `begin_update(target)` before it stages, `end_update` after;
* the gate admits a request only when min(served, the target of the update in progress) >= its
  bound, and registers it in the same event-loop step (no await between the check and the count);
* `begin_update(target)` refuses a target below the bound of any running request
  (VersionBoundConflictError, 409), in the same step as it records the target: while a downgrade
  is written, no request with a higher bound is admitted, and none was running;
* an update's writes are every rank or none (shared/two_phase.py): a failed one leaves the previous weights (>= N).

So only an upgrade can be written under a running bounded request: keep mode preempts it and recomputes
its KV on the new weights, in-flight mode continues it on the new weights; either way >= N. A downgrade
(a push of an older version; a follower leaving a version marked bad) is refused while running
requests need more. A follower leaving a marked version first `hold_at`s the version it goes back to:
from then on the server admits requests as one serving that version (behind: bounds above it wait, then
409), so the requests running above it end and its next try goes through. The hold lifts when the
served version changes. Updates made past the plugin (vLLM's own RL routes in dev mode) are not seen by
the gate.

vLLM's OpenAI server accepts unknown body fields (`OpenAIBaseModel`: `extra="allow"`, logged at
debug level and otherwise ignored), so the body is passed on unchanged.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from ...errors import BadRequestError, DeltaError, VersionBoundConflictError, WeightVersionBehindError, error_type
from ...server_api import MIN_VERSION_FIELD, MIN_VERSION_HEADER, min_version_of
from .asgi import App, Message, Receive, Scope, Send
from .metrics import GateOutcome, metrics
from .spans import PATHS

_HEADER = MIN_VERSION_HEADER.lower().encode()
_FIELD = MIN_VERSION_FIELD.encode()
RETRY_AFTER_S = 1  # what a 409 suggests: a follower polls every few seconds
HELD_HEADER = b"x-weight-version-held-ms"  # on an admitted bounded request: how long the gate held it


class VersionGate:
    """Admits bounded requests against the served version; refuses updates that would break a bound.

    Lives in the API process's event loop. The service tells it the served version (`note_served`) and
    every update (`begin_update` / `end_update`); the middleware asks it to `admit` and `release`."""

    def __init__(self, wait_s: float = 0.0):
        self.wait_s = wait_s  # how long a request waits for its bound (the service sets it)
        self._served: int | None = None
        self._updating: int | None = None  # target of the update in progress
        self._held: int | None = None  # hold_at: admit as if this version were served (a downgrade to come)
        self._running: Counter[int] = Counter()  # bound -> requests running with it
        self._changed: asyncio.Event | None = None  # set (and replaced) when the floor may have risen

    @property
    def served(self) -> int | None:
        return self._served

    @property
    def running(self) -> dict[int, int]:
        """Bound -> requests running with it now."""
        return dict(self._running)

    def floor(self) -> int | None:
        """The oldest version a request admitted now could run on: the served one, or the target of the
        update in progress when that is older (None: no version is served)."""
        if self._served is None:
            return None
        return min(v for v in (self._served, self._updating, self._held) if v is not None)

    def note_served(self, version: int | None) -> None:
        if version != self._served:
            self._served = version
            self._held = None  # what the hold was for is done (or moot: another update came first)
            self._wake()

    def hold_at(self, version: int) -> None:
        """A downgrade to `version` is coming (a follower leaving a marked version): admit requests as if it
        were served now, until the served version changes."""
        self._held = version

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def admit(self, bound: int) -> float:
        """Wait until the floor reaches `bound` (at most `wait_s`) and register the request: the seconds it
        was held (0.0: admitted at once). WeightVersionBehindError (409) when the floor did not reach it.
        `release(bound)` when the request ends."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        waited = False
        while True:
            floor = self.floor()
            if floor is not None and floor >= bound:
                self._running[bound] += 1  # same step as the check: no update can slip in between
                return loop.time() - t0 if waited else 0.0
            left = t0 + self.wait_s - loop.time()
            if left <= 0:
                raise self._behind(bound, loop.time() - t0)
            if self._changed is None:
                self._changed = asyncio.Event()
            waited = True
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def release(self, bound: int) -> None:
        self._running[bound] -= 1
        if self._running[bound] <= 0:
            del self._running[bound]

    def _behind(self, bound: int, waited_s: float) -> WeightVersionBehindError:
        served = self._served
        what = "no store version" if served is None else f"weight version {served}"
        updating = "" if self._updating is None else f"; an update to version {self._updating} is in progress"
        return WeightVersionBehindError(
            f"this server serves {what}; the request needs {MIN_VERSION_FIELD} {bound} "
            f"(waited {waited_s:.1f} s of at most {self.wait_s:g} s{updating})",
            served=served,
            required=bound,
        )

    def begin_update(self, target: int) -> None:
        """An update to `target` is about to stage: refused (409) if a running request needs more."""
        highest = max(self._running, default=None)
        if highest is not None and target < highest:
            count = sum(n for b, n in self._running.items() if b > target)
            raise VersionBoundConflictError(
                f"an update to version {target} would run {count} running request(s) below their "
                f"{MIN_VERSION_FIELD} (up to {highest}); nothing was applied: retry once they end"
            )
        self._updating = target

    def end_update(self) -> None:
        self._updating = None
        self._wake()  # a failed downgrade leaves the floor where it was: waiters may pass now


def error_body(exc: DeltaError, status: int) -> bytes:
    """An error answer in vLLM's OpenAI format ({"error": {"message", "type", "param", "code"}}), with the
    served and required versions of a WeightVersionBehindError."""
    error: dict[str, Any] = {
        "message": str(exc),
        "type": error_type(exc),
        "param": MIN_VERSION_FIELD,
        "code": status,
    }
    if isinstance(exc, WeightVersionBehindError):
        error["served_version"] = exc.served
        error["required_version"] = exc.required
    return json.dumps({"error": error}).encode()


class VersionGateMiddleware:
    """Pure ASGI middleware: gates POST /v1/completions and /v1/chat/completions by their version bound.

    The body is read here (the bound may be in it) and replayed unchanged to the app. It is parsed only
    when the field's name appears in it, or when it holds a JSON escape (`\\u`) that could spell it."""

    def __init__(self, app: App, gate: VersionGate):
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)  # heap: pass-through
            return
        headers = [bytes(v).decode("latin-1") for k, v in scope.get("headers", []) if bytes(k).lower() == _HEADER]
        received: list[Message] = []
        body = bytearray()
        while True:  # the whole body (vLLM reads it whole too), kept to replay
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            bound = min_version_of(headers, _parsed(bytes(body)))
        except BadRequestError as exc:
            _count("malformed")
            await _answer(send, 400, error_body(exc, 400))
            return

        async def replay() -> Message:
            return received.pop(0) if received else await receive()

        if bound is None:
            await self.app(scope, replay, send)  # heap: pass-through
            return
        try:
            held_s = await self.gate.admit(bound)
        except WeightVersionBehindError as exc:
            _count("refused")
            await _answer(send, 409, error_body(exc, 409), [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        try:
            _count("held" if held_s > 0 else "ran")
            await self.app(scope, replay, _with_header(send, HELD_HEADER, f"{held_s * 1e3:.0f}"))  # heap: pass-through
        finally:
            self.gate.release(bound)


def _count(outcome: GateOutcome) -> None:
    m = metrics()
    if m is not None:
        m.gate(outcome)


def _parsed(body: bytes) -> Any:
    """The JSON body when it may carry the bound (None when it can't, or is not JSON: vLLM answers that)."""
    if _FIELD not in body and b"\\u" not in body:
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _with_header(send: Send, name: bytes, value: str) -> Send:
    """`send` with one more header on the response start."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value.encode())]}
        await send(message)

    return sending


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    start_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": start_headers + list(headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})
