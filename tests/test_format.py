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
    header.tensors["w"].shape = [8, 4]
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
