import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from vllm_delta.checksums import tensor_sum, to_hex
from vllm_delta.errors import FormatError, ShapeMismatchError
from vllm_delta.format import FORMAT_NAME, TensorEntry, VersionFile, VersionHeader, serialize, write


def anchor_header(tensors, version=0):
    entries = {
        n: TensorEntry(shape=list(t.shape), dtype="BF16", checksum=to_hex(tensor_sum(t)), nnz=t.numel())
        for n, t in tensors.items()
    }
    return VersionHeader(version=version, kind="anchor", tensors=entries, checksum="0" * 16)


@pytest.fixture
def anchor(tmp_path):
    tensors = {"w": torch.randn(4, 8).to(torch.bfloat16), "b": torch.randn(8).to(torch.bfloat16)}
    path = str(tmp_path / "a.safetensors")
    write(path, anchor_header(tensors, 7), tensors)
    return path, tensors


def test_anchor_is_a_plain_checkpoint_and_round_trips(anchor):
    from safetensors.torch import load_file

    path, tensors = anchor
    loaded = load_file(path)  # any HF loader reads an anchor as is
    assert set(loaded) == set(tensors)
    vf = VersionFile(path, expect_version=7)
    assert vf.header.kind == "anchor" and vf.header.version == 7
    for n, t in tensors.items():
        assert torch.equal(vf.dense(n).view(torch.int16), t.view(torch.int16))


def test_serialize_equals_write(anchor, tmp_path):
    path, tensors = anchor
    other = tmp_path / "b.safetensors"
    other.write_bytes(serialize(anchor_header(tensors, 7), tensors))
    a, b = VersionFile(path), VersionFile(str(other))
    assert a.header == b.header
    assert all(torch.equal(a.dense(n).view(torch.int16), b.dense(n).view(torch.int16)) for n in tensors)


def test_truncated_file(anchor, tmp_path):
    path, _ = anchor
    data = open(path, "rb").read()
    for cut in (4, 20, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(data[:cut])
        with pytest.raises(FormatError, match="version 7"):
            VersionFile(str(bad), expect_version=7)


def test_an_opened_file_reads_in_full_after_its_path_is_removed(anchor, tmp_path):
    """A download cache shared by two servers: one prunes a copy the other opened but had not read yet.
    The opened file reads through its own descriptor; the path is not opened again."""
    path, tensors = anchor
    vf = VersionFile(path, expect_version=7)
    os.remove(path)
    other = tmp_path / "a.safetensors"  # a new file under the same name must not be what is read
    save_file({"x": torch.zeros(2)}, str(other))
    for n, t in tensors.items():
        assert torch.equal(vf.dense(n).view(torch.int16), t.view(torch.int16))
    vf.close()
    with pytest.raises(ValueError, match="closed"):
        vf.dense("w")


def test_a_missing_file_is_file_not_found_not_a_format_error(tmp_path):
    # DeltaStore.open tells a copy pruned before its open (fetched again) from a damaged file (refused).
    with pytest.raises(FileNotFoundError):
        VersionFile(str(tmp_path / "gone.safetensors"))


def test_not_a_version_file(tmp_path):
    p = str(tmp_path / "plain.safetensors")
    save_file({"x": torch.zeros(2)}, p)
    with pytest.raises(FormatError, match="not a vllm-delta version file"):
        VersionFile(p)


def _with_header(tmp_path, header_json: str):
    p = str(tmp_path / "h.safetensors")
    save_file(
        {"w": torch.zeros(2, dtype=torch.bfloat16)},
        p,
        metadata={"format": FORMAT_NAME, "format_version": "1", "header": header_json},
    )
    return p


def test_unknown_format_version(anchor, tmp_path):
    path, tensors = anchor
    raw = json.loads(anchor_header(tensors, 7).to_json())
    raw["format_version"] = 99
    with pytest.raises(FormatError, match="unknown format version 99"):
        VersionFile(_with_header(tmp_path, json.dumps(raw)))


def test_corrupt_header(tmp_path):
    with pytest.raises(FormatError, match="malformed"):
        VersionFile(_with_header(tmp_path, '{"format_version": 1, "version": 1'))
    with pytest.raises(FormatError):
        VersionFile(
            _with_header(
                tmp_path, '{"format_version": 1, "version": 1, "kind": "patch", "tensors": {}, "checksum": "0"}'
            )
        )


def test_delta_header_needs_base_and_codec():
    with pytest.raises(FormatError, match="base"):
        VersionHeader(version=3, kind="delta", tensors={}, checksum="0", base=5, codec="compact").validate()
    with pytest.raises(FormatError):
        VersionHeader(version=3, kind="delta", tensors={}, checksum="0", base=2, codec=None).validate()


def test_anchor_shape_mismatch(tmp_path):
    tensors = {"w": torch.zeros(4, 8, dtype=torch.bfloat16)}
    header = anchor_header(tensors, 1)
    header.tensors["w"] = dataclasses.replace(header.tensors["w"], shape=[8, 4])
    p = str(tmp_path / "s.safetensors")
    save_file(tensors, p, metadata={"format": FORMAT_NAME, "format_version": "1", "header": header.to_json()})
    with pytest.raises(ShapeMismatchError, match="tensor 'w'"):
        VersionFile(p)


def test_anchor_missing_tensor(tmp_path):
    tensors = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    header = anchor_header({**tensors, "v": torch.zeros(2, dtype=torch.bfloat16)}, 1)
    p = str(tmp_path / "m.safetensors")
    save_file(tensors, p, metadata={"format": FORMAT_NAME, "format_version": "1", "header": header.to_json()})
    with pytest.raises(FormatError, match="lacks"):
        VersionFile(p)
    assert os.path.exists(p)


# -- PayloadWriter: a file written as its payload comes (the chunked codec's pipelined upload) --------


def _streamed(tmp_path, tensors, pool=None, pieces=3):
    from vllm_delta.format import PayloadWriter

    path = str(tmp_path / "s.safetensors")
    header = anchor_header({n: t for n, t in tensors.items() if t.dtype == torch.bfloat16}, 3)
    parts = [(n, t.dtype, t.dim()) for n, t in tensors.items()]
    with PayloadWriter(path, header, parts, pool) as out:
        for n, t in tensors.items():
            for piece in t.tensor_split(pieces) if t.dim() else [t]:
                out.append(n, piece, ready=lambda: None)
    return path, header


@pytest.mark.parametrize("threads", [0, 4])
def test_payload_writer_gives_a_file_safetensors_and_readers_read(tmp_path, threads, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from vllm_delta.format import PayloadWriter

    monkeypatch.setattr(PayloadWriter, "PIECE_BYTES", 64)  # large appends: several positioned writes
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(40, 8, generator=g).to(torch.bfloat16),
        "blob": torch.randint(0, 256, (1000,), generator=g, dtype=torch.uint8),
        "index": torch.randint(-(2**62), 2**62, (7, 9), generator=g, dtype=torch.int64),
        "empty": torch.zeros(0, dtype=torch.int64),
    }
    pool = ThreadPoolExecutor(threads) if threads else None
    path, header = _streamed(tmp_path, tensors, pool)
    loaded = load_file(path)  # safetensors itself validates the container (offsets, sizes, padding)
    for n, t in tensors.items():
        assert loaded[n].dtype == t.dtype and torch.equal(loaded[n], t), n
    vf = VersionFile(path, expect_version=3)
    assert vf.header == header
    assert torch.equal(vf.dense("w").view(torch.int16), tensors["w"].view(torch.int16))
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        assert (8 + n) % 8 == 0  # the data section stays 8-byte aligned
    if pool is not None:
        pool.shutdown()


def test_payload_writer_refuses_out_of_order_parts_and_raises_write_errors(tmp_path):
    from vllm_delta.format import PayloadWriter

    t = torch.zeros(4, dtype=torch.int64)
    header = anchor_header({}, 1)
    parts = [("a", torch.int64, 1), ("b", torch.int64, 1)]
    with PayloadWriter(str(tmp_path / "x"), header, parts) as out:
        with pytest.raises(ValueError, match="out of order"):
            out.append("b", t)
        out.append("a", t)
        with pytest.raises(ValueError, match="takes 1-d"):
            out.append("a", t.reshape(2, 2))
        out.append("b", t)
        with pytest.raises(ValueError, match="was finished"):
            out.append("a", t)
    with pytest.raises(ValueError, match="never written"):
        with PayloadWriter(str(tmp_path / "y"), header, parts) as out:
            out.append("a", t)

    def boom():
        raise RuntimeError("the device copy failed")

    with pytest.raises(RuntimeError, match="device copy failed"):
        with PayloadWriter(str(tmp_path / "z"), header, parts) as out:
            out.append("a", t, ready=boom)


def test_payload_writer_restart_rewrites_from_the_start(tmp_path):
    """A codec falling back mid-file (nvCOMP failed after a run was written) starts again: the file
    holds only what came after the restart, and nothing of the longer first attempt."""
    from safetensors.torch import load_file

    from vllm_delta.format import PayloadWriter

    header = anchor_header({}, 1)
    parts = [("blob", torch.uint8, 1), ("index", torch.int64, 1)]
    path = str(tmp_path / "r")
    with PayloadWriter(path, header, parts) as out:
        out.append("blob", torch.full((5000,), 7, dtype=torch.uint8))
        out.restart()
        out.append("blob", torch.arange(16, dtype=torch.uint8))
        out.append("index", torch.arange(3, dtype=torch.int64))
    loaded = load_file(path)
    assert torch.equal(loaded["blob"], torch.arange(16, dtype=torch.uint8))
    assert torch.equal(loaded["index"], torch.arange(3, dtype=torch.int64))


@pytest.mark.parametrize("hint", [1, 10_000_000])
def test_payload_writer_size_hint_leaves_the_file_at_its_size(tmp_path, hint):
    """Space allocated ahead (more or less than the payload) is not part of the file."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file

    from vllm_delta.format import PayloadWriter

    header = anchor_header({}, 1)
    blob = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    path = str(tmp_path / "h")
    with ThreadPoolExecutor(2) as pool:
        with PayloadWriter(path, header, [("blob", torch.uint8, 1)], pool, size_hint=hint) as out:
            out.append("blob", blob)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    assert os.path.getsize(path) == 8 + n + blob.numel()
    assert torch.equal(load_file(path)["blob"], blob)


@pytest.mark.parametrize("count", [0, 1, 4])
def test_payload_writer_header_bytes_are_json_dumps_of_the_whole_doc(tmp_path, count):
    """The metadata's text is made once and the entries appended to it: the same bytes as dumping the
    whole document (with no tensors too: still one JSON object), and a file safetensors reads."""
    from safetensors import safe_open

    from vllm_delta.format import PayloadWriter
    from vllm_delta.format.layout import ST_NAMES
    from vllm_delta.format.payload_writer import file_metadata

    names = ["w", 'q"uote::0', "caf\u00e9::1", "blob"][:count]
    dtypes = [torch.bfloat16, torch.int64, torch.uint8, torch.float32][:count]
    tensors = {n: (dt, [3, 2 + i][: 1 + i % 2], 8 * i, 8 * i + 8) for i, (n, dt) in enumerate(zip(names, dtypes))}
    header = anchor_header({"w": torch.zeros(3, 2, dtype=torch.bfloat16)}, 5)
    path = str(tmp_path / "h")
    out = PayloadWriter(path, header, [(n, dt, len(shape)) for n, (dt, shape, _, _) in tensors.items()])
    doc: dict = {"__metadata__": file_metadata(header)}
    for key, (dtype, shape, start, end) in tensors.items():
        doc[key] = {"dtype": ST_NAMES[dtype], "shape": shape, "data_offsets": [start, end]}
    assert out._header_bytes(tensors) == json.dumps(doc, separators=(",", ":")).encode()
    assert json.loads(out._header_bytes({})) == {"__metadata__": file_metadata(header)}
    if not count:
        out.close()  # a file of no tensors: the header alone
        with safe_open(path, framework="pt") as f:
            assert list(f.keys()) == [] and f.metadata() == file_metadata(header)
    else:
        out.abort()
