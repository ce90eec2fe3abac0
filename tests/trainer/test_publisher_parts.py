"""The Publisher's parts on their own: the options (checked where they are built), the shard group's
decisions from gathered messages (the same on every rank, so testable without processes), and the
uploader's error latching on a real store. The multi-process paths are in test_sharded.py."""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest
import torch

from vllm_delta import Publisher
from vllm_delta.checksums import combine, tensor_sum, to_hex
from vllm_delta.codec import get_codec
from vllm_delta.errors import PublishError, ShardingError
from vllm_delta.store import DeltaStore, PartRecord
from vllm_delta.store.writes import VersionWriter
from vllm_delta.trainer import (
    DetectOptions,
    PublisherOptions,
    ShardingOptions,
    StalenessPolicy,
    StoreOptions,
    UploadOptions,
)
from vllm_delta.trainer.encode import VersionEncoder
from vllm_delta.trainer.group import SingleProcess, UploadsFailed
from vllm_delta.trainer.job import BaseMissing, UploadFailure, UploadJob
from vllm_delta.trainer.shard import Owned
from vllm_delta.trainer.shard_group import (
    AgreeMessage,
    PartFailed,
    PartUploaded,
    Terms,
    decide_reports,
    settle,
)
from vllm_delta.trainer.uploader import Uploader

# -- options ---------------------------------------------------------------------------------------


def test_publisher_takes_at_most_ten_parameters():
    """self, uri, and the everyday keywords (anchor_every, codec, group, max_staleness, min_replicas,
    storage_options: the fsspec convention users know from DeltaStore, pandas and datasets; signing_key:
    issue 36's contract, `Publisher(uri, signing_key=PATH)`); the rest comes in `options`."""
    assert len(inspect.signature(Publisher.__init__).parameters) <= 10


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: UploadOptions(queue_size=0), "queue_size"),
        (lambda: UploadOptions(pack_threads=0), "pack_threads"),
        (lambda: DetectOptions(chunk_elems=0), "chunk_elems"),
        (lambda: StoreOptions(keep_anchors=0), "keep_anchors"),
        (lambda: ShardingOptions(timeout_s=0), "timeout_s"),
        (lambda: PublisherOptions(dtype=torch.float64), "publishable dtypes"),
    ],
)
def test_bad_options_fail_where_they_are_built(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_publisher_settings_create_nothing(tmp_path):
    root = tmp_path / "s"
    threads = set(threading.enumerate())
    with pytest.raises(ValueError, match="set twice"):
        Publisher(str(root), max_staleness=2, options=PublisherOptions(staleness=StalenessPolicy(max_staleness=1)))
    with pytest.raises(ValueError, match="detection backends"):
        Publisher(str(root), options=PublisherOptions(detect=DetectOptions(backend="cuda-magic")))
    with pytest.raises(ValueError, match="storage_options given twice"):
        Publisher(
            str(root),
            storage_options={"auto_mkdir": True},
            options=PublisherOptions(store=StoreOptions(storage_options={"auto_mkdir": True})),
        )
    with pytest.raises(ValueError, match="storage_options are for a URI"):
        Publisher(DeltaStore(str(root)), storage_options={"auto_mkdir": True})
    assert set(threading.enumerate()) <= threads  # no upload thread was started
    assert DeltaStore(str(root)).versions() == []


def test_storage_options_reach_the_store_in_either_spelling(tmp_path):
    uri = str(tmp_path / "s")
    for pub in (
        Publisher(uri, storage_options={"auto_mkdir": True}),
        Publisher(uri, options=PublisherOptions(store=StoreOptions(storage_options={"auto_mkdir": True}))),
    ):
        with pub:
            assert pub.store.storage_options == {"auto_mkdir": True} and pub.store.fs.auto_mkdir is True
    with Publisher(uri) as pub:  # fsspec's default
        assert pub.store.storage_options == {} and pub.store.fs.auto_mkdir is False


def test_staleness_keywords_are_the_short_form_of_the_policy():
    opts = PublisherOptions()
    assert opts.staleness_policy(None, 1) is None
    assert opts.staleness_policy(2, 3) == StalenessPolicy(max_staleness=2, min_replicas=3)
    policy = StalenessPolicy(max_staleness=1, min_replicas=2, timeout_s=5)
    assert PublisherOptions(staleness=policy).staleness_policy(None, 1) is policy


def test_options_reach_the_parts(tmp_path):
    opts = PublisherOptions(
        detect=DetectOptions(backend="torch", chunk_elems=1000, snapshot_device="cpu"),
        upload=UploadOptions(queue_size=3),
    )
    with Publisher(str(tmp_path / "s"), options=opts) as pub:
        assert (pub.snapshot.backend, pub.snapshot.chunk_elems, str(pub.snapshot.device)) == ("torch", 1000, "cpu")
        assert pub._uploader._queue.maxsize == 3
        info = pub.publish({"w": torch.ones(8, dtype=torch.bfloat16)}, version=0)
    assert info.uploaded.result().version == 0


# -- the shard group's decisions -------------------------------------------------------------------


def offer(version=1, *, tensors="T", layout="L", anchor=False, dtype="BF16", codec="compact", failure=None):
    return AgreeMessage(failure, Terms(version, tensors, layout, anchor, dtype, codec))


def test_settle_agrees_and_any_rank_can_ask_for_an_anchor():
    terms = settle([offer(), offer(anchor=True), offer(layout="other")])
    assert [t.anchor for t in terms] == [False, True, False]


def test_settle_raises_unraised_upload_failures_before_anything_else():
    msgs = [
        offer(),
        AgreeMessage(UploadFailure(3, "disk full (version 3)"), None, "ValueError: bad input"),
        offer(version=9, failure=UploadFailure(4, "network down")),
    ]
    failed = settle(msgs)
    assert isinstance(failed, UploadsFailed) and failed.versions == [3, 4]
    err = failed.error()
    assert isinstance(err, PublishError) and err.version == 3
    assert str(err) == "upload failed on rank 1: disk full (version 3) (version 3)"
    alone = UploadsFailed([(0, UploadFailure(2, "disk full"))], world=1)
    assert str(alone.error()) == "upload failed: disk full (version 2)"


def test_settle_names_the_rank_that_could_not_propose():
    with pytest.raises(ShardingError, match="rank 2 could not publish: TypeError: not a tensor"):
        settle([offer(), offer(), AgreeMessage(None, None, "TypeError: not a tensor")])


@pytest.mark.parametrize(
    "changed, what",
    [
        ({"version": 2}, "ranks [0, 1]: version 1; ranks [2]: version 2"),
        ({"dtype": "F16"}, "ranks [0, 1]: dtype BF16; ranks [2]: dtype F16"),
        ({"codec": "raw"}, "ranks [0, 1]: codec compact; ranks [2]: codec raw"),
    ],
)
def test_settle_refuses_ranks_that_differ(changed, what):
    with pytest.raises(ShardingError, match="ranks publish different") as err:
        settle([offer(), offer(), offer(**changed)])
    assert what in str(err.value)


def test_decide_reports():
    parts = [PartRecord(f"data/p{i}", 10, "0" * 16) for i in range(3)]
    assert decide_reports([PartUploaded(p) for p in parts], base=4) == parts
    # a failed part wins over a missing base: it is the error every rank raises
    mixed = [PartUploaded(parts[0]), BaseMissing(4), PartFailed("OSError: disk full")]
    assert decide_reports(mixed, base=4).error == "rank 2 failed to upload its part: OSError: disk full"
    assert decide_reports([PartUploaded(parts[0]), BaseMissing(4), BaseMissing(4)], base=4) == BaseMissing(4)


# -- the uploader ----------------------------------------------------------------------------------


class FailingWriter(VersionWriter):
    """The real store's writer; `commit_file` of one version raises (instrumentation, not a mock)."""

    fail_version: int | None = None

    def commit_file(self, header, local_path, *, move=False):
        if header.version == self.fail_version:
            raise OSError(f"disk full (injected at version {header.version})")
        return super().commit_file(header, local_path, move=move)


def job(version: int, *, base: int | None = None) -> UploadJob:
    """An anchor of one small tensor (or, with `base`, a delta that never gets as far as encoding)."""
    t = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3) + version
    sums = {"w": tensor_sum(t)}
    return UploadJob(
        version=version,
        kind="anchor" if base is None else "delta",
        base=base,
        base_checksum=None,
        checksum=to_hex(combine(sums.items())),
        codec=None if base is None else "compact",
        shapes={"w": (4, 3)},
        sums=np.array(list(sums.values()), dtype=np.uint64),
        owned=[Owned("w", t.reshape(-1), (4, 3), 0, 4)],
        nnz=12,
        numel=12,
        created=0.0,
        host=[t] if base is None else None,
    )


def test_uploader_latches_the_first_failure_and_drops_the_deltas_built_on_it(tmp_path):
    store = DeltaStore(str(tmp_path / "s"))
    store.writer = writer = FailingWriter(store.io, store.record_reader)  # callers that write hold the writer
    writer.fail_version = 0
    uploader = Uploader(VersionEncoder(get_codec("compact"), torch.bfloat16), SingleProcess(store), queue_size=2)
    jobs = [job(0), job(1, base=0)]
    for j in jobs:
        uploader.submit(j)
    uploader.join()
    assert isinstance(jobs[0].future.exception(), OSError)
    assert isinstance(jobs[1].future.exception(), PublishError) and "base version 0" in str(jobs[1].future.exception())
    assert uploader.unraised() == UploadFailure(0, "disk full (injected at version 0)")  # the drop is no error
    # raising another version's failure (another rank's) leaves this one for the next publish
    assert uploader.acknowledge([7]) is None and uploader.unraised() is not None
    exc = uploader.acknowledge([0])
    assert isinstance(exc, OSError) and uploader.unraised() is None
    # a failure already raised by another rank is not latched again
    writer.fail_version = 3
    uploader.acknowledge([3])
    later = [job(2), job(3)]
    for j in later:
        uploader.submit(j)
    uploader.join()
    assert later[0].future.result().version == 2 and isinstance(later[1].future.exception(), OSError)
    assert uploader.unraised() is None
    assert set(uploader.timings) == {0, 1, 2, 3} and "commit" in uploader.timings[2]
    uploader.close()
    assert store.versions() == [2]
