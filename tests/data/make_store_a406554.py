"""Writes tests/data/store_a406554: a store in the formats before format 5 (written by commit a406554):
chunked deltas with format-4 headers (columns) and format-3 headers (an object per tensor), one file
each, and one two-part chunked delta of format 4, read by tests/format/test_old_stores.py. Run against
the code of commit a406554, not the current one:

    git worktree add /tmp/old a406554
    PYTHONPATH=/tmp/old .venv/bin/python tests/data/make_store_a406554.py tests/data/store_a406554

Versions: 0 anchor, 1-2 format-4 deltas (a Publisher's defaults), 3 anchor and 4 a format-3 delta (a
second Publisher, `UploadOptions(header_columns=False)`), 5 a format-4 delta of two parts, each part
owning half of every tensor's rows.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

import vllm_delta
from vllm_delta import Publisher
from vllm_delta import codec as codecs
from vllm_delta.bits import int_view
from vllm_delta.checksums import combine, positional_sum, tensor_sum, to_hex
from vllm_delta.format import PartInfo, write
from vllm_delta.store import DeltaStore
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
from vllm_delta.trainer.options import PublisherOptions, UploadOptions
from vllm_delta.writer import PreparedTensor, assemble_delta

SPEC = TinyModelSpec(
    arch="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    vocab_size=256,
)


def two_part_delta(out: str, new: dict, old: dict, base_checksum: str, version: int) -> str:
    """Version `version` as a chunked delta of two format-4 parts over `old` (the base) -> `new`."""
    sums = {n: tensor_sum(t) for n, t in new.items()}
    total = to_hex(combine(sums.items()))
    store = DeltaStore(out)
    c = codecs.get_codec("chunked")
    parts = []
    for k in range(2):
        rows, prepared, own = {}, {}, {}
        for n, t in new.items():
            r = t.shape[0] if t.dim() else 1
            r0, r1 = (0, r // 2) if k == 0 else (r // 2, r)
            if r1 <= r0:
                prepared[n] = PreparedTensor(tuple(t.shape), torch.bfloat16, sums[n], 0, None)
                continue
            rows[n] = [r0, r1]
            size = t[0].numel() if t.dim() else 1
            a, b = r0 * size, r1 * size
            nb, ob = int_view(t).reshape(-1)[a:b], int_view(old[n]).reshape(-1)[a:b]
            pos = (nb != ob).nonzero().reshape(-1)
            own[n] = positional_sum(nb, a)
            sec = c.prepare(pos + a, nb[pos], ob[pos], t.numel(), a) if pos.numel() else None
            prepared[n] = PreparedTensor(tuple(t.shape), torch.bfloat16, sums[n], int(pos.numel()), sec)
        part = PartInfo(index=k, count=2, checksum=to_hex(combine(own.items())), rows=rows)
        header, payload = assemble_delta(
            version=version,
            base=version - 1,
            base_checksum=base_checksum,
            codec=c,
            tensors=prepared,
            checksum=total,
            part=part,
        )
        assert header.format_version == 4
        path = os.path.join(out, f".v{version}-{k}.safetensors")
        write(path, header, payload)
        parts.append(store.put_part(header, path, move=True))
    store.commit_parts(
        version=version,
        kind="delta",
        base=version - 1,
        codec="chunked",
        nnz=sum(int((int_view(new[n]) != int_view(old[n])).sum()) for n in new),
        numel=sum(t.numel() for t in new.values()),
        checksum=total,
        base_checksum=base_checksum,
        parts=parts,
    )
    return total


def main(out: str) -> None:
    assert os.environ.get("PYTHONPATH"), "run against the old code (PYTHONPATH=<a checkout of a406554>)"
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    model = build_master_model(SPEC, seed=7)
    images, checksums = {}, {}
    with Publisher(out, anchor_every=100) as pub:  # format-4 chunked deltas
        info = pub.publish(model, version=0)
        images[0], checksums[0] = bf16_image(model), info.checksum
        for v in train_steps(model, 2, lr=1e-4, seed=7):  # yields 1, 2 after each step
            info = pub.publish(model, version=v)
            images[v], checksums[v] = bf16_image(model), info.checksum
    old_readers = PublisherOptions(upload=UploadOptions(header_columns=False))  # format-3 chunked deltas
    with Publisher(out, anchor_every=100, options=old_readers) as pub:
        info = pub.publish(model, version=3)
        images[3], checksums[3] = bf16_image(model), info.checksum
        for _ in train_steps(model, 1, lr=1e-4, seed=8):
            info = pub.publish(model, version=4)
            images[4], checksums[4] = bf16_image(model), info.checksum
    for _ in train_steps(model, 1, lr=1e-4, seed=9):
        pass
    images[5] = bf16_image(model)
    checksums[5] = two_part_delta(out, images[5], images[4], checksums[4], 5)
    assert checksums[5] == vllm_delta.checksum(images[5])
    store = DeltaStore(out)
    kinds = {v: store.record(v).kind for v in range(6)}
    assert kinds == {0: "anchor", 1: "delta", 2: "delta", 3: "anchor", 4: "delta", 5: "delta"}, kinds
    formats = {}
    for v in range(6):
        with store.open(v) as vf:
            formats[v] = vf.header.format_version
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"written_by": "a406554", "checksums": checksums, "formats": formats}, f, indent=1)
    assert len(set(checksums.values()) - {checksums[2]}) == 4, checksums  # 2 and 3 hold the same weights
    for v in (2, 5):
        save_file({n: t.contiguous() for n, t in images[v].items()}, os.path.join(out, f"expected_v{v}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
