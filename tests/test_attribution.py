"""Attribution without vLLM: the client helper (vllm_delta.attribution) and the API-side pieces that
put `choices[i].weight_versions` into responses (vllm_delta/vllm/api_server/spans.py: the generate()
wrapper, the span store and the ASGI middleware), driven by fake engine outputs and a fake ASGI app."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from vllm_delta.attribution import Span, attribution_of, parse_label, parse_spans, version_label
from vllm_delta.server_api import to_wire
from vllm_delta.vllm.api_server.spans import AttributionMiddleware, SpanStore, spans_for_response, wrap_generate


def test_client_helper():
    a = attribution_of({"index": 0, "weight_versions": [[7, 0, 25], [8, 25, 30], ["default", 30, 32]]})
    assert a is not None
    assert (a.first_version, a.last_version, a.versions) == (7, "default", [7, 8, "default"])
    assert (a.switches, a.switch_index, a.num_tokens, a.mixed) == ([25, 30], 25, 32, True)
    assert (a.version_at(0), a.version_at(24), a.version_at(25), a.version_at(31)) == (7, 7, 8, "default")
    assert a.token_versions() == [7] * 25 + [8] * 5 + ["default"] * 2
    assert a.to_json() == [[7, 0, 25], [8, 25, 30], ["default", 30, 32]]
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
        {"index": 0, "weight_versions": [[5, 0, 3]]},
        {"index": 1, "weight_versions": [[5, 0, 1], [6, 1, 3]]},
        {"index": 2, "weight_versions": [[6, 0, 3]]},
        {"index": 3, "weight_versions": [[6, 0, 3]]},
    ]
    # Chat: the generate id is the response id.
    run_generate(store, "chatcmpl-Y", 1, [(0, [span("default", 0, 2)])])
    ids, choices = spans_for_response(store, "chatcmpl-Y")
    assert (ids, to_wire(choices)) == (
        ["chatcmpl-Y"],
        [{"index": 0, "weight_versions": [["default", 0, 2]]}],
    )
    # Bounded: the oldest request went.
    run_generate(store, "chatcmpl-Z", 1, [(0, [span("1", 0, 2)])])
    assert len(store) == 3 and store.get("cmpl-X-0") is None


def asgi_app(status, content_type, bodies):
    async def app(scope, receive, send):
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


def call(app, path, method="POST"):
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(app({"type": "http", "method": method, "path": path}, receive, send))
    return sent


def test_middleware_non_streaming_body():
    store = SpanStore()
    run_generate(store, "cmpl-A-0", 1, [(0, [span("4", 0, 2), span("5", 2, 6)])])
    body = {"id": "cmpl-A", "choices": [{"index": 0, "text": "héllo", "finish_reason": "length"}]}
    raw = json.dumps(body).encode()
    sent = call(
        AttributionMiddleware(asgi_app(200, b"application/json", [raw[:10], raw[10:]]), store), "/v1/completions"
    )
    start, final = sent
    out = json.loads(final["body"])
    assert out["choices"][0]["weight_versions"] == [[4, 0, 2], [5, 2, 6]] and out["choices"][0]["text"] == "héllo"
    assert dict(start["headers"])[b"content-length"] == str(len(final["body"])).encode()
    # Errors, other routes and unknown ids pass through unchanged.
    for status, path, rid in (
        (400, "/v1/completions", "cmpl-A"),
        (200, "/v1/models", "cmpl-A"),
        (200, "/v1/completions", "cmpl-B"),
    ):
        raw = json.dumps({**body, "id": rid}).encode()
        sent = call(AttributionMiddleware(asgi_app(status, b"application/json", [raw]), store), path)
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
    sent = call(AttributionMiddleware(asgi_app(200, b"text/event-stream", chunks), store), "/v1/chat/completions")
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == first and bodies[1] == b""  # nothing held but the incomplete tail
    events = b"".join(bodies).split(b"\n\n")
    final = json.loads(events[1][6:])
    assert final["choices"][0]["weight_versions"] == [[8, 0, 3]] and events[2] == b"data: [DONE]"
    assert "weight_versions" not in json.loads(events[0][6:])["choices"][0]
