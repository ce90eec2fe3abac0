"""The HTTP routes (a vLLM endpoint plugin): /v1/delta/update_weights, /v1/delta/stage, /v1/delta/status.

Under /v1 so that vLLM's --api-key guards them. Clients send versions, never paths or URIs: the
store is fixed when the server starts (options.py). Errors answer with {"error": {...}} and the
status of the exception (errors.py): 400 malformed, 404 unknown version, 409 not a successor,
413 body too large, 415 not JSON by its Content-Type, 422 integrity failure, 503 store unreachable or
cache unwritable, 504 store too slow; the server keeps serving the previous version in every case.

Request bodies are JSON objects of a few fields: over MAX_BODY_BYTES they are refused (413) before
they are read when Content-Length says so, else as soon as the count passes it (chunked bodies);
deep nesting and non-JSON are 400, and error messages quote at most a short prefix of bad input.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..errors import BadRequestError, DeltaError, RequestTooLargeError, UnsupportedMediaTypeError, http_status, short
from .messages import StageRequest, UpdateRequest
from .metrics import metrics
from .options import server_store
from .service import DeltaService

log = logging.getLogger(__name__)

PREFIX = "/v1/delta"
STATE_KEY = "vllm_delta_service"
MAX_BODY_BYTES = 64 * 1024  # our bodies are well under 200 bytes


class JsonAnswer(Protocol):
    def to_json(self) -> dict[str, Any]: ...


def _error(exc: BaseException) -> JSONResponse:
    status = http_status(exc)
    if status in (503, 504):  # the store or the cache, not a bug: no traceback
        log.warning("vllm-delta: %s", exc)
    elif status >= 500:
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


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON body ({} when empty), with the limits of the module docstring."""
    ctype = request.headers.get("content-type")
    if ctype is not None and ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, not {short(ctype)}")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise BadRequestError(f"bad Content-Length {short(length)}")
        if int(length) > max_bytes:
            raise RequestTooLargeError(f"the body has {int(length)} bytes; the limit is {max_bytes}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise RequestTooLargeError(f"the body exceeds {max_bytes} bytes")
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequestError("the body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise BadRequestError(f"the body is not JSON: {short(str(exc))}") from None


class DeltaEndpointPlugin:
    """Entry point `vllm.endpoint_plugins: vllm_delta_api` (a zero-argument class)."""

    name = "vllm_delta_api"
    required_tasks = ("generate",)  # needs an engine: not on the render-only server

    def attach_router(self, app: FastAPI) -> None:
        @app.post(f"{PREFIX}/update_weights")
        @route
        async def update_weights(request: Request) -> JsonAnswer:
            service = _service(request)
            return await service.update(UpdateRequest.from_body(await read_json(request)))

        @app.post(f"{PREFIX}/stage")
        @route
        async def stage(request: Request) -> JsonAnswer:
            service = _service(request)
            return await service.stage(StageRequest.from_body(await read_json(request)))

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
        metrics()  # on /metrics from the start (once per process)
        log.info("vllm-delta: /v1/delta/* serve versions of %s", spec.uri)
