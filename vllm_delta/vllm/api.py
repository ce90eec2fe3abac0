"""The HTTP routes (a vLLM endpoint plugin): /v1/delta/update_weights, /v1/delta/stage, /v1/delta/status.

Under /v1 so that vLLM's --api-key guards them. Clients send versions, never paths or URIs: the
store is fixed when the server starts (options.py). Errors answer with {"error": {...}} and the
status of the exception (errors.py): 400 malformed, 404 unknown version, 409 not a successor,
422 integrity failure; the server keeps serving the previous version in every case.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..errors import BadRequestError, DeltaError, http_status
from .messages import StageRequest, UpdateRequest
from .options import server_store
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

    def attach_router(self, app: FastAPI) -> None:
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
            spec = server_store(load.load_format, load.model_loader_extra_config)
        else:
            spec = server_store(getattr(args, "load_format", None), getattr(args, "model_loader_extra_config", None))
        if spec is None:
            log.warning("vllm-delta: no store configured; /v1/delta/* will answer 500 until one is")
            return
        setattr(state, STATE_KEY, DeltaService(engine_client, spec))
        log.info("vllm-delta: /v1/delta/* serve versions of %s", spec.uri)
