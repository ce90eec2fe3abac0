"""Attribution without vLLM: the client helper (vllm_delta.attribution) and the API-side pieces that
put `choices[i].weight_versions` and `prefill_weight_versions` into responses, in vLLM 0.33's schema
(vllm_delta/vllm/api_server/spans.py: the generate() wrapper, the span store and the ASGI middleware),
driven by fake engine outputs, a fake ASGI app and a stand-in for the engine-core lookup."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from vllm_delta.attribution import (
    Span,
    attribution_of,
    parse_label,
    parse_spans,
    prompt_attribution_of,
    request_weight_versions,
    version_label,
)
from vllm_delta.server_api import WeightSpan, to_wire
from vllm_delta.vllm.api_server.spans import (
    AttributionMiddleware,
    SpanPolicy,
    SpanStore,
    asked_for_spans,
    engine_request_id,
    spans_for_response,
    wrap_generate,
)

pytestmark = pytest.mark.vllm_objects  # make check-vllm-next runs them against the newest vLLM


def objs(*spans):
    return [{"version": str(v), "start": a, "end": b} for v, a, b in spans]


def test_client_helper():
    # vLLM's objects (vLLM 0.33, vllm-delta now), and the lists of older vllm-delta servers: the same.
    new = {"index": 0, "weight_versions": objs((7, 0, 25), (8, 25, 30), ("default", 30, 32))}
    old = {"index": 0, "weight_versions": [[7, 0, 25], [8, 25, 30], ["default", 30, 32]]}
    a = attribution_of(new)
    assert a is not None and a == attribution_of(old)
    assert (a.first_version, a.last_version, a.versions) == (7, "default", [7, 8, "default"])
    assert (a.switches, a.switch_index, a.num_tokens, a.mixed) == ([25, 30], 25, 32, True)
    assert (a.version_at(0), a.version_at(24), a.version_at(25), a.version_at(31)) == (7, 7, 8, "default")
    assert a.token_versions() == [7] * 25 + [8] * 5 + ["default"] * 2
    assert a.to_json() == new["weight_versions"]  # vLLM's schema: versions as strings
    assert prompt_attribution_of(new) is None
    p = prompt_attribution_of({"prefill_weight_versions": objs((3, 0, 128), (4, 128, 150))})
    assert p is not None and (p.versions, p.switches, p.num_tokens) == ([3, 4], [128], 150)
    body = {"prompt": "x", "max_tokens": 3}
    assert (
        request_weight_versions(body) == {**body, "return_weight_versions": True}
        and "return_weight_versions" not in body
    )
    with pytest.raises(IndexError):
        a.version_at(32)
    one = parse_spans([{"version": "3", "start": 0, "end": 4}])
    assert one.spans == (Span(3, 0, 4),) and one.switch_index is None and not one.mixed
    assert parse_spans([]).first_version is None
    assert attribution_of({"index": 0, "finish_reason": None}) is None
    for bad in ([[1, 1, 4]], [[1, 0, 4], [2, 5, 6]], [[1, 0, 4], [2, 4, 3]]):
        with pytest.raises(ValueError, match="tile"):
            parse_spans(bad)
    assert (version_label(12), version_label(None), parse_label("12"), parse_label("v1")) == ("12", "default", 12, "v1")


# -- API side ----------------------------------------------------------------------------------------
def span(version, start, end):
    return SimpleNamespace(version=version, start=start, end=end)


def output(request_id, index_spans, finished=True):
    outs = [SimpleNamespace(index=i, weight_versions=spans if finished else None) for i, spans in index_spans]
    return SimpleNamespace(request_id=request_id, outputs=outs, finished=finished)


def run_generate(store, request_id, n, index_spans):
    async def orig(prompt, sampling_params, request_id, **kw):
        yield output(request_id, index_spans, finished=False)
        yield output(request_id, index_spans)

    client = SimpleNamespace(generate=orig)
    wrap_generate(client, store)
    wrap_generate(client, store)  # idempotent

    async def consume():
        return [o async for o in client.generate("p", SimpleNamespace(n=n), request_id)]

    return asyncio.run(consume())


def test_generate_wrapper_and_id_mapping():
    store = SpanStore(limit=3)
    # /v1/completions: two prompts, n=2 -> generate ids cmpl-X-0, cmpl-X-1; choice k = output k % 2 of prompt k // 2.
    run_generate(store, "cmpl-X-0", 2, [(0, [span("5", 0, 3)]), (1, [span("5", 0, 1), span("6", 1, 3)])])
    run_generate(store, "cmpl-X-1", 2, [(0, [span("6", 0, 3)]), (1, [span("6", 0, 3)])])
    ids, choices = spans_for_response(store, "cmpl-X")
    assert ids == ["cmpl-X-0", "cmpl-X-1"]
    assert to_wire(choices) == [
        {"index": 0, "weight_versions": objs((5, 0, 3))},
        {"index": 1, "weight_versions": objs((5, 0, 1), (6, 1, 3))},
        {"index": 2, "weight_versions": objs((6, 0, 3))},
        {"index": 3, "weight_versions": objs((6, 0, 3))},
    ]
    # The engine core runs output k of n > 1 as "<k>_<generate id>".
    ids = [engine_request_id(store, "cmpl-X", "/v1/completions", i) for i in range(4)]
    assert ids == ["0_cmpl-X-0", "1_cmpl-X-0", "0_cmpl-X-1", "1_cmpl-X-1"]
    # Chat: the generate id is the response id.
    run_generate(store, "chatcmpl-Y", 1, [(0, [span("default", 0, 2)])])
    ids, choices = spans_for_response(store, "chatcmpl-Y")
    assert (ids, to_wire(choices)) == (
        ["chatcmpl-Y"],
        [{"index": 0, "weight_versions": objs(("default", 0, 2))}],
    )
    assert engine_request_id(store, "chatcmpl-Y", "/v1/chat/completions", 0) == "chatcmpl-Y"
    # Bounded: the oldest request went.
    run_generate(store, "chatcmpl-Z", 1, [(0, [span("1", 0, 2)])])
    assert len(store) == 3 and store.get("cmpl-X-0") is None


def asgi_app(status, content_type, bodies, seen=None):
    async def app(scope, receive, send):
        request = b""
        while True:  # vLLM reads the whole request body first
            message = await receive()
            request += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if seen is not None:
            seen.append(request)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", b"999")],
            }
        )
        for i, body in enumerate(bodies):
            await send({"type": "http.response.body", "body": body, "more_body": i < len(bodies) - 1})

    return app


def call(app, path, method="POST", request=b"{}"):
    """One request through `app`; its request body arrives in two messages."""
    sent = []
    parts = [request[:5], request[5:]]

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    asyncio.run(app({"type": "http", "method": method, "path": path}, receive, send))
    return sent


ASK = json.dumps({"model": "m", "prompt": "héllo", "return_weight_versions": True}).encode()
NO = json.dumps({"model": "m", "prompt": "héllo"}).encode()


class Lookup:
    """The engine core's prompt provenance (rpc.PROMPT_VERSIONS), as the middleware calls it."""

    def __init__(self, found, fail=False):
        self.found, self.fail, self.calls = found, fail, []

    async def __call__(self, ids):
        self.calls.append(ids)
        if self.fail:
            raise RuntimeError("engine core gone")
        return {i: self.found[i] for i in ids if i in self.found}


def test_the_request_flag():
    assert asked_for_spans(ASK) and not asked_for_spans(NO)
    assert not asked_for_spans(json.dumps({"return_weight_versions": False}).encode())
    assert not asked_for_spans(b'{"prompt": "return_weight_versions"}')  # the name in a prompt is no flag
    assert asked_for_spans(b'{"return_weight_versions": true, "prompt": "\\u00e9"}')
    assert asked_for_spans(b'{"\\u0072eturn_weight_versions": true}')  # an escaped key still asks
    assert not asked_for_spans(b'{"return_weight_versions": tru')  # not JSON: vLLM answers 400 itself


def test_middleware_non_streaming_body():
    store = SpanStore()
    run_generate(store, "cmpl-A-0", 1, [(0, [span("4", 0, 2), span("5", 2, 6)])])
    body = {"id": "cmpl-A", "choices": [{"index": 0, "text": "héllo", "finish_reason": "length"}]}
    raw = json.dumps(body).encode()
    lookup = Lookup({"cmpl-A-0": [WeightSpan("3", 0, 16), WeightSpan("4", 16, 20)]})
    policy = SpanPolicy(prompt_versions=lookup)
    seen: list[bytes] = []
    sent = call(
        AttributionMiddleware(asgi_app(200, b"application/json", [raw[:10], raw[10:]], seen), store, policy),
        "/v1/completions",
        request=ASK,
    )
    assert seen == [ASK]  # the request body reached vLLM unchanged
    start, final = sent
    out = json.loads(final["body"])["choices"][0]
    assert out["weight_versions"] == objs((4, 0, 2), (5, 2, 6)) and out["text"] == "héllo"
    assert out["prefill_weight_versions"] == objs((3, 0, 16), (4, 16, 20))
    assert lookup.calls == [["cmpl-A-0"]]
    assert dict(start["headers"])[b"content-length"] == str(len(final["body"])).encode()
    # A request that did not ask: vLLM's body byte for byte, no engine-core call.
    sent = call(
        AttributionMiddleware(asgi_app(200, b"application/json", [raw]), store, policy), "/v1/completions", request=NO
    )
    assert sent[-1]["body"] == raw and lookup.calls == [["cmpl-A-0"]]
    # ... unless the server says always (vLLM 0.33 writes null there: filled too).
    null = json.dumps({**body, "choices": [{**body["choices"][0], "weight_versions": None}]}).encode()
    always = SpanPolicy(always=True, prompt_versions=lookup)
    sent = call(
        AttributionMiddleware(asgi_app(200, b"application/json", [null]), store, always), "/v1/completions", request=NO
    )
    assert json.loads(sent[-1]["body"])["choices"][0]["weight_versions"] == objs((4, 0, 2), (5, 2, 6))
    # vLLM 0.33 answered the flag itself: its spans are kept as they are (never overwritten).
    native = objs((4, 0, 1), (5, 1, 6))
    own = json.dumps({**body, "choices": [{**body["choices"][0], "weight_versions": native}]}).encode()
    sent = call(
        AttributionMiddleware(asgi_app(200, b"application/json", [own]), store, policy), "/v1/completions", request=ASK
    )
    out = json.loads(sent[-1]["body"])["choices"][0]
    assert out["weight_versions"] == native and out["prefill_weight_versions"] == objs((3, 0, 16), (4, 16, 20))
    # The engine core cannot answer: the response still goes out, without prompt provenance.
    failing = SpanPolicy(prompt_versions=Lookup({}, fail=True))
    sent = call(
        AttributionMiddleware(asgi_app(200, b"application/json", [raw]), store, failing), "/v1/completions", request=ASK
    )
    out = json.loads(sent[-1]["body"])["choices"][0]
    assert out["weight_versions"] == objs((4, 0, 2), (5, 2, 6)) and "prefill_weight_versions" not in out
    # Errors, other routes and unknown ids pass through unchanged.
    for status, path, rid in (
        (400, "/v1/completions", "cmpl-A"),
        (200, "/v1/models", "cmpl-A"),
        (200, "/v1/completions", "cmpl-B"),
    ):
        raw = json.dumps({**body, "id": rid}).encode()
        sent = call(AttributionMiddleware(asgi_app(status, b"application/json", [raw]), store), path, request=ASK)
        assert sent[-1]["body"] == raw


def test_middleware_stream_annotates_the_finishing_chunk_only():
    store = SpanStore()
    run_generate(store, "chatcmpl-C", 1, [(0, [span("8", 0, 3)])])

    def event(finish):
        choice = {"index": 0, "delta": {"content": "x"}, "finish_reason": finish}
        return (
            b"data: "
            + json.dumps(
                {"id": "chatcmpl-C", "object": "chat.completion.chunk", "choices": [choice]}, separators=(",", ":")
            ).encode()
            + b"\n\n"
        )

    first, last = event(None), event("stop")
    # The last event arrives split over two body messages.
    chunks = [first, last[:20], last[20:] + b"data: [DONE]\n\n", b""]
    policy = SpanPolicy(prompt_versions=Lookup({"chatcmpl-C": [WeightSpan("7", 0, 5)]}))
    for request, expect in ((ASK, True), (NO, False)):
        app = AttributionMiddleware(asgi_app(200, b"text/event-stream", chunks), store, policy)
        sent = call(app, "/v1/chat/completions", request=request)
        bodies = [m["body"] for m in sent[1:]]
        assert bodies[0] == first and bodies[1] == b""  # nothing held but the incomplete tail
        events = b"".join(bodies).split(b"\n\n")
        final = json.loads(events[1][6:])["choices"][0]
        assert events[2] == b"data: [DONE]"
        assert "weight_versions" not in json.loads(events[0][6:])["choices"][0]
        if expect:
            assert final["weight_versions"] == objs((8, 0, 3))
            assert final["prefill_weight_versions"] == objs((7, 0, 5))
        else:
            assert b"".join(bodies) == b"".join(chunks)  # untouched
