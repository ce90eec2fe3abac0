"""In-flight updates under streaming load, shared by the TP=1 and TP=2 tests (imported by name).

`updates_under_load` keeps N streaming clients generating the whole time and applies a list of
in-flight updates. After each update: the live checksum equals the trainer's, and greedy completions
started right after it (while the streams go on, their requests still holding pre-update KV) equal
the reference outputs at that version. At the end: no request failed or was preempted (vLLM's
/metrics), and every streamed completion's `weight_versions` equals what the engine's update
timeline (/v1/delta/timeline) implies for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm_helpers import LONG_PROMPT

from vllm_delta.attribution import (
    Attribution,
    attribution_of,
    parse_label,
    prompt_attribution_of,
    request_weight_versions,
)
from vllm_delta.testing.client import StreamedCompletion, StreamingClient, metric_total
from vllm_delta.testing.server import VllmServer

PREEMPTIONS = "vllm:num_preemptions_total"


def greedy(server: VllmServer, prompts, max_tokens: int = 16) -> list[dict[str, Any]]:
    """Greedy completions: text, cached prompt tokens (--enable-prompt-tokens-details), output spans and
    prompt spans (asked with `return_weight_versions`), both as [version, start, end] lists."""
    out = []
    for p in prompts:
        body = {"model": server.model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0}
        r = server.post("/v1/completions", request_weight_versions(body), timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        details = data["usage"].get("prompt_tokens_details") or {}
        choice = data["choices"][0]
        output, prompt = attribution_of(choice), prompt_attribution_of(choice)
        out.append(
            {
                "text": choice["text"],
                "cached": details.get("cached_tokens"),
                "prompt_tokens": data["usage"]["prompt_tokens"],
                "spans": None if output is None else listed(output),
                "prefill": None if prompt is None else listed(prompt),
            }
        )
    return out


def listed(attribution: Attribution) -> list[list[Any]]:
    """Spans as [version, start, end] lists, store versions as ints (what expected_spans gives)."""
    return [[s.version, s.start, s.end] for s in attribution.spans]


def greedy_texts(server: VllmServer, prompts, max_tokens: int = 16) -> list[str]:
    """Greedy completion texts of `prompts`, all in one request (the engine runs them side by side)."""
    body = {"model": server.model, "prompt": list(prompts), "max_tokens": max_tokens, "temperature": 0.0}
    r = server.post("/v1/completions", body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts), choices
    return [c["text"] for c in choices]


def preemptions(server: VllmServer) -> float:
    return metric_total(server.get("/metrics").text, PREEMPTIONS)


@dataclass
class LoadReport:
    updates: list[dict[str, Any]] = field(default_factory=list)
    completed: list[StreamedCompletion] = field(default_factory=list)
    timeline: dict[str, Any] = field(default_factory=dict)
    preemptions: float = 0.0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)  # response id -> max_tokens it asked for


def updates_under_load(
    server: VllmServer,
    plan: list[tuple[int, dict[str, Any]]],
    checksums: dict[int, str],
    references: dict[int, list[str]],
    prompts: list[str],
    *,
    streams: int = 4,
    max_tokens: int = 96,
) -> LoadReport:
    """Apply `plan` ([(version, extra update fields)]) in flight while `streams` clients stream."""
    report = LoadReport()
    before = preemptions(server)
    stream_prompts = [LONG_PROMPT if i % 2 == 0 else prompts[i % len(prompts)] for i in range(streams)]
    # Different lengths, so that the streams do not finish (and restart) together.
    lengths = [max_tokens - 8 * i for i in range(streams)]
    clients = [
        StreamingClient(server.base_url, server.model, prompt=p, max_tokens=n, headers=server.headers())
        for p, n in zip(stream_prompts, lengths)
    ]
    for c in clients:
        c.start()

    def mid_request() -> bool:  # at least two streams are well inside a request
        return sum(1 for c, n in zip(clients, lengths) if 2 <= (c.in_progress() or 0) <= n - 24) >= 2

    try:
        for c in clients:
            c.wait_for_tokens(4, timeout=120)
        for i, (version, extra) in enumerate(plan):
            if i % 2 == 0:  # every other update is prefetched: the update call is then just the commit
                staged = server.post("/v1/delta/stage", {"version": version, **extra})
                assert staged.status_code == 200, staged.text
            wait_until(mid_request, timeout=120, what="streams in the middle of their requests")
            res = server.update(version, mode="inflight", **extra)
            assert res["version"] == version and res["mode"] == "inflight", res
            assert res["prefetched"] == (i % 2 == 0), res
            st = server.status()
            assert st["checksum"] == checksums[version], f"live weights differ from the trainer's at {version}"
            got = greedy_texts(server, prompts)
            if got != references[version]:
                report.mismatches.append(f"version {version}: {got} != {references[version]}")
            report.updates.append(res)
    finally:
        for c in clients:
            c.stop(timeout=120, finish_current=True)
    report.preemptions = preemptions(server) - before
    report.errors = [e for c in clients for e in c.errors]
    report.completed = [r for c in clients for r in c.completed]
    report.lengths = {r.id: n for c, n in zip(clients, lengths) for r in c.completed}
    report.timeline = server.get("/v1/delta/timeline").json()
    return report


def expected_spans(gen_id: str, n_tokens: int, history: list[dict[str, Any]]) -> list[list[Any]] | None:
    """The spans the update timeline implies for one generate() request, or None when no commit
    happened while it held KV (then one span, whatever version was live)."""
    commits = [h for h in history if gen_id in (h.get("switch") or {})]
    if not commits:
        return None
    spans: list[list[Any]] = []
    version, start = parse_label(commits[0]["previous_label"]), 0
    for h in commits:
        end = h["switch"][gen_id]
        spans.append([version, start, end])
        version, start = parse_label(h["label"]), end
    spans.append([version, start, n_tokens])
    merged: list[list[Any]] = []
    for s in spans:
        if s[1] == s[2]:
            continue  # no token was sampled on that version
        if merged and merged[-1][0] == s[0]:
            merged[-1][2] = s[2]
        else:
            merged.append(list(s))
    return merged


def check_attribution(report: LoadReport) -> int:
    """Every streamed request: finished normally, spans tile its tokens and equal the timeline's.
    Returns how many requests straddled at least one update."""
    history = report.timeline["history"]
    live = {parse_label(h["label"]) for h in history}
    straddled = 0
    for req in report.completed:
        max_tokens = report.lengths[req.id]
        assert req.finish_reason == "length" and len(req.tokens) == max_tokens, req
        attribution = attribution_of({"weight_versions": req.weight_versions})
        assert attribution is not None and attribution.num_tokens == max_tokens, req
        expected = expected_spans(f"{req.id}-0", max_tokens, history)
        if expected is None:
            assert len(attribution.spans) == 1 and attribution.first_version in live, req
        else:
            assert listed(attribution) == expected, (req.id, req.weight_versions, expected)
            straddled += attribution.mixed
    return straddled


def wait_until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
