"""A streaming client for tests, benchmarks and the demo: greedy completions back to back, with the
arrival time of every chunk, so that the stall an update causes can be measured from the outside.

    with StreamingClient(srv.base_url, srv.model) as stream:
        ...                                   # updates happen meanwhile
    stream.max_gap_ms(t0, t1)                 # the longest chunk interval overlapping [t0, t1]

Talks to 127.0.0.1 only in this project's use; its loop stops when `stop()` is called.
"""

from __future__ import annotations

import threading
import time
from typing import Any


def max_gap_ms(arrivals: list[float], t0: float, t1: float) -> float:
    """The longest interval between consecutive chunks that overlaps [t0, t1], in ms."""
    best = 0.0
    for a, b in zip(arrivals, arrivals[1:]):
        if b >= t0 and a <= t1:
            best = max(best, b - a)
    return best * 1e3


def steady_gaps_ms(arrivals: list[float], windows: list[tuple[float, float]], margin: float = 0.2) -> dict[str, float]:
    """Chunk intervals away from every window (ms): the noise floor that update gaps stand on.

    Chunks often arrive several per network read, so the median is near zero; p99 and max say how
    long the stream stalls by itself (scheduling noise, a new request's prefill)."""
    out = sorted(
        (b - a) * 1e3
        for a, b in zip(arrivals, arrivals[1:])
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
        prompt: str = "once upon a time there was a",
        max_tokens: int = 48,
    ):
        self.base_url, self.model = base_url, model
        self.headers = dict(headers or {})
        self.body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        self.arrivals: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="streaming-client", daemon=True)

    def start(self) -> StreamingClient:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

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
        return max_gap_ms(self.arrivals, t0, t1)

    def _run(self) -> None:
        import requests

        url = self.base_url + "/v1/completions"
        while not self._stop.is_set():
            try:
                with requests.post(url, json=self.body, headers=self.headers, stream=True, timeout=120) as r:
                    if r.status_code != 200:
                        self.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                        time.sleep(0.2)
                        continue
                    for line in r.iter_lines():
                        if line.startswith(b"data: ") and line != b"data: [DONE]":
                            self.arrivals.append(time.perf_counter())
                        if self._stop.is_set():
                            return
            except requests.RequestException as exc:
                self.errors.append(str(exc))
                time.sleep(0.2)


__all__ = ["StreamingClient", "max_gap_ms", "steady_gaps_ms"]
