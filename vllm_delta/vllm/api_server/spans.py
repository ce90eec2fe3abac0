"""The API-process side of attribution: `choices[i].weight_versions` and `prefill_weight_versions` on
the OpenAI surface, in vLLM 0.33's schema.

vLLM does the bookkeeping of the output spans: the engine core stamps each step's outputs with its
weight-version label (set by vllm-delta at start-up and at every update, engine_core/calls.py), and the
output processor turns label changes into `CompletionOutput.weight_versions` spans on finished outputs.
vLLM 0.33 shows them on /v1/completions and /v1/chat/completions when the request sets
`return_weight_versions: true` ({"version": "7", "start": 0, "end": 25} objects; `null` otherwise);
vLLM 0.32 does not show them. Here:

* `SpanStore` + `wrap_generate`: a wrapper of the public `EngineClient.generate` records the spans
  of every finished output (keyed by the generate() request id) before the serving layer sees it;
* `AttributionMiddleware` (pure ASGI): for a request that asked (the flag, or the server option
  `delta_weight_versions: "always"` for clients that cannot send it), fills `weight_versions` in the
  same objects on every finished choice where vLLM left it `null` or absent (vLLM 0.32; never
  overwriting the list vLLM 0.33 wrote: the feature is detected by the field, not by a version), and
  adds `prefill_weight_versions` (SGLang's key: which version computed the KV of each prompt
  position; engine_core/provenance.py, one engine-core call per response), to the non-streaming JSON
  body and to the streamed chunk that carries `finish_reason`, for POST /v1/completions and
  /v1/chat/completions. A request that did not ask passes through byte for byte;
* `spans_for_response`: the output spans for GET /v1/delta/timeline?id=<response id> (endpoints.py).

Where vllm-delta differs from stock vLLM: its in-flight updates change the weights between two engine
steps, so one choice's spans can name several versions without any pause (stock vLLM changes labels
only while paused), and the prompt provenance exists only here.

Id mapping (vLLM 0.32 and 0.33): /v1/completions answers id `cmpl-<base>` and calls generate() once per
prompt with `cmpl-<base>-<prompt index>`; choice k is output k % n of prompt k // n. /v1/chat/completions
answers `chatcmpl-<base>` = the generate() id; choice k is output k. With n > 1 the engine runs output k
as request `<k>_<generate id>`. Beam search does not go through one generate() per choice: its choices
get no spans.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ...server_api import (
    PREFILL_WEIGHT_VERSIONS,
    RETURN_WEIGHT_VERSIONS,
    WEIGHT_VERSIONS,
    ChoiceSpans,
    WeightSpan,
)
from .asgi import App, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

Json = dict[str, Any]
# (version, start, end): kept compact, as tuples, for the last STORE_LIMIT requests (WeightSpan on the wire)
SpanList = list[tuple[str, int, int]]
# generate() requests whose spans are kept (~0.5 KB each): GET /v1/delta/timeline?id= is a fallback a client
# uses right after its response, and a bound this size is full within minutes, after which memory is flat.
STORE_LIMIT = 4096
WRAPPED_ATTR = "_vllm_delta_attribution"

PATHS = ("/v1/completions", "/v1/chat/completions")
# The engine-core call behind prefill_weight_versions: engine request ids -> their prompt spans.
PromptLookup = Callable[[list[str]], Awaitable[dict[str, list[WeightSpan]]]]


@dataclass
class SpanPolicy:
    """What the middleware adds for whom (set when the server starts, endpoints.init_state)."""

    always: bool = False  # the server option delta_weight_versions = "always": as if every request asked
    prompt_versions: PromptLookup | None = None  # None: no prefill_weight_versions (no engine yet)


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
    """vLLM's WeightVersionSpan list (an output's `weight_versions`), kept compact."""
    return [(str(s.version), int(s.start), int(s.end)) for s in weight_versions]


def span_json(spans: Iterable[tuple[str, int, int]]) -> list[Json]:
    """Spans as vLLM writes them: [{"version": "7", "start": 0, "end": 25}, ...]."""
    return [{"version": version, "start": start, "end": end} for version, start, end in spans]


def weight_spans(spans: SpanList) -> list[WeightSpan]:
    return [WeightSpan(*s) for s in spans]


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


def _prompt_and_output(store: SpanStore, response_id: str, path: str, index: int) -> tuple[str, Recorded | None, int]:
    """(the generate() id, its record, the output index within it) of choice `index` of a response."""
    if path.endswith("/chat/completions"):
        return response_id, store.get(response_id), index
    first = store.get(f"{response_id}-0")
    prompt, output = divmod(index, first.n if first is not None else 1)
    generate_id = f"{response_id}-{prompt}"
    return generate_id, first if prompt == 0 else store.get(generate_id), output


def spans_for_choice(store: SpanStore, response_id: str, path: str, index: int) -> SpanList | None:
    """The output spans of choice `index` of a response, or None when unknown."""
    _, rec, output = _prompt_and_output(store, response_id, path, index)
    return None if rec is None else rec.outputs.get(output)


def engine_request_id(store: SpanStore, response_id: str, path: str, index: int) -> str:
    """The id the engine core knows choice `index` by (without vLLM's random suffix): the generate() id,
    or `<k>_<generate id>` for output k of n > 1 (vLLM's parallel sampling)."""
    generate_id, rec, output = _prompt_and_output(store, response_id, path, index)
    return generate_id if rec is None or rec.n == 1 else f"{output}_{generate_id}"


def spans_for_response(store: SpanStore, response_id: str) -> tuple[list[str], list[ChoiceSpans]]:
    """(the generate() ids, the spans of each choice) of a response id (completion or chat)."""
    rec = store.get(response_id)
    if rec is not None:  # chat: one generate() per response
        return [response_id], [ChoiceSpans(i, weight_spans(rec.outputs[i])) for i in sorted(rec.outputs)]
    ids: list[str] = []
    choices: list[ChoiceSpans] = []
    prompt = 0
    while (rec := store.get(f"{response_id}-{prompt}")) is not None:
        ids.append(f"{response_id}-{prompt}")
        choices += [ChoiceSpans(prompt * rec.n + i, weight_spans(rec.outputs[i])) for i in sorted(rec.outputs)]
        prompt += 1
    return ids, choices


FLAG = RETURN_WEIGHT_VERSIONS.encode()


def asked_for_spans(body: bytes) -> bool:
    """Whether a completion or chat request body sets `return_weight_versions: true`. Parsed only when the
    name, or a JSON `\\u` escape that could spell it, appears in it."""
    if FLAG not in body and b"\\u" not in body:
        return False
    try:
        obj = json.loads(body)
    except ValueError:
        return False  # vLLM answers 400 itself
    return isinstance(obj, dict) and obj.get(RETURN_WEIGHT_VERSIONS) is True


@dataclass
class Exchange:
    """One request through the middleware: its body as received, and whether it asked for spans."""

    path: str
    body: list[bytes] = field(default_factory=list)
    _asked: bool | None = None

    def asked(self, policy: SpanPolicy) -> bool:
        if self._asked is None:
            self._asked = policy.always or asked_for_spans(b"".join(self.body))
            self.body = []  # not needed any more
        return self._asked


async def annotate(obj: Any, store: SpanStore, policy: SpanPolicy, exchange: Exchange) -> bool:
    """Fill the spans of the finished choices of a response object, if the request asked; True if it
    changed. vLLM's own `weight_versions` (vLLM 0.33, asked) are kept as they are."""
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return False
    finished = [c for c in obj.get("choices") or () if isinstance(c, dict) and c.get("finish_reason") is not None]
    if not finished or not exchange.asked(policy):
        return False
    response_id, path = obj["id"], exchange.path
    changed = False
    for choice in finished:
        if choice.get(WEIGHT_VERSIONS) is None:
            spans = spans_for_choice(store, response_id, path, int(choice.get("index", 0)))
            if spans is not None:
                choice[WEIGHT_VERSIONS] = span_json(spans)
                changed = True
    wanting = {id(c): c for c in finished if c.get(PREFILL_WEIGHT_VERSIONS) is None}
    if wanting and policy.prompt_versions is not None:
        ids = {k: engine_request_id(store, response_id, path, int(c.get("index", 0))) for k, c in wanting.items()}
        try:
            found = await policy.prompt_versions(sorted(set(ids.values())))
        except Exception as exc:  # noqa: BLE001 - a response never fails for its attribution
            log.warning("vllm-delta: prompt provenance of %s unavailable: %s", response_id, exc)
            found = {}
        for k, choice in wanting.items():
            prompt_spans = found.get(ids[k])
            if prompt_spans is not None:
                choice[PREFILL_WEIGHT_VERSIONS] = span_json((s.version, s.start, s.end) for s in prompt_spans)
                changed = True
    return changed


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


FINISHED = b'"finish_reason":"'  # a finished choice (pydantic writes no spaces); unfinished ones say null


class AttributionMiddleware:
    """Pure ASGI middleware: fills `weight_versions` and `prefill_weight_versions` of completion and chat
    responses whose request asked.

    The request body passes on unchanged (its chunks are kept to read the flag). Non-streaming
    (application/json, 200): the body is held until complete, annotated, and sent with a corrected
    content-length. Streaming (text/event-stream): events pass through as they come; only an event with
    a finished choice is parsed and rewritten. Anything else passes untouched."""

    def __init__(self, app: App, store: SpanStore, policy: SpanPolicy | None = None):
        self.app = app
        self.store = store
        self.policy = policy if policy is not None else SpanPolicy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)  # heap: pass-through
            return
        exchange = Exchange(scope["path"])
        state: dict[str, Any] = {"mode": None, "start": None, "buf": b""}

        async def receiving() -> Message:
            message = await receive()
            if message.get("type") == "http.request" and exchange._asked is None:
                exchange.body.append(message.get("body", b""))
            return message

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
                await send({**message, "body": await self._sse(state, exchange, message.get("body", b""), message)})
                return
            state["buf"] += message.get("body", b"")
            if message.get("more_body", False):
                return
            body = state["buf"]
            try:
                obj = json.loads(body)
                if await annotate(obj, self.store, self.policy, exchange):
                    body = _dumps(obj)
            except ValueError:
                pass
            start = state["start"]
            kept = [(k, v) for k, v in start.get("headers", []) if bytes(k).lower() != b"content-length"]
            kept.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": kept})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receiving, send_wrapper)  # heap: pass-through (vLLM's handling of the request)

    async def _sse(self, state: dict[str, Any], exchange: Exchange, chunk: bytes, message: Message) -> bytes:
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
                if await annotate(obj, self.store, self.policy, exchange):
                    events[i] = b"data: " + _dumps(obj)
        return b"\n\n".join(events)
