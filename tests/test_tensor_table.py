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
