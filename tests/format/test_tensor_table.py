"""The header's tensor table as columns (format.TensorTable): the same JSON bytes and the same errors
as the generic codec it shortcuts (wire.py), on well-formed and on malformed tables."""

from __future__ import annotations

import json
import random

import pytest

from vllm_delta import wire
from vllm_delta.errors import FormatError
from vllm_delta.format import TensorEntry, TensorTable, VersionHeader

NAMES = ["w", "model.layers.0.mlp.experts.3.up_proj.weight", "zeta", "a.b", "é-non-ascii", 'quote"d', "back\\slash"]


def random_table(rng: random.Random, n: int) -> dict[str, TensorEntry]:
    encs = [{}, {"at": 5, "start": 0}, {"at": 1}, {"x": [1, 2], "b": "s"}, {"start": 3, "at": 0}]
    out = {}
    for i in range(n):
        name = rng.choice(NAMES) + f".{i}"
        shape = [rng.randrange(0, 50) for _ in range(rng.randrange(0, 3))]
        numel = 1
        for d in shape:
            numel *= d
        out[name] = TensorEntry(
            shape,
            rng.choice(["BF16", "F32"]),
            f"{rng.getrandbits(64):016x}",
            rng.randrange(0, numel + 1),
            rng.choice(encs),
        )
    return out


def generic_json(entries: dict[str, TensorEntry]) -> str:
    return json.dumps(wire.encode(entries, dict[str, TensorEntry]), separators=(",", ":"), sort_keys=True)


@pytest.mark.parametrize("seed", range(5))
def test_the_table_writes_and_reads_what_the_generic_codec_does(seed):
    entries = random_table(random.Random(seed), 60)
    table = TensorTable.of(entries)
    text = table.to_json()
    assert text == generic_json(entries)
    back = TensorTable.from_plain(json.loads(text), "tensors")
    assert back == TensorTable.of(wire.decode_as(dict[str, TensorEntry], json.loads(text), "tensors"))
    assert dict(back.items()) == dict(sorted(entries.items()))
    back.check(1)


def test_a_whole_header_keeps_its_bytes():
    header = VersionHeader(
        version=3,
        kind="delta",
        tensors=random_table(random.Random(9), 20),
        checksum="0123456789abcdef",
        base=2,
        base_checksum="fedcba9876543210",
        codec="chunked",
        format_version=3,
        created=1.5,
        extra={"note": "\x00vllm-delta tensor table\x00"},  # the splice mark's text inside another field
        enc={"chunk_elems": 65536},
    )
    want = json.dumps(wire.encode(header), separators=(",", ":"), sort_keys=True)
    assert header.to_json() == want
    assert VersionHeader.from_json(want) == header


@pytest.mark.parametrize(
    "entry, where",
    [
        ({"shape": [2], "dtype": "BF16"}, "checksum"),  # missing key
        ({"shape": [2], "dtype": "BF16", "checksum": "0" * 16, "color": 1}, "color"),  # unknown key
        ({"shape": ["2"], "dtype": "BF16", "checksum": "0" * 16}, "shape"),
        ({"shape": [2], "dtype": "BF16", "checksum": "0" * 16, "nnz": 1.5}, "nnz"),
        ({"shape": [2], "dtype": "BF16", "checksum": "0" * 16, "enc": []}, "enc"),
        ("not an object", "w"),
    ],
)
def test_malformed_entries_fail_as_the_generic_codec_does(entry, where):
    data = {"ok": {"shape": [1], "dtype": "F32", "checksum": "1" * 16}, "w": entry}
    with pytest.raises((TypeError, ValueError)) as generic:
        wire.decode_as(dict[str, TensorEntry], data, "tensors")
    with pytest.raises(type(generic.value)) as ours:
        TensorTable.from_plain(data, "tensors")
    assert str(ours.value) == str(generic.value) and where in str(ours.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"checksum": "XYZ"}, "16 lower-case hex digits"),
        ({"dtype": "I8"}, "unsupported dtype"),
        ({"shape": [-1]}, "bad shape"),
        ({"nnz": 99}, "bad shape [3] or nnz 99"),
    ],
)
def test_check_names_the_bad_tensor(change, message):
    entries = {"a": TensorEntry([3], "BF16", "0" * 16, 1), "b": TensorEntry([3], "BF16", "0" * 16, 2)}
    table = TensorTable.of(entries)
    table.check(4)
    import dataclasses

    table["b"] = dataclasses.replace(entries["b"], **change)
    with pytest.raises(FormatError, match="tensor 'b'") as exc:
        table.check(4)
    assert message in str(exc.value)


# -- format 4: the table and a part's rows as columns ------------------------------------------------


def chunked_table(rng: random.Random, n: int) -> dict[str, TensorEntry]:
    """Entries as a file-level codec writes them: `enc` is {at, start} where a tensor changed, else {}."""
    out = {}
    for name, e in random_table(rng, n).items():
        enc = {"at": rng.randrange(0, 1000), "start": rng.randrange(0, 1 << 20)} if e.nnz else {}
        out[name] = TensorEntry(e.shape, e.dtype, e.checksum, e.nnz, enc)
    return out


def part_rows(rng: random.Random, entries: dict[str, TensorEntry]) -> dict[str, list[int]]:
    """Rows a part might own: a range within dim 0 of some tensors (holding their nnz), none of others."""
    rows = {}
    for name, e in entries.items():
        n_rows = e.shape[0] if e.shape else 1  # a scalar is one row
        if n_rows > 0 and (e.nnz or rng.random() < 0.7):
            rows[name] = [0, n_rows]
    return rows


def columns_header(entries: dict[str, TensorEntry], rows: dict[str, list[int]] | None) -> VersionHeader:
    from vllm_delta.format import COLUMNS_FORMAT_VERSION, PartInfo

    part = None if rows is None else PartInfo(index=1, count=3, checksum="0123456789abcdef", rows=rows)
    return VersionHeader(
        version=7,
        kind="delta",
        tensors=entries,
        checksum="0123456789abcdef",
        base=6,
        base_checksum="fedcba9876543210",
        codec="chunked",
        format_version=COLUMNS_FORMAT_VERSION,
        created=2.5,
        part=part,
        enc={"chunk_elems": 65536, "elems": 12},
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("one_file", [True, False], ids=["one-file", "part"])
def test_format_4_writes_columns_and_reads_back_what_format_3_does(seed, one_file):
    rng = random.Random(seed)
    entries = chunked_table(rng, 80)
    rows = None if one_file else part_rows(rng, entries)
    header = columns_header(entries, rows)
    text = header.to_json()
    doc = json.loads(text)
    cols = doc["tensors"]
    names = sorted(entries)
    assert cols["name"] == names and cols["shape"] == [entries[n].shape for n in names]
    assert cols["enc"]["at"] == [entries[n].enc.get("at") for n in names]
    assert all(type(v) is list for v in cols.values() if v is not cols["enc"])  # no object per tensor
    if rows is not None:
        assert doc["part"]["rows"] == [rows.get(n) for n in names]
    back = VersionHeader.from_json(text)
    assert back == header and back.to_json() == text
    # the same header as format 3 (a dict per tensor, the part's rows keyed by name) reads as the same thing
    with pytest.raises(FormatError, match="malformed version header"):  # columns labelled format 3
        VersionHeader.from_json(json.dumps(dict(doc, format_version=3)))
    old = VersionHeader.from_json(
        json.dumps({**wire.encode(header), "format_version": 3}, separators=(",", ":"), sort_keys=True)
    )
    assert old.tensors == back.tensors and old.part == back.part
    assert len(text) < 0.75 * len(old.to_json())


def test_a_table_without_a_column_form_is_not_written_as_format_4():
    entries = {"w": TensorEntry([4], "BF16", "0" * 16, 1, {"at": 0, "start": 0, "extra": 1})}
    with pytest.raises(ValueError, match="no column form"):
        columns_header(entries, None).to_json()
    entries = {"w": TensorEntry([4], "BF16", "0" * 16, 0, {})}
    with pytest.raises(ValueError, match="does not list"):
        columns_header(entries, {"w": [0, 4], "ghost": [0, 1]}).to_json()


def _mutated(doc: dict, path: tuple, value: object) -> str:
    import copy

    doc = copy.deepcopy(doc)
    at = doc
    for key in path[:-1]:
        at = at[key]
    if value is KeyError:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return json.dumps(doc)


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("tensors", "nnz"), KeyError, "fields"),
        (("tensors", "color"), [1, 2], "fields"),
        (("tensors",), [], "fields"),
        (("tensors", "enc"), {"at": [None, None]}, "enc must hold"),
        (("tensors", "dtype"), ["BF16"], "all of one length"),
        (("tensors", "name"), "ab", "every column is a list"),
        (("tensors", "nnz"), [1, "2"], "nnz ints"),
        (("tensors", "nnz"), [1, True], "nnz ints"),
        (("tensors", "shape"), [[4], ["2"]], "shapes lists of ints"),
        (("tensors", "shape"), [[4], 2], "shapes lists of ints"),
        (("tensors", "checksum"), ["0" * 16, 5], "checksums are strings"),
        (("tensors", "enc", "at"), [None, 3], "null together"),
        (("tensors", "name"), ["a", "a"], "listed twice"),
        (("part", "rows"), [[0, 4]], "one entry"),
        (("part", "rows"), {"a": [0, 4]}, "one entry"),
        (("part", "rows"), [[0, 4], [0, 9]], "bad row range"),
        (("part", "rows"), [[0, 4], [0, "2"]], "bad row range"),
        (("part", "rows"), [None, [0, 2]], "changes a tensor it does not own"),
        (("part", "rows"), [[0, 4], [0, 1]], "nnz 2 for 1 owned"),
        (("tensors", "checksum"), ["0" * 16, "XYZ"], "16 lower-case hex"),
        (("tensors", "dtype"), ["BF16", "I8"], "unsupported dtype"),
    ],
)
def test_malformed_columns_are_a_format_error(path, value, message):
    entries = {
        "a": TensorEntry([4, 2], "BF16", "0" * 16, 3, {"at": 0, "start": 0}),
        "b": TensorEntry([2], "F32", "1" * 16, 2, {"at": 1, "start": 9}),
    }
    doc = json.loads(columns_header(entries, {"a": [0, 4], "b": [0, 2]}).to_json())
    VersionHeader.from_json(json.dumps(doc))
    with pytest.raises(FormatError, match=message):
        VersionHeader.from_json(_mutated(doc, path, value))


DAMAGES = ("none", "past the end", "empty", "negative", "dropped", "one row", "unknown tensor", "bool", "triple")


@pytest.mark.parametrize("seed", range(36))
def test_the_row_checks_at_array_speed_decide_as_the_loop_does(seed, monkeypatch):
    """`_rows_fit` (arrays) accepts a part's rows exactly when the per-tensor loop does, and on any
    damage the loop's error is what the reader raises."""
    import dataclasses

    from vllm_delta import format as fmt

    rng = random.Random(seed)
    kind = ("delta", "anchor")[seed % 2]
    damage = DAMAGES[(seed // 2) % len(DAMAGES)]
    entries = chunked_table(rng, 12)
    rows = part_rows(rng, entries)
    if kind == "anchor":  # an anchor's part stores every element of the rows it owns
        entries = {n: dataclasses.replace(e, nnz=e.numel if n in rows else 0, enc={}) for n, e in entries.items()}
    name = rng.choice(sorted(rows))
    r0, r1 = rows[name]
    rows[name] = {
        "none": [r0, r1],
        "past the end": [r0, r1 + 1],
        "empty": [r1, r1],
        "negative": [-1, r1],
        "dropped": None,
        "one row": [r0, r0 + 1],
        "unknown tensor": [r0, r1],
        "bool": [False, r1],
        "triple": [r0, r1, r1],
    }[damage]
    if rows[name] is None:
        del rows[name]
    if damage == "unknown tensor":
        rows["ghost"] = [0, 1]
    header = columns_header(entries, None)
    header.kind = kind
    header.part = fmt.PartInfo(index=0, count=2, checksum="0" * 16, rows=rows)

    def outcome() -> str:
        try:
            header._validate_part(header.part)
        except FormatError as exc:
            return str(exc)
        return "ok"

    fast = outcome()
    monkeypatch.setattr(fmt.header, "_rows_fit", lambda *a: False)  # where the header check finds it
    slow = outcome()
    assert fast == slow
    if damage == "none":
        assert fast == "ok"
    elif damage not in ("one row", "dropped", "bool"):  # fine where the tensor has few changes; False is 0
        assert fast != "ok"
