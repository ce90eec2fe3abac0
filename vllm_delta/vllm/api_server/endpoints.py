"""The HTTP routes (a vLLM endpoint plugin): /v1/delta/update_weights, /v1/delta/stage, /v1/delta/status,
/v1/delta/ready, /v1/delta/timeline; on completions, `choices[i].weight_versions` (spans.py) and the
version gate of `min_weight_version` / `X-Min-Weight-Version` (gating.py).

Under /v1 so that vLLM's --api-key guards them. Clients send versions, never paths or URIs: the
store is fixed when the server starts (options.py). With "delta_follow" (or "delta_report") the
service runs a Follower (follower.py) in the server's event loop, from `init_state` until the app
shuts down. Errors answer with {"error": {...}} and the
status of the exception (errors.py): 400 malformed, 403 not signed by a trusted key (`delta_trusted_keys`:
SignatureError, raised by the plan before anything is staged), 404 unknown version, 409 not a successor,
413 body too large, 415 not JSON by its Content-Type, 422 integrity failure, 503 store unreachable or
cache unwritable, 504 store too slow; the server keeps serving the previous version in every case.

Request bodies are JSON objects of a few fields: over MAX_BODY_BYTES they are refused (413) before
they are read when Content-Length says so, else as soon as the count passes it (chunked bodies);
deep nesting, non-JSON and a body that is not a JSON object (null, an array, a number) are 400, and
error messages quote at most a short prefix of bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...errors import (
    BadRequestError,
    DeltaError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
    error_type,
    http_status,
    short,
)
from ...server_api import (
    FAULTS_ENV,
    MIN_VERSION_QUERY,
    PatchSwitch,
    PrefetchRequest,
    Readiness,
    Timeline,
    UpdateRequest,
    from_wire,
    to_wire,
    version_bound_text,
)
from ..shared import heap, rpc
from ..shared.messages import HeapAnswer
from ..shared.options import NO_STORE, server_options, weight_versions_policy
from .gating import VersionGate, VersionGateMiddleware
from .metrics import metrics
from .service import DeltaService
from .spans import AttributionMiddleware, SpanPolicy, SpanStore, spans_for_response, wrap_generate
from .vllm_routes import PastThePluginMiddleware

log = logging.getLogger(__name__)

PREFIX = "/v1/delta"
STATE_KEY = "vllm_delta_service"
MAX_BODY_BYTES = 64 * 1024  # our bodies are well under 200 bytes
SPANS_KEY = "vllm_delta_spans"
SPAN_POLICY_KEY = "vllm_delta_span_policy"
GATE_KEY = "vllm_delta_gate"


def _error(exc: BaseException) -> JSONResponse:
    status = http_status(exc)
    if status in (503, 504):  # the store or the cache, not a bug: no traceback
        log.warning("vllm-delta: %s", exc)
    elif status >= 500:
        log.error("vllm-delta: %s", exc, exc_info=exc)
    return JSONResponse(status_code=status, content={"error": {"type": error_type(exc), "message": str(exc)}})


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
        raise DeltaError(NO_STORE)
    return service


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The request's JSON body, an object ({} when empty), with the limits of the module docstring;
    any other JSON value as a whole body (null, an array, a number, ...) is a 400."""
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
        body = json.loads(raw)
    except RecursionError:
        raise BadRequestError("the body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise BadRequestError(f"the body is not JSON: {short(str(exc))}") from None
    if not isinstance(body, dict):  # null, an array, a number, a string, a bool: every route takes an object
        raise BadRequestError(f"the body must be a JSON object, not {_json_kind(body)}")
    return body


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


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
        async def prefetch(request: Request) -> object:
            service = _service(request)
            return await service.prefetch(from_wire(PrefetchRequest, await read_json(request)))

        @app.get(f"{PREFIX}/status")
        @route
        async def status(request: Request) -> object:
            verify = _flag(request.query_params.get("verify"), "verify")
            return await _service(request).status(verify=verify)

        @app.get(f"{PREFIX}/ready")
        async def ready(request: Request) -> JSONResponse:
            """200 when this server should get traffic (for min_version N: it serves >= N), else 503."""
            try:
                text = request.query_params.get(MIN_VERSION_QUERY)
                min_version = None if text is None else version_bound_text(text, MIN_VERSION_QUERY)
                service = getattr(request.app.state, STATE_KEY, None)
                answer = (
                    service.readiness(min_version)
                    if service is not None
                    else Readiness(ready=False, version=None, min_version=min_version, reason="no store configured")
                )
            except Exception as exc:  # noqa: BLE001 - malformed min_version: 400
                return _error(exc)
            return JSONResponse(to_wire(answer), status_code=200 if answer.ready else 503)

        @app.get(f"{PREFIX}/timeline")
        @route
        async def timeline(request: Request) -> object:
            return await _timeline(request)

        if os.environ.get(FAULTS_ENV) == "1":

            @app.post(f"{PREFIX}/test/heap")
            @route
            async def test_heap(request: Request) -> object:
                """Test hook: what vllm_delta keeps alive in this process and in every worker (heap.py)."""
                return await _heap(_service(request), await read_json(request))

        # Attribution: spans recorded by the generate() wrapper (init_state), added to responses here for
        # the requests that ask (init_state sets the policy: the server option, the engine-core lookup).
        spans, policy = SpanStore(), SpanPolicy()
        setattr(app.state, SPANS_KEY, spans)
        setattr(app.state, SPAN_POLICY_KEY, policy)
        app.add_middleware(AttributionMiddleware, store=spans, policy=policy)
        # The version gate, in front of the same routes (added last: it runs first, inside vLLM's
        # --api-key check, which vLLM adds after the plugins attach). The service configures it.
        gate = VersionGate()
        setattr(app.state, GATE_KEY, gate)
        app.add_middleware(VersionGateMiddleware, gate=gate)
        app.add_middleware(PastThePluginMiddleware, mark=_past_the_plugin)

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
        policy = getattr(state, SPAN_POLICY_KEY, None)
        if policy is not None:
            policy.always = weight_versions_policy(options) == "always"
            policy.prompt_versions = rpc.EngineCore(
                rpc.engine_client_transport(engine_client, LABEL_TIMEOUT_S)
            ).prompt_versions
        if options is None:
            log.warning("vllm-delta: no store configured; /v1/delta/* will answer 500 until one is")
            return
        gate = getattr(state, GATE_KEY, None)
        self.service = service = DeltaService.of(engine_client, options.store, options.service, gate)
        setattr(state, STATE_KEY, service)
        metrics()  # on /metrics from the start (once per process)
        log.info("vllm-delta: /v1/delta/* serve versions of %s", options.store.uri)
        try:  # the live checksum, and outputs labelled with the served version from the first request on
            await asyncio.wait_for(service.startup(), LABEL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - status learns it later; attribution says "default" meanwhile
            log.warning("vllm-delta: could not read the served version at start-up: %s", exc)
        if options.follow.follow or options.follow.report:
            service.start_follower(options.follow)
        service.checks.start_audit(options.service.audit_s)

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
                        await self.service.stop()

        app.router.lifespan_context = lifespan


LABEL_TIMEOUT_S = 120.0
_FLAGS = {"true": True, "1": True, "false": False, "0": False}


def _flag(text: str | None, name: str) -> bool:
    """A boolean query parameter (absent: false)."""
    if text is None:
        return False
    if text.lower() not in _FLAGS:
        raise BadRequestError(f"{name} must be true or false, not {short(text)}")
    return _FLAGS[text.lower()]


TIMELINE_ID_LIMIT = 256  # characters of ?id=


def _past_the_plugin(scope: Any, reset: bool) -> None:
    service = getattr(scope["app"].state, STATE_KEY, None)
    if service is not None:
        service.checks.past_the_plugin(weights_reset=reset)


async def _heap(service: DeltaService, body: Any) -> HeapAnswer:
    action = body.get("action", "report") if isinstance(body, dict) else None
    if action not in heap.HEAP_ACTIONS:
        raise BadRequestError(f'"action" must be one of {", ".join(heap.HEAP_ACTIONS)}')
    workers = (await service.workers.call(rpc.TEST_HEAP, rpc.HeapArgs(action))).all()
    return HeapAnswer(heap.act(action), workers)


async def _timeline(request: Request) -> Timeline:
    """GET /v1/delta/timeline[?id=<response id>]: the engine's label history (every update: version,
    label, engine step, time; in-flight commits add each running request's switch index) and, with
    an id, the spans of that response's choices and the commits it lived through."""
    timelines = await _service(request).engine_core.timelines()
    # Data parallelism: engine 0's at the top, every engine's in `engines` (each has its own steps).
    timeline = timelines[0] if len(timelines) == 1 else dataclasses.replace(timelines[0], engines=timelines)
    response_id = request.query_params.get("id")
    if response_id is None:
        return timeline
    if not response_id or len(response_id) > TIMELINE_ID_LIMIT:
        raise BadRequestError(f"id must be 1..{TIMELINE_ID_LIMIT} characters")
    spans = getattr(request.app.state, SPANS_KEY, None)
    ids, choices = spans_for_response(spans, response_id) if spans is not None else ([], [])
    commits = [
        PatchSwitch(
            version=h.version,
            label=h.label,
            engine_step=h.engine_step,
            time=h.time,
            switch=switch,
            engine=engine if len(timelines) > 1 else None,
        )
        for engine, t in enumerate(timelines)
        for h in t.history
        if (switch := _switches(h.switch or {}, ids))
    ]
    return dataclasses.replace(timeline, id=response_id, choices=choices, commits=commits)


def _switches(switch: dict[str, int], ids: list[str]) -> dict[str, int]:
    """The entries of a patch's switch map that belong to these generate() ids (n > 1: "<k>_<id>")."""
    return {rid: idx for rid, idx in switch.items() if rid in ids or rid.split("_", 1)[-1] in ids}
