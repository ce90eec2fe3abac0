"""The store's JSON documents through wire.py's codec: every document the previous code wrote reads and
writes back byte for byte, and a malformed one is a FormatError naming the document and the field.

The documents: tests/data/documents_5ffad64 (every kind, written by commit 5ffad64, before the documents
moved onto the codec: tests/data/make_documents.py) and tests/data/store_fcd5eec (records and version
files written before the chunked codec: tests/data/make_old_store.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from vllm_delta import wire
from vllm_delta.attribution import Span, parse_spans
from vllm_delta.errors import FormatError
from vllm_delta.format import VersionHeader
from vllm_delta.mirror.lease import LeaseDoc
from vllm_delta.store.marks import BadMark
from vllm_delta.store.records import StoreHead, VersionRecord
from vllm_delta.store.replicas import ReplicaReport
from vllm_delta.wire import Document

DATA = Path(__file__).parent / "data"
DOCS = DATA / "documents_5ffad64"
OLD_STORE = DATA / "store_fcd5eec"

KINDS: dict[str, type[Document]] = {
    "versions": VersionRecord,
    "bad": BadMark,
    "replicas": ReplicaReport,
    "mirror": LeaseDoc,
}


def documents() -> list[tuple[str, type[Document]]]:
    """(path relative to tests/data, its type) of every stored document."""
    out = []
    for root in (DOCS, DOCS / "mirrored", OLD_STORE):
        if (root / "head.json").exists():
            out.append((root / "head.json", StoreHead))
        for folder, cls in KINDS.items():
            out += [(p, cls) for p in sorted((root / folder).glob("*.json"))]
    return [(str(p.relative_to(DATA)), cls) for p, cls in out]


def headers() -> list[tuple[str, str]]:
    """(name, header text) of every stored version header: the extracted ones and the old store's files."""
    out = [(str(p.relative_to(DATA)), p.read_text()) for p in sorted((DOCS / "headers").glob("*.json"))]
    for p in sorted((OLD_STORE / "data").glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            out.append((str(p.relative_to(DATA)), f.metadata()["header"]))
    return out


def test_the_test_data_holds_every_kind_of_document():
    found = {(cls, json.loads((DATA / p).read_text()).get("format_version")) for p, cls in documents()}
    assert found >= {(VersionRecord, 1), (VersionRecord, 2), (StoreHead, 1), (BadMark, 1)}
    assert found >= {(ReplicaReport, 1), (LeaseDoc, 1)}
    records = [json.loads((DATA / p).read_text()) for p, cls in documents() if cls is VersionRecord]
    assert any("sha256" in r for r in records) and any("sha256" not in r and "file" in r for r in records)
    assert any("sha256" in p for r in records for p in r.get("parts", ()))
    reports = [json.loads((DATA / p).read_text()) for p, cls in documents() if cls is ReplicaReport]
    assert {r["region"] for r in reports} == {None, "eu"}
    assert {json.loads(text)["format_version"] for _, text in headers()} == {1, 2, 3}
    assert any("part" in json.loads(text) and json.loads(text)["format_version"] == 3 for _, text in headers())


@pytest.mark.parametrize("path, cls", documents(), ids=[p for p, _ in documents()])
def test_old_documents_read_and_write_back_byte_for_byte(path, cls):
    data = (DATA / path).read_bytes()
    doc = cls.from_json(data, where=path)
    assert doc.to_json().encode() == data
    assert cls.from_json(doc.to_json()) == doc


@pytest.mark.parametrize("name, text", headers(), ids=[n for n, _ in headers()])
def test_old_version_headers_read_and_write_back_byte_for_byte(name, text):
    header = VersionHeader.from_json(text, where=name)
    assert header.to_json() == text
    assert VersionHeader.from_json(header.to_json()) == header


def test_attribution_spans_write_back():
    text = (DOCS / "attribution.json").read_text()
    spans = parse_spans(json.loads(text))
    # 5ffad64's servers sent the spans as arrays (wire.py's NamedTuple form, byte for byte); the
    # server now sends vLLM 0.33's objects (issue 24), which read back to the same spans
    assert json.dumps(wire.encode(list(spans.spans))) == text
    assert spans.to_json()[0] == {"version": "7", "start": 0, "end": 25}
    assert parse_spans(spans.to_json()) == spans
    assert spans.spans[0] == Span(7, 0, 25) and spans.spans[2].version == "default"


def test_numbers_keep_the_type_they_were_written_with():
    """A float field written as an integer (by a caller's int time stamp) writes back as an integer."""
    head = StoreHead.from_json(
        b'{"format": "vllm-delta-head", "format_version": 1, "version": 3, '
        b'"checksum": "0123456789abcdef", "written": 17}'
    )
    assert head.written == 17 and isinstance(head.written, int) and '"written": 17\n' in head.to_json()


def _doc(path: str) -> dict:
    return json.loads((DOCS / path).read_text())


@pytest.mark.parametrize(
    "cls, path, change, match",
    [
        (VersionRecord, "versions/0000000001.json", {"version": "1"}, r"VersionRecord\.version: str where int"),
        (VersionRecord, "versions/0000000001.json", {"kind": "patch"}, r"VersionRecord\.kind: 'patch' is not one of"),
        (VersionRecord, "versions/0000000001.json", {"created": True}, r"VersionRecord\.created: bool where a number"),
        (VersionRecord, "versions/0000000001.json", {"file": None, "parts": None}, "lists its parts"),
        (VersionRecord, "versions/0000000010.json", {"parts": [{"file": 3}]}, r"VersionRecord\.parts\[0\]\.file"),
        (VersionRecord, "versions/0000000010.json", {"parts": "none"}, "parts must be a list"),
        (VersionRecord, "versions/0000000001.json", {"format_version": 3}, "unknown format version 3"),
        (VersionRecord, "versions/0000000001.json", {"format": "x"}, "not a vllm-delta-record document"),
        (StoreHead, "head.json", {"version": -1}, "bad version or checksum"),
        (StoreHead, "head.json", {"written": "now"}, r"StoreHead\.written: str where a number"),
        (BadMark, "bad/0000000002.json", {"reason": ""}, "reason"),
        (BadMark, "bad/0000000002.json", {"by": None}, r"BadMark\.by: null where str"),
        (ReplicaReport, "replicas/gpu-0.json", {"served_version": "three"}, r"ReplicaReport\.served_version"),
        (ReplicaReport, "replicas/gpu-0.json", {"region": "e.u"}, "bad region"),
        (LeaseDoc, "mirror/lease.json", {"pid": "1"}, r"LeaseDoc\.pid: str where int"),
        (LeaseDoc, "mirror/lease.json", {"heartbeat": None}, r"LeaseDoc\.heartbeat"),
    ],
)
def test_malformed_documents_are_format_errors_naming_the_field(cls, path, change, match):
    doc = {**_doc(path), **change}
    with pytest.raises(FormatError, match=f"unreadable {cls.DESCRIPTION} {path}: .*{match}"):
        cls.from_json(json.dumps(doc), where=path)
    missing = {k: v for k, v in _doc(path).items() if k != "checksum" and k != "token"}
    with pytest.raises(FormatError, match="is missing"):
        cls.from_json(json.dumps(missing), where=path)


def test_documents_ignore_unknown_keys_and_take_defaults():
    record = {**_doc("versions/0000000001.json"), "added_later": [1, 2]}
    assert VersionRecord.from_json(json.dumps(record)) == VersionRecord.from_json(
        json.dumps(_doc("versions/0000000001.json"))
    )
    report = _doc("replicas/gpu-0.json")
    del report["region"]  # reports from before regions
    assert ReplicaReport.from_json(json.dumps(report)).region is None


def test_garbage_is_a_format_error():
    for data in (b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe", b"null"):
        for cls in (VersionRecord, StoreHead, BadMark, ReplicaReport, LeaseDoc):
            with pytest.raises(FormatError, match=f"unreadable {cls.DESCRIPTION}"):
                cls.from_json(data)


def test_headers_refuse_unknown_keys_and_name_the_field():
    _, text = headers()[1]
    raw = json.loads(text)
    with pytest.raises(FormatError, match=r"VersionHeader: unknown keys \['future'\]"):
        VersionHeader.from_json(json.dumps({**raw, "future": 1}))
    name = next(iter(raw["tensors"]))
    entry = {**raw["tensors"][name], "future": 1}
    with pytest.raises(FormatError, match=r"TensorEntry: unknown keys"):
        VersionHeader.from_json(json.dumps({**raw, "tensors": {**raw["tensors"], name: entry}}))
    entry = {**raw["tensors"][name], "shape": [2, "x"]}
    with pytest.raises(FormatError, match=r"malformed version header in h: .*shape\[1\]: str where int"):
        VersionHeader.from_json(json.dumps({**raw, "tensors": {**raw["tensors"], name: entry}}), where="h")


def test_every_document_kind_is_on_the_codec():
    """No document spells its fields by hand: each one is a wire.Document (or, for the header, goes
    through wire.encode / wire.decode) and defines no to_json / from_json of its own."""
    for cls in (VersionRecord, StoreHead, BadMark, ReplicaReport, LeaseDoc):
        assert issubclass(cls, Document) and "to_json" not in vars(cls) and "from_json" not in vars(cls)


@pytest.mark.parametrize(
    "data",
    [
        {"a": [0, 4], "b": [4, 8]},  # the fast path: every item a list of exact ints
        {"a": [0, 4], "b": [True, 8]},  # a bool is an int to the element decoder, not to the fast path
        {"a": [0, 4], "b": None},
        {"a": [0, 4], "b": [0, "8"]},
        {"a": [0, 4], "b": (0, 8)},
        {"a": [0, 4], "b": 8},
        {},
    ],
)
def test_a_mapping_of_lists_decodes_as_item_by_item(data):
    """A part's row ranges (dict[str, list[int]], one per tensor) are copied in one pass where every item
    is a list of exact ints; anything else takes the item decoder: the same result or the same error."""
    from vllm_delta.wire import _decoder

    item = _decoder(list[int])

    def outcome(decode):
        try:
            return decode()
        except (TypeError, ValueError) as exc:
            return type(exc)

    fast = outcome(lambda: wire.decode_as(dict[str, list[int]], data, "rows"))
    one_by_one = outcome(lambda: {k: item(v, "rows") for k, v in data.items()})
    assert fast == one_by_one
    if isinstance(fast, dict):
        assert all(type(v) is list and v is not data[k] for k, v in fast.items())  # copies, as the decoder makes
