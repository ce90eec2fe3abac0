"""Format 5: the header's tensor table and a part's rows as packed arrays (format/arrays.py). A table
written as arrays reads back equal to its format-4 form, field by field; a reader makes no Python
object per tensor for it; malformed arrays are a FormatError naming what is wrong (the tensor, where
there is one); the parts of a version are checked and merged as arrays."""

from __future__ import annotations

import copy
import gc
import json
import random
import sys

import numpy as np
import pytest
import torch

from vllm_delta.errors import FormatError
from vllm_delta.format import (
    ARRAYS_FORMAT_VERSION,
    COLUMNS_FORMAT_VERSION,
    PartInfo,
    RowMap,
    TensorEntry,
    TensorTable,
    Version,
    VersionFile,
    VersionHeader,
    write,
)

NAMES = ["w", "model.layers.0.mlp.experts.3.up_proj.weight", "zeta", "a.b", "é-non-ascii", 'quote"d', "back\\slash"]


def table_entries(rng: random.Random, n: int) -> dict[str, TensorEntry]:
    """Entries as a file-level codec writes them: 0-d to 3-d shapes (zero dims too), three dtypes,
    `enc` {at, start} where a tensor changed, else {}."""
    out = {}
    for i in range(n):
        shape = [rng.randrange(0, 40) for _ in range(rng.randrange(0, 4))]
        numel = int(np.prod(shape)) if shape else 1
        nnz = rng.randrange(0, numel + 1)
        enc = {"at": rng.randrange(0, 1 << 40), "start": rng.randrange(0, numel + 1)} if nnz else {}
        dtype = rng.choice(["BF16", "F16", "F32"])
        out[f"{rng.choice(NAMES)}.{i}"] = TensorEntry(shape, dtype, f"{rng.getrandbits(64):016x}", nnz, enc)
    return out


def rows_of(rng: random.Random, entries: dict[str, TensorEntry]) -> dict[str, list[int]]:
    return {n: [0, e.shape[0] if e.shape else 1] for n, e in entries.items() if (e.shape[:1] or [1])[0] > 0}


def header_of(entries: dict, rows: dict | None, fv: int, index: int = 1, count: int = 3) -> VersionHeader:
    names = sorted(entries)
    part = None if rows is None else PartInfo(index=index, count=count, checksum="0123456789abcdef", rows=rows)
    return VersionHeader(
        version=7,
        kind="delta",
        tensors={n: entries[n] for n in names},
        checksum="0123456789abcdef",
        base=6,
        base_checksum="fedcba9876543210",
        codec="chunked",
        format_version=fv,
        created=2.5,
        part=part,
        enc={"chunk_elems": 65536, "elems": 12},
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("one_file", [True, False], ids=["one-file", "part"])
def test_format_5_reads_back_what_format_4_does(seed, one_file):
    rng = random.Random(seed)
    entries = table_entries(rng, 80)
    rows = None if one_file else rows_of(rng, entries)
    text = header_of(entries, rows, ARRAYS_FORMAT_VERSION).to_json()
    doc = json.loads(text)
    assert set(map(type, doc["tensors"].values())) == {str, int}  # packed strings and the count: no list
    back = VersionHeader.from_json(text)
    four = VersionHeader.from_json(header_of(entries, rows, COLUMNS_FORMAT_VERSION).to_json())
    t5, t4 = back.tensors, four.tensors
    assert t5._names is None and t5._arrays is not None  # read as arrays, no list made yet
    assert t5.names == t4.names and t5.shapes == t4.shapes and t5.dtypes == t4.dtypes
    assert t5.checksums == t4.checksums and t5.nnz == t4.nnz and t5.encs == t4.encs
    assert dict(t5.items()) == dict(t4.items())
    assert (back.nnz, back.numel) == (four.nnz, four.numel)
    if rows is not None:
        assert isinstance(back.part.rows, RowMap)
        assert dict(back.part.rows) == dict(four.part.rows) == rows
    assert back.to_json() == text  # writes back byte for byte


def test_open_of_a_format_5_header_makes_no_object_per_tensor(tmp_path):
    """A header of 20K tensors read and checked keeps a few hundred allocated blocks (arrays, a few
    strings), not one or more per tensor as formats 3 and 4 do."""
    n = 20_000
    names = [f"model.layers.{i // 128}.mlp.experts.{i % 128}.up_proj.weight" for i in range(n)]
    table = TensorTable(
        names, [[8, 4]] * n, ["BF16"] * n, ["0" * 16] * n, [1] * n, [{"at": i, "start": 0} for i in range(n)]
    )
    blocks = {}
    for fv in (COLUMNS_FORMAT_VERSION, ARRAYS_FORMAT_VERSION):
        rows = {nm: [0, 8] for nm in names}
        h = VersionHeader(
            version=2, kind="delta", tensors=table, checksum="0" * 16, base=1, base_checksum="0" * 16,
            codec="chunked", format_version=fv, enc={"chunk_elems": 65536, "elems": n},
            part=PartInfo(index=0, count=1, checksum="0" * 16, rows=rows),
        )  # fmt: skip
        text = h.to_json()
        gc.collect()
        gc.disable()  # no collection of earlier garbage inside the count
        try:
            before = sys.getallocatedblocks()
            kept = VersionHeader.from_json(text)
            blocks[fv] = sys.getallocatedblocks() - before
        finally:
            gc.enable()
        assert len(kept.tensors) == n
    assert blocks[ARRAYS_FORMAT_VERSION] < n // 20 < n < blocks[COLUMNS_FORMAT_VERSION], blocks


def _doc(rows: bool = True) -> dict:
    entries = {
        "a": TensorEntry([4, 2], "BF16", "0" * 16, 3, {"at": 0, "start": 0}),
        "b": TensorEntry([2], "F32", "1" * 16, 2, {"at": 3, "start": 0}),
        "c": TensorEntry([], "F16", "2" * 16, 0, {}),
    }
    header = header_of(entries, {"a": [0, 4], "b": [0, 2]} if rows else None, ARRAYS_FORMAT_VERSION)
    return json.loads(header.to_json())


def _packed(values, dtype) -> str:
    return np.asarray(values, dtype=dtype).tobytes().hex()


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("tensors", "nnz"), KeyError, "fields"),
        (("tensors", "color"), "AA==", "fields"),
        (("tensors",), [], "fields"),
        (("tensors", "count"), "3", "count is an int"),
        (("tensors", "count"), 4, "does not hold 4 names"),
        (("tensors", "name"), "a\nb", "does not hold 3 names"),
        (("tensors", "nnz"), "zz" * 24, "nnz is not hex digits"),
        (("tensors", "nnz"), "00 " * 16, "nnz is not hex digits"),  # whitespace that fromhex would skip
        (("tensors", "nnz"), 7, "nnz is not a string of hex digits"),
        (("tensors", "nnz"), _packed([1, 2], "<i8"), "nnz holds 16 B, not 3 values"),
        (("tensors", "dims"), _packed([4, 2, 2, 7], "<i8"), "dims holds 32 B"),
        (("tensors", "dims"), _packed([4, -2, 2], "<i8"), "tensor 'a'"),
        (("tensors", "dtype"), _packed([0, 9, 0], "<u1"), "tensor 'b'"),
        (("tensors", "nnz"), _packed([3, 3, 0], "<i8"), "tensor 'b'"),  # 3 of 2 elements
        (("tensors", "nnz"), _packed([3, 2, -1], "<i8"), "tensor 'c'"),
        (("tensors", "at"), _packed([0, -1, -1], "<i8"), "tensor 'b'"),  # at -1, start 0
        (("tensors", "start"), _packed([0, 0, 5], "<i8"), "tensor 'c'"),  # start without at
        (("part", "rows"), _packed([0, 4], "<i8"), "part rows holds 16 B"),
        (("part", "rows"), _packed([0, 4, 0, 9, -1, -1], "<i8"), "bad row range"),
        (("part", "rows"), _packed([0, 4, -1, 2, -1, -1], "<i8"), "bad row range"),
        (("part", "rows"), _packed([0, 4, -1, -1, -1, -1], "<i8"), "changes a tensor it does not own"),
        (("part", "rows"), _packed([0, 1, 0, 2, -1, -1], "<i8"), "nnz 3 for 2 owned"),
        (("part", "rows"), None, "part rows is not a string of hex digits"),
    ],
)
def test_malformed_arrays_are_a_format_error(path, value, message):
    doc = _doc()
    VersionHeader.from_json(json.dumps(doc))
    bad = copy.deepcopy(doc)
    at = bad
    for key in path[:-1]:
        at = at[key]
    if value is KeyError:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    with pytest.raises(FormatError, match=message):
        VersionHeader.from_json(json.dumps(bad))


def test_a_name_format_5_cannot_hold_is_refused_by_the_writer():
    entries = {"a\nb": TensorEntry([2], "BF16", "0" * 16, 0, {})}
    with pytest.raises(ValueError, match="line break"):
        header_of(entries, None, ARRAYS_FORMAT_VERSION).to_json()
    entries = {"a": TensorEntry([2], "BF16", "0" * 16, 1, {"at": 0, "start": 0, "frames": []})}
    with pytest.raises(ValueError, match="no array form"):
        header_of(entries, None, ARRAYS_FORMAT_VERSION).to_json()


def _write_parts(tmp_path, rows: list[dict], checksums: list[str] | None = None) -> list[str]:
    paths = []
    for k, r in enumerate(rows):
        entries = {
            "a": TensorEntry([4, 2], "BF16", (checksums or ["0" * 16] * 2)[k], 2 if "a" in r else 0,
                             {"at": 0, "start": r["a"][0] * 2} if "a" in r else {}),
            "b": TensorEntry([2], "F32", "1" * 16, 0, {}),
        }  # fmt: skip
        h = header_of(entries, r, ARRAYS_FORMAT_VERSION, index=k, count=len(rows))
        h.checksum = "0" * 16
        h.part.checksum = "0" * 16
        path = str(tmp_path / f"part{k}.safetensors")
        write(path, h, {"::blob": torch.zeros(8, dtype=torch.uint8)})
        paths.append(path)
    return paths


def test_the_parts_of_a_format_5_version_merge_as_arrays(tmp_path):
    paths = _write_parts(tmp_path, [{"a": [0, 2], "b": [0, 2]}, {"a": [2, 4]}])
    with Version([VersionFile(p, expect_version=7) for p in paths], expect_version=7) as v:
        assert v.header.format_version == ARRAYS_FORMAT_VERSION
        assert v.header.tensors.nnz == [4, 0] and v.header.tensors._arrays is not None
        assert [(r0, r1) for r0, r1, _ in v.owners("a")] == [(0, 2), (2, 4)]
        assert [(r0, r1) for r0, r1, _ in v.owners("b")] == [(0, 2)]
    overlap = _write_parts(tmp_path, [{"a": [0, 3]}, {"a": [2, 4]}])
    with pytest.raises(FormatError, match="parts overlap at rows 2..3.*tensor 'a'"):
        Version([VersionFile(p, expect_version=7) for p in overlap], expect_version=7)
    differ = _write_parts(tmp_path, [{"a": [0, 2]}, {"a": [2, 4]}], checksums=["0" * 16, "f" * 16])
    with pytest.raises(FormatError, match="disagree.*tensor 'a'"):
        Version([VersionFile(p, expect_version=7) for p in differ], expect_version=7)
