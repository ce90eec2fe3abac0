"""The HTTP routes (a vLLM endpoint plugin): /v1/delta/update_weights, /v1/delta/stage, /v1/delta/status.

Under /v1 so that vLLM's --api-key guards them. Clients send versions, never paths or URIs: the
store is fixed when the server starts (options.py). With "delta_follow" (or "delta_report") a
Follower (follower.py) runs beside the service in the server's event loop, from `init_state` until
the app shuts down. Errors answer with {"error": {...}} and the
status of the exception (errors.py): 400 malformed, 404 unknown version, 409 not a successor,
422 integrity failure; the server keeps serving the previous version in every case.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..errors import BadRequestError, DeltaError, http_status
from .follower import Follower
from .messages import StageRequest, UpdateRequest
from .options import FollowOptions, server_options
from .service import DeltaService

log = logging.getLogger(__name__)

PREFIX = "/v1/delta"
STATE_KEY = "vllm_delta_service"


class JsonAnswer(Protocol):
    def to_json(self) -> dict[str, Any]: ...


def _error(exc: BaseException) -> JSONResponse:
    status = http_status(exc)
    if status >= 500:
        log.error("vllm-delta: %s", exc, exc_info=exc)
    return JSONResponse(status_code=status, content={"error": {"type": type(exc).__name__, "message": str(exc)}})


def route(handler: Callable[[Request], Awaitable[JsonAnswer]]) -> Callable[[Request], Awaitable[JSONResponse]]:
    """A route's one exit: the answer's JSON with 200, or any exception as {"error": {"type", "message"}}
    with its status (errors.http_status); 5xx are logged with their traceback."""

    async def answer(request: Request) -> JSONResponse:
        try:
            return JSONResponse((await handler(request)).to_json())
        except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
            return _error(exc)

    # Not functools.wraps: FastAPI would read the handler's signature through __wrapped__ and make a
    # response model of its return annotation.
    answer.__name__, answer.__qualname__, answer.__doc__ = handler.__name__, handler.__qualname__, handler.__doc__
    return answer


def _service(request: Request) -> DeltaService:
    service = getattr(request.app.state, STATE_KEY, None)
    if service is None:
        raise DeltaError(
            "vllm-delta has no store: start the server with --load-format delta and "
            "--model-loader-extra-config '{\"delta_store\": URI}', or set VLLM_DELTA_STORE"
        )
    return service


async def _body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequestError(f"the body is not JSON: {exc}") from None


class DeltaEndpointPlugin:
    """Entry point `vllm.endpoint_plugins: vllm_delta_api` (a zero-argument class)."""

    name = "vllm_delta_api"
    required_tasks = ("generate",)  # needs an engine: not on the render-only server

    def __init__(self) -> None:
        self.follower: Follower | None = None

    def attach_router(self, app: FastAPI) -> None:
        self._stop_follower_on_shutdown(app)

        @app.post(f"{PREFIX}/update_weights")
        @route
        async def update_weights(request: Request) -> JsonAnswer:
            service = _service(request)
            return await service.update(UpdateRequest.from_body(await _body(request)))

        @app.post(f"{PREFIX}/stage")
        @route
        async def stage(request: Request) -> JsonAnswer:
            service = _service(request)
            return await service.stage(StageRequest.from_body(await _body(request)))

        @app.get(f"{PREFIX}/status")
        @route
        async def status(request: Request) -> JsonAnswer:
            return await _service(request).status()

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is None:
            return
        load = getattr(getattr(engine_client, "vllm_config", None), "load_config", None)
        if load is not None:
            options = server_options(load.load_format, load.model_loader_extra_config)
        else:
            options = server_options(
                getattr(args, "load_format", None), getattr(args, "model_loader_extra_config", None)
            )
        if options is None:
            log.warning("vllm-delta: no store configured; /v1/delta/* will answer 500 until one is")
            return
        service = DeltaService(engine_client, options.store)
        setattr(state, STATE_KEY, service)
        log.info("vllm-delta: /v1/delta/* serve versions of %s", options.store.uri)
        if options.follow.follow or options.follow.report:
            self.follower = start_follower(service, options.follow)

    def _stop_follower_on_shutdown(self, app: FastAPI) -> None:
        """Wrap the app's lifespan (vLLM's) so that the follower stops before the engine goes away:
        Starlette runs no shutdown handlers of its own once an app has a lifespan."""
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a: Any) -> AsyncIterator[Any]:
            async with inner(a) as value:
                try:
                    yield value
                finally:
                    if self.follower is not None:
                        await self.follower.stop()
                        self.follower = None

        app.router.lifespan_context = lifespan


def start_follower(service: DeltaService, options: FollowOptions) -> Follower:
    """A Follower whose every update goes through the service (its lock, staging, verification,
    two-phase commit and rollback), started as a task of the running event loop."""

    async def apply(version: int) -> float | None:
        result = await service.follow_update(version, options.mode)
        return None if result is None else result.pause_ms

    follower = Follower(service.store, options, served=service.served_version, apply=apply, checksums=service.checksums)
    service.follow_status = lambda: follower.status
    follower.start()
    what = "following" if options.follow else "reporting to the ledger of"
    log.info("vllm-delta: %s %s (poll every %.1f s)", what, service.store.uri, options.poll_s)
    return follower
