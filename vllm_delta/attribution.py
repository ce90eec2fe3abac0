"""Which policy versions produced a completion: the client side of `choices[i].weight_versions`.

A request to /v1/completions or /v1/chat/completions that sets `"return_weight_versions": true`
(vLLM 0.33's flag; `request_weight_versions(body)` sets it) gets, on every finished choice (the
non-streaming body, and the streamed chunk that carries `finish_reason`), vLLM's spans:

    "weight_versions": [{"version": "7", "start": 0, "end": 25}, {"version": "8", "start": 25, "end": 120}]

output tokens start..end-1 were sampled from logits computed with the weights labelled `version`
(vLLM 0.33 writes them itself; a vllm-delta server writes the same objects on vLLM 0.32, and keeps them
exact across its in-flight updates). A vllm-delta server adds the prompt's provenance beside them,
in SGLang's sense and the same objects:

    "prefill_weight_versions": [{"version": "7", "start": 0, "end": 128}, {"version": "8", "start": 128, "end": 150}]

the KV of prompt positions start..end-1 was computed with those weights (a prefix-cache hit keeps
the version that computed the cached blocks). Older vllm-delta servers sent `[[7, 0, 25], ...]`
lists unasked: both forms are read. Versions parse to store version numbers (ints); a label that is
not one ("default" before any version is known, a label set through vLLM's own RL API) stays a string.
The output spans are kept by the server for a while under GET /v1/delta/timeline?id=<response id>.

    from vllm_delta.attribution import attribution_of, prompt_attribution_of
    a = attribution_of(response["choices"][0])
    a.first_version, a.last_version      # 7, 8
    a.switches                           # [25]: token 25 was the first one sampled on version 8
    a.version_at(30)                     # 8
    prompt_attribution_of(response["choices"][0]).versions   # [7, 8]

With in-flight updates (`"mode": "inflight"`), tokens after a switch attend to KV that earlier
versions computed (the prompt's and the earlier tokens'): `weight_versions` says which weights produced
each token's logits, `prefill_weight_versions` which produced the prompt's keys and values.

This module needs no vLLM (a trainer imports it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import wire

Version = int | str

RETURN_WEIGHT_VERSIONS = "return_weight_versions"  # the request flag (vLLM 0.33's)
WEIGHT_VERSIONS = "weight_versions"  # choices[i]: output-token spans (vLLM's key)
PREFILL_WEIGHT_VERSIONS = "prefill_weight_versions"  # choices[i]: prompt-position spans (SGLang's key)


def request_weight_versions(body: dict[str, Any]) -> dict[str, Any]:
    """A completion or chat request body that asks for the spans (a copy; the body is not changed)."""
    return {**body, RETURN_WEIGHT_VERSIONS: True}


def version_label(version: int | None) -> str:
    """vLLM's weight-version label for a store version (the server sets it; it is a string there)."""
    return "default" if version is None else str(int(version))


def parse_label(label: str | int) -> Version:
    """A label as a version: a store version number becomes an int, anything else stays a string."""
    if isinstance(label, int):
        return label
    return int(label) if label.isdigit() else label


class Span(NamedTuple):
    """Output tokens [start, end) were sampled on `version`. `to_json` writes vLLM's object; read from
    that object or from the `[version, start, end]` array of older servers (wire.py's NamedTuple form)."""

    version: Version
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        """vLLM's schema: {"version": label (a string), "start", "end"}."""
        return {"version": str(self.version), "start": self.start, "end": self.end}


@dataclass(frozen=True)
class Attribution:
    """The versions behind one completion (one choice), in token order."""

    spans: tuple[Span, ...]

    @property
    def first_version(self) -> Version | None:
        """The version that produced the first output token (None for an empty completion)."""
        return self.spans[0].version if self.spans else None

    @property
    def last_version(self) -> Version | None:
        """The version that produced the last output token."""
        return self.spans[-1].version if self.spans else None

    @property
    def versions(self) -> list[Version]:
        """Every version involved, in order."""
        return [s.version for s in self.spans]

    @property
    def switches(self) -> list[int]:
        """Token indices at which the weights changed: token i is the first one of a new version."""
        return [s.start for s in self.spans[1:]]

    @property
    def switch_index(self) -> int | None:
        """The first switch (None when one version produced every token)."""
        return self.spans[1].start if len(self.spans) > 1 else None

    @property
    def num_tokens(self) -> int:
        return self.spans[-1].end if self.spans else 0

    @property
    def mixed(self) -> bool:
        """More than one version produced this completion."""
        return len(self.spans) > 1

    def version_at(self, index: int) -> Version:
        """The version that produced output token `index`."""
        for s in self.spans:
            if s.start <= index < s.end:
                return s.version
        raise IndexError(f"token {index} is outside the completion's {self.num_tokens} tokens")

    def token_versions(self) -> list[Version]:
        """One version per output token (e.g. to pick the behaviour policy per token)."""
        return [s.version for s in self.spans for _ in range(s.start, s.end)]

    def to_json(self) -> list[dict[str, Any]]:
        """The spans in vLLM's schema: `[{"version": "7", "start": 0, "end": 25}, ...]`."""
        return [s.to_json() for s in self.spans]


def parse_spans(raw: Iterable[Sequence[Any] | Mapping[str, Any]]) -> Attribution:
    """Spans as servers send them: vLLM's {"version", "start", "end"} objects, or the [version, start,
    end] lists of older vllm-delta servers. Raises ValueError if one is malformed or they do not tile
    the tokens from 0 in order."""
    try:
        spans = [wire.decode(Span, item) for item in raw]
    except TypeError as exc:
        raise ValueError(f"malformed weight_versions span: {exc}") from None
    spans = [s._replace(version=parse_label(s.version)) for s in spans]
    expected = 0
    for s in spans:
        if s.start != expected or s.end < s.start:
            raise ValueError(f"weight_versions spans do not tile the output tokens: {[s.to_json() for s in spans]}")
        expected = s.end
    return Attribution(tuple(spans))


def attribution_of(choice: Mapping[str, Any]) -> Attribution | None:
    """The attribution of one response choice's output tokens (a dict of `response["choices"]`, or the
    streamed choice that carried `finish_reason`); None when the server sent none (the request did not
    ask, a server without spans, beam search, or the choice has not finished)."""
    raw = choice.get(WEIGHT_VERSIONS)
    return None if raw is None else parse_spans(raw)


def prompt_attribution_of(choice: Mapping[str, Any]) -> Attribution | None:
    """Which versions computed the KV of the choice's prompt positions (`prefill_weight_versions`);
    None when the server sent none."""
    raw = choice.get(PREFILL_WEIGHT_VERSIONS)
    return None if raw is None else parse_spans(raw)


__all__ = [
    "PREFILL_WEIGHT_VERSIONS",
    "RETURN_WEIGHT_VERSIONS",
    "WEIGHT_VERSIONS",
    "Attribution",
    "Span",
    "Version",
    "attribution_of",
    "parse_label",
    "parse_spans",
    "prompt_attribution_of",
    "request_weight_versions",
    "version_label",
]
