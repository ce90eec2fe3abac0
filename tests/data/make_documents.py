"""Writes tests/data/documents_5ffad64: every kind of JSON document a store holds, as the code of commit
5ffad64 wrote them (before the documents moved onto wire.py's codec), read by tests/test_documents.py,
which checks that the current code parses each one and writes it back byte for byte.

    git archive 5ffad64 vllm_delta tests/test_parts.py | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:/tmp/old/tests .venv/bin/python tests/data/make_documents.py tests/data/documents_5ffad64

What it writes (only the JSON: the version files' headers are taken out of their safetensors metadata):

    versions/*.json, head.json, bad/*.json, replicas/*.json    a local store: one-file versions of the
        three codecs (formats 1 and 3), multi-part versions (formats 2 and 3), two marks, reports
        with and without a region
    mirrored/versions/*.json, mirrored/head.json, mirrored/bad/*.json   the same store mirrored into
        another (records with sha256, as a mirror and remote publishers write them)
    mirror/lease.json                                           a mirror's lease
    headers/<version>[.part<k>].json                            each data file's header
    attribution.json                                            a completion's weight_versions
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors import safe_open
from test_parts import commit, write_parts  # tests/test_parts.py: multi-part versions without a process group

from vllm_delta import Publisher
from vllm_delta.attribution import parse_spans
from vllm_delta.mirror import Mirror, MirrorOptions
from vllm_delta.mirror.lease import Lease
from vllm_delta.store import DeltaStore
from vllm_delta.store.ledger import Ledger
from vllm_delta.store.replicas import ReplicaReport
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.training import build_master_model, train_steps

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


def _publish(root: str, mirror: Mirror) -> None:
    model = build_master_model(SPEC, seed=3)
    for codec in ("chunked", "compact", "raw"):  # each Publisher starts with an anchor
        with Publisher(root, anchor_every=100, codec=codec) as pub:
            pub.publish(model)
            for _ in train_steps(model, 2, lr=1e-4, seed=len(codec)):
                pub.publish(model)
        mirror.run_once()  # every version into the mirrored store too


def main(out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root, mirrored = os.path.join(tmp, "store"), os.path.join(tmp, "mirrored")
        store = DeltaStore(root)
        mirror = Mirror(store, DeltaStore(mirrored), MirrorOptions(region="eu"))
        _publish(root, mirror)  # versions 0-8
        base = store.latest()
        assert base is not None
        commit(store, write_parts(tmp, base + 1, None))  # a multi-part anchor (format 2)
        commit(store, write_parts(tmp, base + 2, base + 1))  # compact parts (format 2)
        commit(store, write_parts(tmp, base + 3, base + 2, codec="chunked"))  # chunked parts (format 3)
        mirror.run_once()
        store.mark_bad(2, "diverged: loss spiked at step 2", by="alice@trainer-0:4242")
        store.mark_bad(base + 2, 'a mark with ünïcode and "quotes"')
        ledger = Ledger(store)
        ledger.report(
            ReplicaReport(
                "gpu-0", "host-a", 7, "0123456789abcdef", "0123456789abcdef", 8, 3.25, None, 1764123456.7, 1764120000.0
            )
        )
        ledger.report(
            ReplicaReport(
                "gpu-1",
                "host-b",
                None,
                None,
                None,
                None,
                None,
                "store timed out",
                1764123457.125,
                1764120001.5,
                region="eu",
            )
        )
        mirror.run_once()  # the marks
        mirror.close()
        lease = Lease(DeltaStore(mirrored), "mirror-eu", src=root, region="eu", ttl_s=60.0, settle_s=0.0)
        lease._acquired = 1764123000.25
        lease._write()

        for src, dest in ((root, out), (mirrored, os.path.join(out, "mirrored"))):
            for folder in ("versions", "bad", "replicas", "mirror"):
                if os.path.isdir(os.path.join(src, folder)):
                    shutil.copytree(os.path.join(src, folder), os.path.join(dest, folder))
            shutil.copy(os.path.join(src, "head.json"), dest)
        shutil.move(os.path.join(out, "mirrored", "mirror"), os.path.join(out, "mirror"))
        headers = os.path.join(out, "headers")
        os.makedirs(headers)
        for rec in store.records():
            for i, file in enumerate(rec.files):
                with safe_open(os.path.join(root, file), "pt") as f:
                    text = f.metadata()["header"]
                name = f"{rec.version:010d}" + ("" if rec.file else f".part{i:05d}")
                with open(os.path.join(headers, f"{name}.json"), "w") as fh:
                    fh.write(text)
    spans = [[7, 0, 25], [8, 25, 30], ["default", 30, 32]]
    with open(os.path.join(out, "attribution.json"), "w") as f:
        f.write(json.dumps(parse_spans(spans).to_json()))


if __name__ == "__main__":
    main(sys.argv[1])
