"""The API-process side of attribution: `choices[i].weight_versions` on the OpenAI surface.

vLLM already does the bookkeeping: the engine core stamps each step's outputs with its weight-version
label (set by vllm-delta at start-up and at every update, engine_core/reserved.py), and the output processor
turns label changes into `CompletionOutput.weight_versions` spans on finished outputs. The OpenAI
completion and chat responses do not show them. Here:

* `SpanStore` + `wrap_generate`: a wrapper of the public `EngineClient.generate` records the spans
  of every finished output (keyed by the generate() request id) before the serving layer sees it;
* `AttributionMiddleware` (pure ASGI): adds `choices[i].weight_versions` = [[version, start, end],
  ...] to the non-streaming JSON body and to the streamed chunk that carries `finish_reason`, for
  POST /v1/completions and /v1/chat/completions;
* `spans_for_response`: the same lookup for GET /v1/delta/timeline?id=<response id> (endpoints.py).

Id mapping (vLLM 0.32): /v1/completions answers id `cmpl-<base>` and calls generate() once per prompt
with `cmpl-<base>-<prompt index>`; choice k is output k % n of prompt k // n. /v1/chat/completions
answers `chatcmpl-<base>` = the generate() id; choice k is output k. Beam search does not go through
one generate() per choice: its choices get no spans.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ...attribution import parse_label
from ...server_api import ChoiceSpans
from .asgi import App, Message, Receive, Scope, Send

Json = dict[str, Any]
SpanList = list[list[Any]]  # [[version, start, end], ...]
# generate() requests whose spans are kept (~0.5 KB each): GET /v1/delta/timeline?id= is a fallback a client
# uses right after its response, and a bound this size is full within minutes, after which memory is flat.
STORE_LIMIT = 4096
WRAPPED_ATTR = "_vllm_delta_attribution"

PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class Recorded:
    n: int  # outputs per prompt (SamplingParams.n)
    outputs: dict[int, SpanList] = field(default_factory=dict)  # output index -> spans
    time: float = 0.0


class SpanStore:
    """The spans of recently finished generate() requests (bounded, oldest dropped first)."""

    def __init__(self, limit: int = STORE_LIMIT):
        self.limit = limit
        self._items: OrderedDict[str, Recorded] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, request_id: str, n: int, index: int, spans: SpanList) -> None:
        with self._lock:
            rec = self._items.get(request_id)
            if rec is None:
                rec = self._items[request_id] = Recorded(n)
            rec.outputs[index] = spans
            rec.time = time.time()
            self._items.move_to_end(request_id)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, request_id: str) -> Recorded | None:
        with self._lock:
            return self._items.get(request_id)

    def __len__(self) -> int:
        return len(self._items)


def to_span_list(weight_versions: Any) -> SpanList:
    """vLLM's WeightVersionSpan list as JSON: [[version, start, end], ...], store versions as ints."""
    return [[parse_label(s.version), int(s.start), int(s.end)] for s in weight_versions]


def _n_of(sampling_params: Any) -> int:
    n = getattr(sampling_params, "n", 1)
    return n if isinstance(n, int) and n > 0 else 1


def wrap_generate(engine_client: Any, store: SpanStore) -> None:
    """Record the spans of every finished output that goes through `engine_client.generate`. Idempotent."""
    orig = engine_client.generate
    if getattr(orig, WRAPPED_ATTR, False):
        return

    def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        sampling_params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        n = _n_of(sampling_params)
        return _recording(orig(*args, **kwargs), store, n)

    setattr(generate, WRAPPED_ATTR, True)
    engine_client.generate = generate


async def _recording(outputs: AsyncIterator[Any], store: SpanStore, n: int) -> AsyncIterator[Any]:
    async for out in outputs:  # heap: pass-through (vLLM's generate runs below this line)
        for o in getattr(out, "outputs", None) or ():
            spans = getattr(o, "weight_versions", None)
            if spans is not None:
                store.record(out.request_id, n, int(o.index), to_span_list(spans))
        yield out


def spans_for_choice(store: SpanStore, response_id: str, path: str, index: int) -> SpanList | None:
    """The spans of choice `index` of a response, or None when unknown."""
    if path.endswith("/chat/completions"):
        rec = store.get(response_id)
        return None if rec is None else rec.outputs.get(index)
    first = store.get(f"{response_id}-0")
    if first is None:
        return None
    prompt, output = divmod(index, first.n)
    rec = first if prompt == 0 else store.get(f"{response_id}-{prompt}")
    return None if rec is None else rec.outputs.get(output)


def spans_for_response(store: SpanStore, response_id: str) -> tuple[list[str], list[ChoiceSpans]]:
    """(the generate() ids, the spans of each choice) of a response id (completion or chat)."""
    rec = store.get(response_id)
    if rec is not None:  # chat: one generate() per response
        return [response_id], [ChoiceSpans(i, rec.outputs[i]) for i in sorted(rec.outputs)]
    ids: list[str] = []
    choices: list[ChoiceSpans] = []
    prompt = 0
    while (rec := store.get(f"{response_id}-{prompt}")) is not None:
        ids.append(f"{response_id}-{prompt}")
        choices += [ChoiceSpans(prompt * rec.n + i, rec.outputs[i]) for i in sorted(rec.outputs)]
        prompt += 1
    return ids, choices


def annotate(obj: Any, store: SpanStore, path: str) -> bool:
    """Add weight_versions to the finished choices of a response object; True if it changed."""
    if not isinstance(obj, dict):
        return False
    changed = False
    response_id = obj.get("id")
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("finish_reason") is None or not isinstance(response_id, str):
            continue
        spans = spans_for_choice(store, response_id, path, int(choice.get("index", 0)))
        if spans is not None:
            choice["weight_versions"] = spans
            changed = True
    return changed


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


FINISHED = b'"finish_reason":"'  # a finished choice (pydantic writes no spaces); unfinished ones say null


class AttributionMiddleware:
    """Pure ASGI middleware: adds `choices[i].weight_versions` to completion and chat responses.

    Non-streaming (application/json, 200): the body is held until complete, annotated, and sent with
    a corrected content-length. Streaming (text/event-stream): events pass through as they come; only
    an event with a finished choice is parsed and rewritten. Anything else passes untouched."""

    def __init__(self, app: App, store: SpanStore):
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)  # heap: pass-through
            return
        path = scope["path"]
        store = self.store
        state: dict[str, Any] = {"mode": None, "start": None, "buf": b"", "path": path}

        async def send_wrapper(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                headers = {bytes(k).lower(): bytes(v) for k, v in message.get("headers", [])}
                ctype = headers.get(b"content-type", b"")
                if ctype.startswith(b"text/event-stream"):
                    state["mode"] = "sse"
                elif ctype.startswith(b"application/json") and message.get("status", 200) == 200:
                    state["mode"], state["start"] = "json", message
                    return  # held until the body is complete
                await send(message)
                return
            if kind != "http.response.body" or state["mode"] is None:
                await send(message)
                return
            if state["mode"] == "sse":
                await send({**message, "body": self._sse(state, message.get("body", b""), message)})
                return
            state["buf"] += message.get("body", b"")
            if message.get("more_body", False):
                return
            body = state["buf"]
            try:
                obj = json.loads(body)
                if annotate(obj, store, path):
                    body = _dumps(obj)
            except ValueError:
                pass
            start = state["start"]
            kept = [(k, v) for k, v in start.get("headers", []) if bytes(k).lower() != b"content-length"]
            kept.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": kept})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, send_wrapper)  # heap: pass-through (vLLM's handling of the request)

    def _sse(self, state: dict[str, Any], chunk: bytes, message: Message) -> bytes:
        """Complete events of the stream so far (annotated where a choice finished); an incomplete
        tail waits for the next chunk (vLLM sends whole events, so it is normally empty)."""
        data = state["buf"] + chunk
        if not message.get("more_body", False):
            state["buf"] = b""
            cut = len(data)
        else:
            cut = data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0
            state["buf"] = data[cut:]
        ready = data[:cut]
        if FINISHED not in ready:
            return ready
        events = ready.split(b"\n\n")
        for i, event in enumerate(events):
            if FINISHED in event and event.startswith(b"data: {"):
                try:
                    obj = json.loads(event[6:])
                except ValueError:
                    continue
                if annotate(obj, self.store, state["path"]):
                    events[i] = b"data: " + _dumps(obj)
        return b"\n\n".join(events)
