"""The HTTP routes (a vLLM endpoint plugin): /v1/delta/update_weights, /v1/delta/stage, /v1/delta/status,
/v1/delta/timeline; and `choices[i].weight_versions` on completions (spans.py).

Under /v1 so that vLLM's --api-key guards them. Clients send versions, never paths or URIs: the
store is fixed when the server starts (options.py). With "delta_follow" (or "delta_report") the
service runs a Follower (follower.py) in the server's event loop, from `init_state` until the app
shuts down. Errors answer with {"error": {...}} and the
status of the exception (errors.py): 400 malformed, 404 unknown version, 409 not a successor,
413 body too large, 415 not JSON by its Content-Type, 422 integrity failure, 503 store unreachable or
cache unwritable, 504 store too slow; the server keeps serving the previous version in every case.

Request bodies are JSON objects of a few fields: over MAX_BODY_BYTES they are refused (413) before
they are read when Content-Length says so, else as soon as the count passes it (chunked bodies);
deep nesting and non-JSON are 400, and error messages quote at most a short prefix of bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...errors import BadRequestError, DeltaError, RequestTooLargeError, UnsupportedMediaTypeError, http_status, short
from ...server_api import CommitSwitch, StageRequest, Timeline, UpdateRequest, from_wire, to_wire
from ..shared.options import server_options
from .metrics import metrics
from .service import DeltaService
from .spans import AttributionMiddleware, SpanStore, spans_for_response, wrap_generate

log = logging.getLogger(__name__)

PREFIX = "/v1/delta"
STATE_KEY = "vllm_delta_service"
MAX_BODY_BYTES = 64 * 1024  # our bodies are well under 200 bytes
SPANS_KEY = "vllm_delta_spans"


def _error(exc: BaseException) -> JSONResponse:
    status = http_status(exc)
    if status in (503, 504):  # the store or the cache, not a bug: no traceback
        log.warning("vllm-delta: %s", exc)
    elif status >= 500:
        log.error("vllm-delta: %s", exc, exc_info=exc)
    return JSONResponse(status_code=status, content={"error": {"type": type(exc).__name__, "message": str(exc)}})


def route(handler: Callable[[Request], Awaitable[object]]) -> Callable[[Request], Awaitable[JSONResponse]]:
    """A route's one exit: the answer (a body of server_api.py) as JSON with 200, or any exception as
    {"error": {"type", "message"}} with its status (errors.http_status); 5xx are logged with their
    traceback."""

    async def answer(request: Request) -> JSONResponse:
        try:
            return JSONResponse(to_wire(await handler(request)))
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

    def __init__(self) -> None:
        self.service: DeltaService | None = None

    def attach_router(self, app: FastAPI) -> None:
        self._stop_follower_on_shutdown(app)

        @app.post(f"{PREFIX}/update_weights")
        @route
        async def update_weights(request: Request) -> object:
            service = _service(request)
            return await service.update(from_wire(UpdateRequest, await read_json(request)))

        @app.post(f"{PREFIX}/stage")
        @route
        async def stage(request: Request) -> object:
            service = _service(request)
            return await service.stage(from_wire(StageRequest, await read_json(request)))

        @app.get(f"{PREFIX}/status")
        @route
        async def status(request: Request) -> object:
            return await _service(request).status()

        @app.get(f"{PREFIX}/timeline")
        @route
        async def timeline(request: Request) -> object:
            return await _timeline(request)

        # Attribution: spans recorded by the generate() wrapper (init_state), added to responses here.
        spans = SpanStore()
        setattr(app.state, SPANS_KEY, spans)
        app.add_middleware(AttributionMiddleware, store=spans)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is None:
            return
        spans = getattr(state, SPANS_KEY, None)
        if spans is not None:
            wrap_generate(engine_client, spans)
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
        self.service = service = DeltaService(engine_client, options.store)
        setattr(state, STATE_KEY, service)
        metrics()  # on /metrics from the start (once per process)
        log.info("vllm-delta: /v1/delta/* serve versions of %s", options.store.uri)
        try:  # label outputs with the served version from the first request on (vLLM says "default")
            await asyncio.wait_for(service.sync_label(), LABEL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - attribution would say "default" until the first update
            log.warning("vllm-delta: could not set the weight-version label at start-up: %s", exc)
        if options.follow.follow or options.follow.report:
            service.start_follower(options.follow)

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
                    if self.service is not None:
                        await self.service.stop_follower()

        app.router.lifespan_context = lifespan


LABEL_TIMEOUT_S = 120.0
TIMELINE_ID_LIMIT = 256  # characters of ?id=


async def _timeline(request: Request) -> Timeline:
    """GET /v1/delta/timeline[?id=<response id>]: the engine's label history (every update: version,
    label, engine step, time; in-flight commits add each running request's switch index) and, with
    an id, the spans of that response's choices and the commits it lived through."""
    timeline = await _service(request).engine_core.timeline()
    response_id = request.query_params.get("id")
    if response_id is None:
        return timeline
    if not response_id or len(response_id) > TIMELINE_ID_LIMIT:
        raise BadRequestError(f"id must be 1..{TIMELINE_ID_LIMIT} characters")
    spans = getattr(request.app.state, SPANS_KEY, None)
    ids, choices = spans_for_response(spans, response_id) if spans is not None else ([], [])
    commits = [
        CommitSwitch(version=h.version, label=h.label, engine_step=h.engine_step, time=h.time, switch=switch)
        for h in timeline.history
        if (switch := _switches(h.switch or {}, ids))
    ]
    return dataclasses.replace(timeline, id=response_id, choices=choices, commits=commits)


def _switches(switch: dict[str, int], ids: list[str]) -> dict[str, int]:
    """The entries of a commit's switch map that belong to these generate() ids (n > 1: "<k>_<id>")."""
    return {rid: idx for rid, idx in switch.items() if rid in ids or rid.split("_", 1)[-1] in ids}
