"""vLLM's own routes that can change the weights past the plugin's API process.

The API process keeps what the workers serve current by itself (every update goes through the
service), so status needs no worker call. vLLM's dev-mode routes can still write the weights without
the service: the native RL API (`/update_weights`, `/finish_weight_update`, with any weight-transfer
backend, ours included), `/wake_up` (weights reloaded after sleep), and `/collective_rpc` (any worker
method). When one of them has answered, the service's view is marked stale before the answer reaches
the client: the next status (and a background task) re-reads the workers once, and the live checksum
is recomputed if they serve something else.
"""

from __future__ import annotations

from collections.abc import Callable

from .asgi import App, Message, Receive, Scope, Send

ROUTES = frozenset({"/update_weights", "/finish_weight_update", "/wake_up", "/collective_rpc"})


class PastThePluginMiddleware:
    """Pure ASGI middleware: after vLLM's own weight-changing routes, `mark()` (the service's
    `past_the_plugin`, looked up per request: the service exists only once the engine is up)."""

    def __init__(self, app: App, mark: Callable[[Scope], None]):
        self.app = app
        self.mark = mark

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in ROUTES:
            await self.app(scope, receive, send)  # heap: pass-through
            return
        marked = False

        async def sending(message: Message) -> None:
            nonlocal marked
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not marked:
                marked = True
                self.mark(scope)  # before the client sees the answer: its next status re-reads
            await send(message)

        try:
            await self.app(scope, receive, sending)  # heap: pass-through
        finally:
            if not marked:
                self.mark(scope)
