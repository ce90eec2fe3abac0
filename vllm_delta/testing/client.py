"""A streaming client for tests, benchmarks and the demo: greedy completions back to back, with the
arrival time of every chunk, so that the stall an update causes can be measured from the outside.

    with StreamingClient(srv.base_url, srv.model) as stream:
        ...                                   # updates happen meanwhile
    stream.max_gap_ms(t0, t1)                 # the longest chunk interval overlapping [t0, t1]
    stream.completed                          # every finished request: id, tokens, weight_versions

Every request asks for its spans (`"return_weight_versions": true`, vLLM 0.33's flag; a vllm-delta
server honours it on vLLM 0.32 too): the finishing chunk's `weight_versions` and
`prefill_weight_versions` (vLLM's span objects) are kept. A request vLLM 0.33 refuses while paused in
mode `wait` or `abort` (503 `engine_paused`) is retried until its timeout has passed, and counted in
`paused_retries`, not in `errors`. Talks to 127.0.0.1 only in this project's use; its loop stops when
`stop()` is called.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..attribution import PREFILL_WEIGHT_VERSIONS, WEIGHT_VERSIONS, request_weight_versions
from ..server_api import is_engine_paused

REQUEST_TIMEOUT_S = 120.0
PAUSED_RETRY_S = 0.05


class _Paused(Exception):
    """A stream whose first event is vLLM's "generation is paused" error (retried, not an error)."""


@dataclass
class StreamedCompletion:
    """One finished streamed request, as the client saw it."""

    id: str
    tokens: list[int] = field(default_factory=list)  # output token ids, in order
    finish_reason: str | None = None
    weight_versions: list[dict[str, Any]] | None = None  # from the chunk that carried finish_reason
    prefill_weight_versions: list[dict[str, Any]] | None = None  # the same chunk's prompt provenance
    started: float = 0.0  # perf_counter
    finished: float = 0.0


def _intervals(arrivals: list[float], firsts: set[int] | None) -> list[tuple[float, float]]:
    """Consecutive chunk pairs, without those that span two requests (`firsts`: indices of the first
    chunk of each request): the wait for a new request is not a stall of a running one."""
    return [(a, b) for i, (a, b) in enumerate(zip(arrivals, arrivals[1:])) if not firsts or i + 1 not in firsts]


def max_gap_ms(arrivals: list[float], t0: float, t1: float, firsts: set[int] | None = None) -> float:
    """The longest interval between consecutive chunks (of one request) that overlaps [t0, t1], in ms."""
    best = 0.0
    for a, b in _intervals(arrivals, firsts):
        if b >= t0 and a <= t1:
            best = max(best, b - a)
    return best * 1e3


def steady_gaps_ms(
    arrivals: list[float], windows: list[tuple[float, float]], margin: float = 0.2, firsts: set[int] | None = None
) -> dict[str, float]:
    """Chunk intervals away from every window (ms): the noise floor that update gaps stand on.

    Chunks often arrive several per network read, so the median is near zero; p99 and max say how
    long the stream stalls by itself (scheduling noise, other requests' prefills)."""
    out = sorted(
        (b - a) * 1e3
        for a, b in _intervals(arrivals, firsts)
        if all(b < t0 - margin or a > t1 + margin for t0, t1 in windows)
    )
    if not out:
        return {"n": 0}

    def pick(q: float) -> float:
        return round(out[min(len(out) - 1, int(q * len(out)))], 2)

    return {"n": len(out), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(out[-1], 2)}


class StreamingClient:
    """Streams greedy completions back to back on a thread; records chunk arrivals and errors."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        headers: dict[str, str] | None = None,
        prompt: str | list[int] = "once upon a time there was a",
        max_tokens: int = 48,
        once: bool = False,
    ):
        self.base_url, self.model = base_url, model
        self.headers = dict(headers or {})
        self.body: dict[str, Any] = request_weight_versions(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            }
        )
        self.arrivals: list[float] = []
        self.chunk_tokens: list[int] = []  # output tokens in each chunk (parallel to arrivals)
        self.firsts: set[int] = set()  # indices into arrivals of each request's first chunk
        self.completed: list[StreamedCompletion] = []
        self.current: StreamedCompletion | None = None  # the request in progress
        self.errors: list[str] = []
        self.paused_retries = 0  # requests refused while the engine was paused (503 engine_paused), retried
        self._stop = threading.Event()  # stop now, even in the middle of a request
        self._drain = threading.Event()  # start no new request
        if once:  # one request, then stop
            self._drain.set()
        self._thread = threading.Thread(target=self._run, name="streaming-client", daemon=True)

    def start(self) -> StreamingClient:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0, finish_current: bool = False) -> None:
        """Stop streaming; with `finish_current`, let the request in progress end normally first."""
        self._drain.set()
        if not finish_current:
            self._stop.set()
        self._thread.join(timeout)
        self._stop.set()

    def __enter__(self) -> StreamingClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for_chunks(self, n: int, timeout: float = 60.0) -> None:
        """Block until `n` chunks have arrived (the stream is warm); RuntimeError after `timeout`."""
        deadline = time.monotonic() + timeout
        while len(self.arrivals) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the stream produced {len(self.arrivals)} chunks in {timeout:.0f} s: {self.errors[-3:]}"
                )
            time.sleep(0.05)

    def max_gap_ms(self, t0: float, t1: float) -> float:
        """The longest stall of a running request overlapping [t0, t1] (intervals between requests excluded)."""
        return max_gap_ms(self.arrivals, t0, t1, self.firsts)

    def steady_gaps_ms(self, windows: list[tuple[float, float]], margin: float = 0.2) -> list[float]:
        """Chunk intervals within requests, away from every window (ms)."""
        return [
            (b - a) * 1e3
            for a, b in _intervals(self.arrivals, self.firsts)
            if all(b < t0 - margin or a > t1 + margin for t0, t1 in windows)
        ]

    def tokens_between(self, t0: float, t1: float) -> int:
        """Output tokens that arrived in [t0, t1]."""
        return sum(n for t, n in zip(self.arrivals, self.chunk_tokens) if t0 <= t <= t1)

    def in_progress(self) -> int | None:
        """Output tokens of the request in progress, or None between requests."""
        cur = self.current
        return None if cur is None or cur.finish_reason is not None else len(cur.tokens)

    def wait_for_tokens(self, n: int, timeout: float = 60.0) -> None:
        """Block until the request in progress has `n` output tokens (a new one may start meanwhile)."""
        deadline = time.monotonic() + timeout
        while True:
            cur = self.current
            if cur is not None and len(cur.tokens) >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no request reached {n} tokens in {timeout:.0f} s: {self.errors[-3:]}")
            time.sleep(0.005)

    def _run(self) -> None:
        import requests

        url = self.base_url + "/v1/completions"
        first_request = True
        paused_since: float | None = None  # the request being retried was first refused then
        while not self._stop.is_set() and (first_request or not self._drain.is_set() or paused_since is not None):
            first_request = False
            try:
                with requests.post(
                    url, json=self.body, headers=self.headers, stream=True, timeout=REQUEST_TIMEOUT_S
                ) as r:
                    if r.status_code == 503 and self._paused(r, paused_since):
                        paused_since = paused_since if paused_since is not None else time.monotonic()
                        self.paused_retries += 1
                        time.sleep(PAUSED_RETRY_S)
                        continue
                    if r.status_code != 200:
                        paused_since = None
                        self.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                        time.sleep(0.2)
                        continue
                    self.current = cur = StreamedCompletion("", started=time.perf_counter())
                    first = True
                    for line in r.iter_lines():
                        if line.startswith(b"data: ") and line != b"data: [DONE]":
                            now = time.perf_counter()
                            self.chunk_tokens.append(self._chunk(cur, line[6:]))
                            if first:
                                self.firsts.add(len(self.arrivals))
                                first = False
                            self.arrivals.append(now)
                        if self._stop.is_set():
                            return
                    cur.finished = time.perf_counter()
                    if cur.finish_reason is None:
                        self.errors.append(f"request {cur.id} ended without a finish_reason")
                    else:
                        self.completed.append(cur)
            except _Paused:
                if paused_since is not None and time.monotonic() - paused_since > REQUEST_TIMEOUT_S:
                    self.errors.append("generation stayed paused past the request timeout")
                    paused_since = None
                    continue
                paused_since = paused_since if paused_since is not None else time.monotonic()
                self.paused_retries += 1
                time.sleep(PAUSED_RETRY_S)
                continue
            except (requests.RequestException, ValueError) as exc:
                paused_since = None
                self.errors.append(str(exc))
                time.sleep(0.2)
            else:
                paused_since = None

    @staticmethod
    def _paused(response: Any, since: float | None) -> bool:
        """vLLM's 503 engine_paused, within the request's timeout since it was first refused."""
        if since is not None and time.monotonic() - since > REQUEST_TIMEOUT_S:
            return False
        try:
            return is_engine_paused(503, response.json())
        except ValueError:
            return False

    @staticmethod
    def _chunk(cur: StreamedCompletion, data: bytes) -> int:
        """Record one streamed event into `cur`; the number of output tokens it carried."""
        msg = json.loads(data)
        if "error" in msg:
            error = msg["error"]
            if not cur.tokens and is_engine_paused(error.get("code") if isinstance(error, dict) else None, msg):
                raise _Paused()
            raise ValueError(f"error event: {msg['error']}")
        cur.id = msg.get("id", cur.id)
        n = 0
        for choice in msg.get("choices") or ():
            ids = choice.get("token_ids") or []
            cur.tokens += ids
            n += len(ids)
            if choice.get("finish_reason") is not None:
                cur.finish_reason = choice["finish_reason"]
                cur.weight_versions = choice.get(WEIGHT_VERSIONS)
                cur.prefill_weight_versions = choice.get(PREFILL_WEIGHT_VERSIONS)
        return n


def metric_total(metrics_text: str, name: str) -> float:
    """The sum of a Prometheus counter over its label sets (0.0 when absent), from /metrics text."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$"
    return sum(float(v) for v in re.findall(pattern, metrics_text, re.M))


__all__ = ["StreamedCompletion", "StreamingClient", "max_gap_ms", "metric_total", "steady_gaps_ms"]
