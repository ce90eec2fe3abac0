"""Multi-part versions (format and record version 2) without a process group: part files written by
hand with the writer, committed through the store, read back by every reader; and what a reader
refuses (overlapping or missing rows, parts that disagree, positions outside a part's rows)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch

from vllm_delta import codec as codecs
from vllm_delta.apply.layout import DeviceLayout, Layout
from vllm_delta.apply.staging import Decoder, FileSet, _piece_items, changed_items
from vllm_delta.bits import int_view
from vllm_delta.checksums import MASK64, combine, partial_terms, positional_sum, tensor_sum, to_hex
from vllm_delta.errors import (
    FormatError,
    IntegrityError,
    PositionError,
    ShapeMismatchError,
    VersionExistsError,
)
from vllm_delta.format import PartInfo, Version, VersionFile, VersionHeader, write
from vllm_delta.reconstruct import replay
from vllm_delta.store import LEFTOVER_AGE_S, DeltaStore, VersionRecord
from vllm_delta.writer import PreparedTensor, assemble_delta, encode_anchor_part

SHAPES = {"w": (10, 6), "b": (7,), "s": ()}
SPLITS = {"w": [(0, 4), (4, 10)], "b": [(0, 3), (3, 7)], "s": [None, (0, 1)]}  # rows per part (None: not owned)


def weights(v: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(v)
    out = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}
    if v:  # a few elements move from version 0
        base = weights(0)
        for name, t in out.items():
            keep = torch.rand(t.shape, generator=gen) < 0.7
            out[name] = torch.where(keep, base[name], t)
    return out


def _rows_pos(shape, rows):
    size = 1
    for d in shape[1:]:
        size *= d
    return rows[0] * size, rows[1] * size


def write_parts(
    tmp, version: int, base: int | None, *, codec="compact", splits=SPLITS
) -> list[tuple[VersionHeader, str]]:
    """The part files of version `version` (an anchor if base is None, else a delta on `base`)."""
    new = weights(version)
    sums = {n: tensor_sum(t) for n, t in new.items()}
    checksum = to_hex(combine(sums.items()))
    nparts = len(next(iter(splits.values())))
    out = []
    for k in range(nparts):
        rows = {n: list(splits[n][k]) for n in SHAPES if splits[n][k] is not None}
        own_sum = {}
        for n, r in rows.items():
            a, b = _rows_pos(SHAPES[n], r)
            own_sum[n] = positional_sum(int_view(new[n]).reshape(-1)[a:b], a)
        part = PartInfo(index=k, count=nparts, checksum=to_hex(combine(own_sum.items())), rows=rows)
        if base is None:
            slices = {n: (new[n][r[0] : r[1]] if SHAPES[n] else new[n]) for n, r in rows.items()}
            header, payload = encode_anchor_part(version, SHAPES, torch.bfloat16, sums, checksum, slices, part)
        else:
            old = weights(base)
            c = codecs.get_codec(codec)
            prepared = {}
            for n, shape in SHAPES.items():
                nnz, sections = 0, None
                if n in rows:
                    a, b = _rows_pos(shape, rows[n])
                    nb, ob = int_view(new[n]).reshape(-1)[a:b], int_view(old[n]).reshape(-1)[a:b]
                    pos = (nb != ob).nonzero().reshape(-1)
                    nnz = int(pos.numel())
                    if nnz:
                        sections = c.prepare(pos + a, nb[pos], ob[pos], new[n].numel(), a)
                prepared[n] = PreparedTensor(shape, torch.bfloat16, sums[n], nnz, sections)
            header, payload = assemble_delta(
                version=version,
                base=base,
                base_checksum=to_hex(combine((n, tensor_sum(t)) for n, t in old.items())),
                codec=c,
                tensors=prepared,
                checksum=checksum,
                part=part,
            )
        path = os.path.join(tmp, f"v{version}-p{k}.safetensors")
        write(path, header, payload)
        out.append((header, path))
    return out


def commit(store: DeltaStore, files: list[tuple[VersionHeader, str]]) -> VersionRecord:
    parts = [store.writer.put_part(h, p) for h, p in files]
    h = files[0][0]
    return store.writer.commit_parts(
        version=h.version,
        kind=h.kind,
        base=h.base,
        codec=h.codec,
        nnz=sum(x.nnz for x, _ in files),
        numel=h.numel,
        checksum=h.checksum,
        base_checksum=h.base_checksum,
        parts=parts,
    )


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny tensors: one torch thread (see tests/trainer/conftest.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def store(tmp_path) -> DeltaStore:
    s = DeltaStore(str(tmp_path / "store"))
    commit(s, write_parts(str(tmp_path), 0, None))
    commit(s, write_parts(str(tmp_path), 1, 0))
    commit(s, write_parts(str(tmp_path), 2, 1, codec="raw"))
    commit(s, write_parts(str(tmp_path), 3, 2, codec="chunked"))
    return s


def test_multi_part_versions_read_like_one_file(store, tmp_path):
    rec = store.record(1)
    assert rec.file is None and len(rec.parts) == 2 and rec.files[1].endswith(".part00001.safetensors")
    assert VersionRecord.from_json(rec.to_json()) == rec
    assert json.loads(rec.to_json())["format_version"] == 2
    for v in (0, 1, 2, 3):
        _, tensors = replay(store, v)
        want = weights(v)
        assert all(torch.equal(int_view(tensors[n]), int_view(want[n])) for n in want), v
        with store.open(v) as vf:
            assert isinstance(vf, Version)
            assert vf.header.checksum == to_hex(combine((n, tensor_sum(t)) for n, t in want.items()))
            if vf.header.kind == "delta":
                pieces = vf.pieces("w")
                assert [p.start for p in pieces] == sorted(p.start for p in pieces)
                assert vf.header.tensors["w"].nnz == sum(p.nnz for p in pieces)
    with store.open(0) as vf:
        assert torch.equal(vf.dense("w"), weights(0)["w"])
        with pytest.raises(FormatError, match="rows"):
            vf.parts[0].dense("w")  # a part alone holds only its rows
    with pytest.raises(ValueError, match="2 parts"):
        store.local_path(1)
    assert len(store.local_paths(1)) == 2


def test_multi_part_versions_on_s3_are_verified_part_by_part(tmp_path):
    """Each part carries its own sha256: a damaged cached part is fetched again, a damaged part in the
    store is refused (nothing cached) until it is restored."""
    from vllm_delta.testing.s3 import S3Server

    with S3Server() as s3:
        uri = s3.uri("parts")
        writer = DeltaStore(uri, s3.storage_options)
        commit(writer, write_parts(str(tmp_path), 0, None))
        rec = commit(writer, write_parts(str(tmp_path), 1, 0))
        assert rec.sha256 is None and all(p.sha256 is not None for p in rec.parts)
        assert VersionRecord.from_json(rec.to_json()) == rec
        reader = DeltaStore(uri, s3.storage_options, cache_dir=str(tmp_path / "cache"))
        paths = reader.local_paths(1)
        good = open(paths[1], "rb").read()
        with open(paths[1], "r+b") as f:  # same size, other bytes: only the digest tells
            f.seek(-4, os.SEEK_END)
            f.write(b"\xff\xfe\xfd\xfc" if good[-4:] != b"\xff\xfe\xfd\xfc" else b"\0\0\0\0")
        again = DeltaStore(uri, s3.storage_options, cache_dir=str(tmp_path / "cache"))
        assert again.local_paths(1) == paths and open(paths[1], "rb").read() == good
        stored = writer.root + "/" + rec.parts[0].file
        saved = writer.fs.cat_file(stored)
        writer.fs.pipe_file(stored, saved[:-4] + bytes(b ^ 0xFF for b in saved[-4:]))
        fresh = DeltaStore(uri, s3.storage_options, cache_dir=str(tmp_path / "cache2"))
        with pytest.raises(IntegrityError, match="sha256"):
            fresh.open(1)
        assert not [n for n in os.listdir(fresh.cache.folder()) if ".part00000." in n]
        writer.fs.pipe_file(stored, saved)
        _, tensors = replay(fresh, 1)
        assert all(torch.equal(int_view(tensors[n]), int_view(t)) for n, t in weights(1).items())


def test_staging_reads_pieces(store):
    layout = Layout.identity(SHAPES)
    dl = DeviceLayout(layout, torch.device("cpu"))
    decoder = Decoder(torch.device("cpu"), threads=1)
    for v in (1, 2, 3):
        with store.open(v) as vf:
            items = changed_items(vf, dl)[2]
            if isinstance(items, FileSet):  # format 3: every part's pieces, each part's in layout order
                assert len(items.files) == 2  # every piece of every part, as the per-piece reader sees them
                assert sum(len(f) for f in items.files) == len(_piece_items(vf, dl)[2])
                for f in items.files:
                    assert f.names == sorted(f.names, key=list(SHAPES).index)
            else:
                names = [it.name for it in items]
                assert names == sorted(names, key=list(SHAPES).index)  # a tensor's pieces are adjacent
            old, new = weights(v - 1), weights(v)
            for chunk in decoder.decode(v, vf.header.codec or "", items, 2, {}):
                for t_idx, p in zip(chunk.t_idx.tolist(), chunk.p.tolist()):
                    name = list(SHAPES)[t_idx]
                    assert int_view(old[name]).reshape(-1)[p] != int_view(new[name]).reshape(-1)[p]
    decoder.close()


def test_positions_outside_a_parts_rows_are_refused(tmp_path):
    # part 0 owns rows [0, 4) of w, but its payload also changes row 6
    files = write_parts(str(tmp_path), 0, None)
    store = DeltaStore(str(tmp_path / "s"))
    commit(store, files)
    old = weights(0)
    for codec in ("compact", "raw", "chunked"):
        c = codecs.get_codec(codec)
        parts = []
        for k in range(2):
            rows = {"w": [[0, 4], [4, 10]][k]}
            pos = torch.tensor([1, 38] if k == 0 else [40], dtype=torch.int64)  # 38 is row 6
            ob = int_view(old["w"]).reshape(-1)[pos]
            nb = ob + 1
            sums = {n: tensor_sum(t) for n, t in old.items()}
            term = int(partial_terms(pos.clone(), nb, ob).sum()) & MASK64
            sums_w = (sums["w"] + term) & MASK64
            prepared = {
                n: PreparedTensor(SHAPES[n], torch.bfloat16, sums_w if n == "w" else sums[n], 0, None) for n in SHAPES
            }
            prepared["w"] = PreparedTensor(
                SHAPES["w"], torch.bfloat16, sums_w, 2 if k == 0 else 1, c.prepare(pos, nb, ob, 60, rows["w"][0] * 6)
            )
            parts.append((prepared, rows))
        total = to_hex(combine([(n, p.checksum) for n, p in parts[0][0].items()]))
        written = []
        for k, (prepared, rows) in enumerate(parts):
            checksum = to_hex(0) if k == 0 else total
            header, payload = assemble_delta(
                version={"compact": 5, "raw": 6, "chunked": 7}[codec],
                base=0,
                base_checksum=store.record(0).checksum,
                codec=c,
                tensors=prepared,
                checksum=total,
                part=PartInfo(k, 2, checksum, rows),
            )
            path = str(tmp_path / f"bad-{codec}-{k}.safetensors")
            write(path, header, payload)
            written.append((header, path))
        rec = commit(store, written)
        with pytest.raises(PositionError, match="outside the piece"):
            replay(store, rec.version)
        with store.open(rec.version) as vf:
            dl = DeviceLayout(Layout.identity(SHAPES), torch.device("cpu"))
            items = changed_items(vf, dl)[2]
            with pytest.raises(PositionError):
                list(Decoder(torch.device("cpu"), threads=1).decode(rec.version, codec, items, 2, {}))


def test_parts_that_do_not_fit_together_are_refused(tmp_path):
    files = write_parts(str(tmp_path), 0, None)
    a, b = VersionFile(files[0][1]), VersionFile(files[1][1])
    assert Version([a, b]).header.nnz == 60 + 7 + 1
    with pytest.raises(FormatError, match="parts"):
        Version([a])  # part 0 of 2 alone
    os.makedirs(tmp_path / "o")
    overlap = write_parts(str(tmp_path / "o"), 0, None, splits={**SPLITS, "w": [(0, 5), (4, 10)]})
    with pytest.raises(FormatError, match="overlap"):
        Version([VersionFile(p) for _, p in overlap])
    os.makedirs(tmp_path / "g")
    gap = write_parts(str(tmp_path / "g"), 0, None, splits={**SPLITS, "w": [(0, 3), (4, 10)]})
    with pytest.raises(FormatError, match="no part holds rows 3..4"):
        Version([VersionFile(p) for _, p in gap])
    os.makedirs(tmp_path / "x")
    other = write_parts(str(tmp_path / "x"), 1, None)
    with pytest.raises(FormatError):
        Version([a, VersionFile(other[1][1])])  # part 1 of another version's weights


def test_store_commit_rules(tmp_path):
    store = DeltaStore(str(tmp_path / "s"))
    files = write_parts(str(tmp_path), 0, None)
    parts = [store.writer.put_part(h, p) for h, p in files]
    assert store.versions() == []  # uploaded parts are invisible
    h = files[0][0]
    kw = dict(version=0, kind="anchor", base=None, codec=None, nnz=68, numel=68, base_checksum=None)
    with pytest.raises(FormatError, match="add up"):
        store.writer.commit_parts(**kw, checksum="0" * 16, parts=parts)
    os.rename(os.path.join(store.root, parts[1].file), os.path.join(store.root, "data", "moved"))
    with pytest.raises(IntegrityError, match="not in the store"):
        store.writer.commit_parts(**kw, checksum=h.checksum, parts=parts)
    os.rename(os.path.join(store.root, "data", "moved"), os.path.join(store.root, parts[1].file))
    store.writer.commit_parts(**kw, checksum=h.checksum, parts=parts)
    with pytest.raises(VersionExistsError):
        store.writer.commit_parts(**kw, checksum=h.checksum, parts=parts)
    # a truncated part is refused on open
    path = os.path.join(store.root, parts[1].file)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-10])
    with pytest.raises(IntegrityError, match="bytes"):
        DeltaStore(store.uri).open(0)
    with open(path, "wb") as f:
        f.write(data)
    # leftover parts of a publish that never committed: invisible, removed by retain once old
    extra = [store.writer.put_part(h, p) for h, p in write_parts(str(tmp_path), 1, 0)]
    old = time.time() - LEFTOVER_AGE_S - 10
    for p in extra:
        os.utime(os.path.join(store.root, p.file), (old, old))
    assert store.retain(5) == [] and store.versions() == [0]
    names = set(os.listdir(os.path.join(store.root, "data")))
    assert not {os.path.basename(p.file) for p in extra} & names
    assert {os.path.basename(f) for f in store.record(0).files} <= names
    store.writer.discard_parts(parts[:1])  # what a failed publish does with its own parts (here: a committed one)
    with pytest.raises(IntegrityError, match="missing"):
        DeltaStore(store.uri).open(0)


def _counting_opens(monkeypatch) -> list[str]:
    """The paths put_part opens with VersionFile (the full check: the header parsed again)."""
    import vllm_delta.store.writes as writes

    opened: list[str] = []

    class Counting(VersionFile):
        def __init__(self, path, **kw):
            opened.append(os.fspath(path))
            super().__init__(path, **kw)

    monkeypatch.setattr(writes, "VersionFile", Counting)
    return opened


def test_put_part_takes_a_delta_holding_its_header_without_parsing_it(tmp_path, monkeypatch):
    store = DeltaStore(str(tmp_path / "s"))
    opened = _counting_opens(monkeypatch)
    for h, p in write_parts(str(tmp_path), 1, 0, codec="chunked"):
        assert store.writer.put_part(h, p).checksum == h.part.checksum
    assert opened == []


def test_put_part_checks_a_delta_whose_header_differs_in_full(tmp_path, monkeypatch):
    """Another checksum or part index than the file holds: refused as before; a difference the full
    check does not compare (the creation time) is still taken, after that check."""
    store = DeltaStore(str(tmp_path / "s"))
    opened = _counting_opens(monkeypatch)
    (h0, p0), (h1, p1) = write_parts(str(tmp_path), 1, 0)
    other_sum = dataclasses.replace(h0, part=dataclasses.replace(h0.part, checksum="0" * 16))
    for header, path in [(other_sum, p0), (h1, p0), (dataclasses.replace(h0, checksum="0" * 16), p0)]:
        with pytest.raises(IntegrityError, match="does not hold the version its header describes"):
            store.writer.put_part(header, path)
    assert opened == [p0] * 3
    store.writer.put_part(dataclasses.replace(h1, created=h1.created + 1), p1)
    assert opened[3:] == [p1]


def test_put_part_refuses_unreadable_files_as_before(tmp_path):
    store = DeltaStore(str(tmp_path / "s"))
    (h, p), _ = write_parts(str(tmp_path), 1, 0)
    data = open(p, "rb").read()
    with open(p, "wb") as f:
        f.write(data[:100])  # cut inside the safetensors header
    with pytest.raises(FormatError, match="not a readable safetensors file"):
        store.writer.put_part(h, p)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, p, metadata={"format": "other", "header": h.to_json()})
    with pytest.raises(FormatError, match="is not a vllm-delta version file"):
        store.writer.put_part(h, p)


def test_put_part_checks_an_anchors_payload_in_full(tmp_path, monkeypatch):
    """An anchor part holding its header but a payload of other shapes is refused (the header alone
    does not say what the file holds)."""
    from safetensors.torch import load_file

    store = DeltaStore(str(tmp_path / "s"))
    opened = _counting_opens(monkeypatch)
    (h, p), _ = write_parts(str(tmp_path), 0, None)
    store.writer.put_part(h, p)
    assert opened == [p]
    payload = load_file(p)
    payload["w"] = payload["w"][:-1]
    bad = str(tmp_path / "bad.safetensors")
    write(bad, h, payload)
    with pytest.raises(ShapeMismatchError):
        store.writer.put_part(h, bad)


def test_records_of_parts_are_validated(store, caplog):
    doc = json.loads(store.record(1).to_json())
    bad = dict(doc, parts=doc["parts"][::-1])  # part files out of order
    with pytest.raises(FormatError, match="part 0"):
        VersionRecord.from_json(json.dumps(bad))
    bad = dict(doc, bytes=doc["bytes"] + 1)
    with pytest.raises(FormatError, match="add up"):
        VersionRecord.from_json(json.dumps(bad))
    bad = dict(doc, format_version=3)
    with pytest.raises(FormatError, match="v1 or v2"):
        VersionRecord.from_json(json.dumps(bad))
    with pytest.raises(FormatError, match="lists its parts"):
        VersionRecord.from_json(json.dumps(dict(doc, parts=[], bytes=0)))
    one = json.loads(store.record(1).to_json())
    one["parts"][1]["file"] = one["parts"][1]["file"].replace("0000000001.delta", "0000000002.delta")
    with pytest.raises(FormatError, match="does not belong"):
        VersionRecord.from_json(json.dumps(one))


def test_headers_of_parts_are_validated():
    e = {"shape": [4, 2], "dtype": "BF16", "checksum": "0" * 16, "nnz": 4, "enc": {}}
    base = {"format_version": 2, "version": 1, "kind": "anchor", "tensors": {"w": e}, "checksum": "0" * 16}
    ok = dict(base, part={"index": 0, "count": 2, "checksum": "0" * 16, "rows": {"w": [0, 2]}})
    VersionHeader.from_json(json.dumps(ok))
    with pytest.raises(FormatError, match="needs a part"):
        VersionHeader.from_json(json.dumps(base))
    with pytest.raises(FormatError, match="nnz"):
        VersionHeader.from_json(json.dumps(dict(ok, part={**ok["part"], "rows": {"w": [0, 1]}})))
    with pytest.raises(FormatError, match="row range"):
        VersionHeader.from_json(json.dumps(dict(ok, part={**ok["part"], "rows": {"w": [0, 9]}})))
    with pytest.raises(FormatError, match="part description"):
        VersionHeader.from_json(json.dumps(dict(ok, part={**ok["part"], "index": 2})))
    with pytest.raises(FormatError, match="unknown format version 6"):
        VersionHeader.from_json(json.dumps(dict(ok, format_version=6)))
    with pytest.raises(FormatError, match="malformed tensor arrays"):  # format 5's table is packed arrays
        VersionHeader.from_json(json.dumps(dict(ok, format_version=5)))
    with pytest.raises(FormatError, match="format version 3 is a delta"):
        VersionHeader.from_json(json.dumps(dict(ok, format_version=3)))  # anchors stay in formats 1 and 2
    with pytest.raises(FormatError, match="no file-level codec metadata"):
        VersionHeader.from_json(json.dumps(dict(ok, enc={"chunk_elems": 128})))
    one = dict(base, format_version=1, tensors={"w": {**e, "nnz": 8}})
    assert VersionHeader.from_json(json.dumps(one)).part is None
    assert "part" not in json.loads(VersionHeader.from_json(json.dumps(one)).to_json())


def test_vllm_sparse_path_fallback_reads_pieces(store):
    """The server's fallback for tensors its probe can't map (vllm/fallback.py) replays pieces too."""
    from vllm_delta.vllm.worker.fallback import FallbackApplier

    fb = FallbackApplier(None, {"w": "test", "b": "test"}, counts=True)
    for name in ("w", "b"):
        fb.set_shadow(name, weights(0)[name])
    for files in ([store.open(1)], [store.open(1), store.open(2)]):
        staged = fb.stage(files)
        want, old = weights(files[-1].version), weights(0)
        for name, (pos, new, prev) in staged.changes.items():
            wb, ob = int_view(want[name]).reshape(-1), int_view(old[name]).reshape(-1)
            assert torch.equal(pos, (wb != ob).nonzero().reshape(-1))
            assert torch.equal(new, wb[pos]) and torch.equal(prev, ob[pos])
