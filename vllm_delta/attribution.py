"""Which policy versions produced a completion: the client side of `choices[i].weight_versions`.

A vLLM server with the vllm-delta plugin adds to every finished choice of /v1/completions and
/v1/chat/completions (the non-streaming body, and the streamed chunk that carries `finish_reason`):

    "weight_versions": [[7, 0, 25], [8, 25, 120]]

spans of [version, start, end): output tokens start..end-1 were sampled from logits computed with the
weights of that version. Versions are store version numbers (ints); a label that is not one (vLLM's
"default" before any version is known, or a label set through vLLM's own RL API) stays a string.
The same spans are kept by the server for a while under GET /v1/delta/timeline?id=<response id>.

    from vllm_delta.attribution import attribution_of
    a = attribution_of(response["choices"][0])
    a.first_version, a.last_version      # 7, 8
    a.switches                           # [25]: token 25 was the first one sampled on version 8
    a.version_at(30)                     # 8

With in-flight updates (`"mode": "inflight"`), tokens after a switch attend to KV that earlier
versions computed (the prompt's and the earlier tokens'): the spans say which weights produced each
token's logits, not which weights produced every key and value it attended to.

This module needs no vLLM (a trainer imports it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import wire

Version = int | str


def version_label(version: int | None) -> str:
    """vLLM's weight-version label for a store version (the server sets it; it is a string there)."""
    return "default" if version is None else str(int(version))


def parse_label(label: str | int) -> Version:
    """A label as a version: a store version number becomes an int, anything else stays a string."""
    if isinstance(label, int):
        return label
    return int(label) if label.isdigit() else label


class Span(NamedTuple):
    """Output tokens [start, end) were sampled on `version`. On the wire (wire.py) the array
    `[version, start, end]`; `{"version", "start", "end"}` is read too (vLLM 0.33's own form)."""

    version: Version
    start: int
    end: int


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

    def to_json(self) -> list[list[Any]]:
        """The spans as the server sends them: `[[version, start, end], ...]`."""
        plain: list[list[Any]] = wire.encode(self.spans)
        return plain


def parse_spans(raw: Iterable[Sequence[Any] | Mapping[str, Any]]) -> Attribution:
    """Spans as the server sends them ([version, start, end] lists; {"version", "start", "end"}
    mappings are accepted too). Raises ValueError if one is malformed or they do not tile the tokens
    from 0 in order."""
    try:
        spans = [wire.decode(Span, item) for item in raw]
    except TypeError as exc:
        raise ValueError(f"malformed weight_versions span: {exc}") from None
    spans = [s._replace(version=parse_label(s.version)) for s in spans]
    expected = 0
    for s in spans:
        if s.start != expected or s.end < s.start:
            raise ValueError(f"weight_versions spans do not tile the output tokens: {wire.encode(spans)}")
        expected = s.end
    return Attribution(tuple(spans))


def attribution_of(choice: Mapping[str, Any]) -> Attribution | None:
    """The attribution of one response choice (a dict of `response["choices"]`, or the streamed choice
    that carried `finish_reason`); None when the server sent none (not a vllm-delta server, beam search,
    or the choice has not finished)."""
    raw = choice.get("weight_versions")
    return None if raw is None else parse_spans(raw)


__all__ = ["Attribution", "Span", "Version", "attribution_of", "parse_label", "parse_spans", "version_label"]
