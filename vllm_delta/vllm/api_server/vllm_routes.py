"""vLLM's own routes that can change the weights past the plugin's API process.

The API process keeps what the workers serve current by itself (every update goes through the
service), so status needs no worker call. vLLM's dev-mode routes can still write the weights without
the service: the native RL API (`/update_weights`, `/finish_weight_update`, with any weight-transfer
backend, ours included), `/wake_up` (weights reloaded after sleep), `/collective_rpc` (any worker
method), `/weight_checker` (`{"action": "reset"}` zeroes every weight) and `/update_weight_version`
(relabels the weights, so the spans name another version). When one of them has answered, the
service's view is marked stale before the answer reaches the client: the next status (and a
background task) re-reads the workers once, and the live checksum is recomputed if they serve
something else. A reset leaves the workers' record of the served version as it was, so after one the
next status also recomputes the live sums from the weights: a verification (trigger "outside") that
names the tensors that changed, loudly (docs/VLLM.md, "Verification").
"""

from __future__ import annotations

import json
from collections.abc import Callable

from .asgi import App, Message, Receive, Scope, Send

ROUTES = frozenset(
    {
        "/update_weights",
        "/finish_weight_update",
        "/wake_up",
        "/collective_rpc",
        "/weight_checker",
        "/update_weight_version",
    }
)
CHECKER = "/weight_checker"


def resets_weights(path: str, body: bytes) -> bool:
    """Whether a request to one of ROUTES writes the weights without changing what the workers record
    as served: vLLM's `/weight_checker {"action": "reset"}` (a body that can't be read counts: the route
    could have acted on it all the same)."""
    if path != CHECKER:
        return False
    try:
        doc = json.loads(body)
    except ValueError:
        return True
    return not isinstance(doc, dict) or doc.get("action") not in ("checksum", "compare")


class PastThePluginMiddleware:
    """Pure ASGI middleware: after vLLM's own weight-changing routes, `mark(scope, reset)` (the service's
    `checks.past_the_plugin`, looked up per request: the service exists only once the engine is up); `reset`:
    the weights were written with the workers' record left as it was (`resets_weights`)."""

    def __init__(self, app: App, mark: Callable[[Scope, bool], None]):
        self.app = app
        self.mark = mark

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in ROUTES:
            await self.app(scope, receive, send)  # heap: pass-through
            return
        marked = False
        body: list[bytes] = []  # kept for /weight_checker only (a small JSON body)
        checker = scope["path"] == CHECKER

        async def receiving() -> Message:
            message = await receive()
            if checker and message.get("type") == "http.request":
                body.append(message.get("body", b""))
            return message

        def mark() -> None:
            nonlocal marked
            marked = True
            self.mark(scope, resets_weights(scope["path"], b"".join(body)))

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not marked:
                mark()  # before the client sees the answer: its next status re-reads
            await send(message)

        try:
            await self.app(scope, receiving, sending)  # heap: pass-through
        finally:
            if not marked:
                mark()
