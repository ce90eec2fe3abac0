"""Writes tests/data/store_fcd5eec: a store in the formats before the chunked codec (format 1
compact deltas by a Publisher, and one format-2 multi-part compact delta), read by
tests/test_old_stores.py. Run against the code of commit fcd5eec, not the current one:

    git archive fcd5eec vllm_delta | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old .venv/bin/python tests/data/make_old_store.py tests/data/store_fcd5eec
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


def main(out: str) -> None:
    assert "fcd5eec" in vllm_delta.__file__ or os.environ.get("PYTHONPATH"), "run against the old code"
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    model = build_master_model(SPEC, seed=5)
    images, checksums = {}, {}
    with Publisher(out, anchor_every=100, codec="compact") as pub:
        info = pub.publish(model, version=0)
        images[0], checksums[0] = bf16_image(model), info.checksum
        for v in train_steps(model, 3, lr=1e-4, seed=5):
            info = pub.publish(model, version=v)
            images[v], checksums[v] = bf16_image(model), info.checksum
    # version 4: a two-part compact delta (format 2), each part owning half of every tensor's rows
    for _ in train_steps(model, 1, lr=1e-4, seed=6):
        pass
    new, old = bf16_image(model), images[3]
    sums = {n: tensor_sum(t) for n, t in new.items()}
    total = to_hex(combine(sums.items()))
    store = DeltaStore(out)
    c = codecs.get_codec("compact")
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
            version=4, base=3, base_checksum=checksums[3], codec=c, tensors=prepared, checksum=total, part=part
        )
        path = os.path.join(out, f".v4-{k}.safetensors")
        write(path, header, payload)
        parts.append(store.writer.put_part(header, path, move=True))
    store.writer.commit_parts(
        version=4,
        kind="delta",
        base=3,
        codec="compact",
        nnz=sum(int((int_view(new[n]) != int_view(old[n])).sum()) for n in new),
        numel=sum(t.numel() for t in new.values()),
        checksum=total,
        base_checksum=checksums[3],
        parts=parts,
    )
    images[4], checksums[4] = new, total
    assert checksums[4] == vllm_delta.checksum(new)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"written_by": "fcd5eec", "checksums": checksums}, f, indent=1)
    save_file({n: t.contiguous() for n, t in images[4].items()}, os.path.join(out, "expected_v4.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
