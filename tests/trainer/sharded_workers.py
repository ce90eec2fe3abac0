"""What each rank runs in tests/trainer/test_sharded.py (imported by name in the rank processes).

Every function takes (rank, world, ...) and runs inside a real gloo process group (run_ranks). Ranks
check what only they can see (the PublishInfo, the errors they raise) and return small summaries;
the test process compares the stores afterwards.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from vllm_delta import Publisher, ShardedTensor
from vllm_delta.errors import PublishError, ShardingError
from vllm_delta.store import DeltaStore
from vllm_delta.store.writes import VersionWriter
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.sharded import fsdp_model, full_image
from vllm_delta.testing.training import train_steps
from vllm_delta.trainer import PublisherOptions, ShardingOptions, StoreOptions

SPEC = TinyModelSpec(arch="qwen3", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1)
SPEC_UNEVEN = TinyModelSpec(
    arch="qwen3", hidden_size=96, intermediate_size=160, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=500
)


def expect(exc_type, fn, *match):
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        for m in match:
            assert m in text, f"{m!r} not in {text!r}"
        return text
    raise AssertionError(f"{exc_type.__name__} not raised")


# -- FSDP2: a tiny Qwen3 trained with AdamW, published by every rank and by one process ---------------


def fsdp_train_and_publish(rank, world, root, spec, steps, anchor_every, codec, lr, s3=None):
    """Versions 0..steps of an FSDP2 model: sharded into root/sharded (and S3 if given); rank 0 also
    publishes the gathered full weights with a single-process Publisher into root/single."""
    model = fsdp_model(spec, seed=11)
    kw = dict(anchor_every=anchor_every, codec=codec)
    pubs = [
        Publisher(
            os.path.join(root, "sharded"),
            group=dist.group.WORLD,
            options=PublisherOptions(sharding=ShardingOptions(timeout_s=60)),
            **kw,
        )
    ]
    if s3 is not None:
        options = PublisherOptions(
            store=StoreOptions(storage_options=s3["options"]), sharding=ShardingOptions(timeout_s=60)
        )
        pubs.append(Publisher(s3["uri"], group=dist.group.WORLD, options=options, **kw))
    single = Publisher(os.path.join(root, "single"), **kw) if rank == 0 else None
    infos = []
    steps_iter = train_steps(model, steps, lr=lr, seed=11)
    for v in range(steps + 1):
        if v:
            next(steps_iter)
        got = [pub.publish(model, version=v) for pub in pubs]
        image = full_image(model)  # a collective: every rank
        if single is not None:
            want = single.publish(image, version=v)
            for info in got:
                assert (info.kind, info.base, info.checksum, info.nnz, info.numel) == (
                    want.kind,
                    want.base,
                    want.checksum,
                    want.nnz,
                    want.numel,
                ), (info, want)
        infos.append((got[0].version, got[0].kind, got[0].base, got[0].checksum, got[0].nnz))
    for pub in pubs:
        pub.close()
    if single is not None:
        single.close()
    # every version is visible once close() returned, on every rank
    assert DeltaStore(os.path.join(root, "sharded")).versions() == list(range(steps + 1))
    return infos


# -- plain DTensors, a hand-sharded mapping, replicated tensors; then every kind of disagreement --------


def _full(v: int) -> dict[str, torch.Tensor]:
    """The full tensors at version v (the same on every rank): a few bits move each version."""
    gen = torch.Generator().manual_seed(3)
    shapes = {
        "a.weight": (7, 5),  # 3/3/1 rows over 3 ranks
        "b.weight": (2, 8),  # 1/1/0: an empty shard
        "norm.weight": (8,),  # a Replicate() DTensor
        "plain.bias": (6,),  # a plain tensor: replicated
        "hand.weight": (9, 6),  # hand-sharded, uneven, with an empty shard
        "scale": (),  # 0-d, plain
    }
    out = {n: (torch.randn(s, generator=gen) * 0.05).float() for n, s in shapes.items()}
    for step in range(1, v + 1):
        g = torch.Generator().manual_seed(100 + step)
        for t in out.values():
            flat = t.reshape(-1)
            k = max(1, flat.numel() // 5)
            pos = torch.randperm(flat.numel(), generator=g)[:k]
            flat[pos] += 1e-2 * torch.randn(k, generator=g)
    return out


HAND_ROWS = {3: [(0, 4), (4, 4), (4, 9)], 2: [(0, 5), (5, 9)]}


def _mapping(rank: int, world: int, v: int, *, hand_rows=None, drop=None, extra=None) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = _full(v)
    r0, r1 = (hand_rows or HAND_ROWS[world])[rank]
    out = {
        "a.weight": distribute_tensor(full["a.weight"], mesh, [Shard(0)]),
        "b.weight": distribute_tensor(full["b.weight"], mesh, [Shard(0)]),
        "norm.weight": distribute_tensor(full["norm.weight"], mesh, [Replicate()]),
        "plain.bias": full["plain.bias"],
        "hand.weight": ShardedTensor(full["hand.weight"][r0:r1].clone(), (9, 6), r0),
        "scale": full["scale"],
    }
    if drop:
        out.pop(drop)
    if extra:
        out.update(extra)
    return out


def mapping_publish(rank, world, root):
    """Versions 0..4 of the mapping (anchor every 3), sharded and single-process (rank 0)."""
    pub = Publisher(
        os.path.join(root, "sharded"),
        group=dist.group.WORLD,
        anchor_every=3,
        options=PublisherOptions(sharding=ShardingOptions(timeout_s=60)),
    )
    single = Publisher(os.path.join(root, "single"), anchor_every=3) if rank == 0 else None
    owned = []
    for v in range(5):
        mapping = _mapping(rank, world, v)
        info = pub.publish(mapping, version=v)
        if single is not None:
            want = single.publish(_full(v), version=v)
            assert (info.kind, info.checksum, info.nnz, info.numel) == (want.kind, want.checksum, want.nnz, want.numel)
    pub.close()
    if single is not None:
        single.close()
    from vllm_delta.trainer.shard import resolve

    own = resolve(list(_mapping(rank, world, 0).items()), rank, world)
    owned = {o.name: [o.row0, o.row1] for o in own.owned}
    return owned


def timed_publish(rank, world, root):
    """Versions 0..2 of the mapping; the phases the last delta's publish and upload timed on this rank."""
    options = PublisherOptions(sharding=ShardingOptions(timeout_s=60))
    with Publisher(os.path.join(root, "timed"), group=dist.group.WORLD, options=options) as pub:
        for v in range(3):
            info = pub.publish(_mapping(rank, world, v), version=v)
            info.uploaded.result()
        return {"publish": sorted(info.timings), "upload": sorted(pub.upload_timings[2]), "kind": info.kind}


def reshard_publish(rank, world, root):
    """Versions 0 and 1 of one mapping object (version 1 reuses version 0's resolution), then version 2
    of a new mapping whose hand-sharded tensor is split elsewhere. Returns the resolutions reused."""
    pub = Publisher(
        os.path.join(root, "reshard"),
        group=dist.group.WORLD,
        options=PublisherOptions(sharding=ShardingOptions(timeout_s=60)),
    )
    first = _mapping(rank, world, 0, hand_rows=[(0, 4), (4, 9)])
    pub.publish(first, version=0)
    with torch.no_grad():
        first["hand.weight"].local.add_(1.0)
    pub.publish(first, version=1)
    pub.publish(_mapping(rank, world, 2, hand_rows=[(0, 6), (6, 9)]), version=2)
    pub.close()
    return pub._sources.hits


def fsdp_witness(rank, world):
    """SourceCache over an FSDP2 module with a plain buffer beside its DTensor parameters: reused while
    nothing changes, resolved again when a DTensor's local shard or the buffer moves to new memory."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from vllm_delta.trainer.sources import SourceCache

    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    model.register_buffer("freqs", torch.arange(5.0))
    fully_shard(model)
    cache = SourceCache()
    seen = [cache.ownership(model, rank, world)]
    seen.append(cache.ownership(model, rank, world))  # nothing changed
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in place, as an optimizer step
    seen.append(cache.ownership(model, rank, world))
    model[0].weight._local_tensor = model[0].weight._local_tensor.clone()  # the shard in new memory
    seen.append(cache.ownership(model, rank, world))
    model.freqs.data = torch.arange(5.0) * 2  # the plain buffer in new memory
    seen.append(cache.ownership(model, rank, world))
    reused = [seen[i] is seen[i - 1] for i in range(1, len(seen))]
    return reused, (cache.hits, cache.misses)


def disagreements(rank, world, root):
    """Each disagreement raises the same ShardingError on every rank, and nothing becomes visible."""
    uri = os.path.join(root, "errors")
    pub = Publisher(uri, group=dist.group.WORLD, options=PublisherOptions(sharding=ShardingOptions(timeout_s=60)))
    pub.publish(_mapping(rank, world, 0), version=0)
    pub.flush()
    seen = {}
    # different version numbers
    seen["version"] = expect(
        ShardingError,
        lambda: pub.publish(_mapping(rank, world, 1), version=1 if rank < world - 1 else 2),
        "different versions",
        f"ranks {list(range(world - 1))}: version 1",
        f"ranks [{world - 1}]: version 2",
    )
    # different tensor sets
    seen["set"] = expect(
        ShardingError,
        lambda: pub.publish(_mapping(rank, world, 1, drop="plain.bias" if rank == 1 else None), version=1),
        "'plain.bias'",
        "ranks [1] lack it",
    )
    seen["shape"] = expect(
        ShardingError,
        lambda: pub.publish(
            _mapping(rank, world, 1, extra={"x": torch.zeros(3 if rank == 0 else 4)}),
            version=1,
        ),
        "'x'",
        "ranks [0] have shape [3]",
    )
    # overlapping and missing rows of a hand-sharded tensor
    overlap = [(0, 5), (4, 9)] + [(9, 9)] * (world - 2)
    seen["overlap"] = expect(
        ShardingError,
        lambda: pub.publish(_mapping(rank, world, 1, hand_rows=overlap), version=1),
        "'hand.weight'",
        "rows [4, 5) are held by ranks 0 and 1",
    )
    gap = [(0, 3), (4, 9)] + [(9, 9)] * (world - 2)
    seen["gap"] = expect(
        ShardingError,
        lambda: pub.publish(_mapping(rank, world, 1, hand_rows=gap), version=1),
        "'hand.weight'",
        "rows [3, 4) are held by no rank (between ranks 0 and 1)",
    )
    short = [(0, 4), (4, 8)] + [(8, 8)] * (world - 2)
    seen["short"] = expect(
        ShardingError,
        lambda: pub.publish(_mapping(rank, world, 1, hand_rows=short), version=1),
        "rows [8, 9) are held by no rank",
    )
    # a rank whose own input is wrong: every rank raises
    seen["local"] = expect(
        ShardingError,
        lambda: pub.publish(
            _mapping(rank, world, 1, extra={"bad": ShardedTensor(torch.zeros(2, 3), (4, 4), 0)} if rank == 2 else None),
            version=1,
        ),
        "rank 2 could not publish",
    )
    assert DeltaStore(uri).versions() == [0]
    # after all that, the same publisher goes on (the layout is the good one again)
    info = pub.publish(_mapping(rank, world, 1), version=1)
    assert info.kind == "delta", info
    pub.close()
    assert DeltaStore(uri).versions() == [0, 1]
    return seen


class FailingWriter(VersionWriter):
    """The real store's writer; `put_part` of one version raises on one rank (instrumentation, not a mock)."""

    fail_version: int | None = None

    def put_part(self, header, local_path, *, move=False):
        if header.version == self.fail_version:
            raise OSError(f"disk full (injected on rank {header.part.index})")
        return super().put_part(header, local_path, move=move)


def store_writing_with(uri: str, writer: type[VersionWriter]) -> DeltaStore:
    """The real store at `uri`, its versions written by `writer` (callers that write hold the writer)."""
    store = DeltaStore(uri)
    store.writer = writer(store.io, store.record_reader)
    return store


def upload_failure(rank, world, root):
    """Rank 1's part of version 2 fails: nothing of 2 is visible, every rank raises (at its next
    publish, or at flush), and the next version is an anchor on every rank."""
    uri = os.path.join(root, "failure")
    store = store_writing_with(uri, FailingWriter)
    if rank == 1:
        store.writer.fail_version = 2
    pub = Publisher(
        store,
        group=dist.group.WORLD,
        anchor_every=100,
        options=PublisherOptions(sharding=ShardingOptions(timeout_s=60)),
    )
    kinds = []
    for v in range(2):
        kinds.append(pub.publish(_mapping(rank, world, v), version=v).kind)
    info = pub.publish(_mapping(rank, world, 2), version=2)
    try:
        info.uploaded.result(timeout=60)
        raise AssertionError("version 2 should have failed")
    except PublishError as exc:
        assert "rank 1 failed to upload its part" in str(exc) and "disk full" in str(exc), exc
    # the next publish raises on every rank (rank 1 knows why; the others learn it in the gather)
    expect(PublishError, lambda: pub.publish(_mapping(rank, world, 3), version=3), "upload failed", "disk full")
    info = pub.publish(_mapping(rank, world, 3), version=3)
    kinds.append(info.kind)
    assert info.kind == "anchor", info
    # the same through flush
    if rank == 1:
        store.writer.fail_version = 4
    pub.publish(_mapping(rank, world, 4), version=4)
    try:
        info5 = pub.publish(_mapping(rank, world, 5), version=5)  # a delta on 4: dropped with it
    except PublishError as exc:  # rank 1's failure was already known at 5's agreement (on every rank)
        assert "disk full" in str(exc), exc
    else:
        expect(PublishError, pub.flush, "disk full")
        assert info5.uploaded.exception(timeout=60) is not None
    info = pub.publish(_mapping(rank, world, 6), version=6)
    kinds.append(info.kind)
    pub.close()
    visible = DeltaStore(uri).versions()
    assert visible == [0, 1, 3, 6], visible
    return {"kinds": kinds, "files": sorted(os.listdir(os.path.join(uri, "data")))}


# -- a rank killed in the middle of a publish ---------------------------------------------------------


class DyingWriter(VersionWriter):
    """The real store's writer; the last rank SIGKILLs itself right after uploading its part of one version."""

    die_at: int | None = None

    def put_part(self, header, local_path, *, move=False):
        part = super().put_part(header, local_path, move=move)
        if header.version == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return part


def _hand_mapping(rank: int, world: int, v: int) -> dict:
    """`_mapping` without DTensors: building it needs no collective (the group may be broken)."""
    full = _full(v)
    r0, r1 = HAND_ROWS[world][rank]
    a0, a1 = [(0, 3), (3, 6), (6, 7)][rank] if world == 3 else [(0, 4), (4, 7)][rank]
    return {
        "a.weight": ShardedTensor(full["a.weight"][a0:a1].clone(), (7, 5), a0),
        "hand.weight": ShardedTensor(full["hand.weight"][r0:r1].clone(), (9, 6), r0),
        "plain.bias": full["plain.bias"],
        "scale": full["scale"],
    }


def killed_rank(rank, world, root, die_at):
    uri = os.path.join(root, "killed")
    store = store_writing_with(uri, DyingWriter)
    if rank == world - 1:
        store.writer.die_at = die_at
    pub = Publisher(
        store,
        group=dist.group.WORLD,
        anchor_every=100,
        options=PublisherOptions(sharding=ShardingOptions(timeout_s=20)),
    )
    for v in range(die_at + 1):
        info = pub.publish(_hand_mapping(rank, world, v), version=v)
    t0 = time.monotonic()
    expect(PublishError, pub.flush, f"version {die_at}")
    assert info.uploaded.exception(timeout=60) is not None
    expect(
        PublishError, lambda: pub.publish(_hand_mapping(rank, world, die_at + 1), version=die_at + 1), "group failed"
    )
    waited = time.monotonic() - t0
    assert die_at not in DeltaStore(uri).versions()
    try:
        pub.close()
    except PublishError:
        pass
    return {"waited_s": waited}


def gated_mark(rank, world, root):
    """Bounded staleness on a sharded publisher: rank 0 waits for the replicas, a bad-version mark
    releases the wait, and every rank publishes the next version as an anchor."""
    import threading

    from vllm_delta.store.ledger import Ledger, ReplicaReport
    from vllm_delta.trainer import StalenessPolicy

    uri = os.path.join(root, "gated")
    policy = StalenessPolicy(max_staleness=1, min_replicas=1, timeout_s=30, poll_s=0.05)
    if rank == 0:
        now = time.time()
        report = ReplicaReport("r", "h", 1, None, None, 1, None, None, now + 3600, now)  # fresh for the test
        Ledger(DeltaStore(uri)).report(report)
    dist.barrier()
    options = PublisherOptions(staleness=policy, sharding=ShardingOptions(timeout_s=60))
    pub = Publisher(uri, group=dist.group.WORLD, anchor_every=100, options=options)
    for v in range(3):  # 2 needs the replica at >= 1: it is
        pub.publish(_mapping(rank, world, v), version=v)
    pub.flush()
    marker = None
    if rank == 0:  # the replica skips 2 (say it is corrupt); an operator marks it while 3 waits
        marker = threading.Timer(0.5, lambda: DeltaStore(uri).mark_bad(2, "corrupt"))
        marker.start()
    t0 = time.monotonic()
    info = pub.publish(_mapping(rank, world, 3), version=3)
    waited = time.monotonic() - t0
    if marker is not None:
        marker.join()
    pub.close()
    return {"kind": info.kind, "base": info.base, "waited": waited}


def signed_publish(rank, world, root, key_path):
    """Versions 0..3 of the mapping (anchor every 3) to a local store, signed by rank 0; the other ranks
    are handed a key path that does not exist (they never read it). Returns the checksums."""
    key = key_path if rank == 0 else os.path.join(root, "no-such-key")
    options = PublisherOptions(sharding=ShardingOptions(timeout_s=60))
    with Publisher(
        os.path.join(root, "signed"), group=dist.group.WORLD, anchor_every=3, options=options, signing_key=key
    ) as pub:
        return [pub.publish(_mapping(rank, world, v), version=v).checksum for v in range(4)]


def late_reader(rank, world, root):
    """Versions 0..2 where rank 1 reads every answer of the upload channel a second late (it uploads as
    fast as rank 0): rank 0 reaches its close while rank 1 is still to read the last commit decision.
    Returns each version's checksum as this rank's publish saw it."""
    from vllm_delta.trainer.rendezvous import RankChannel

    if rank == 1:
        wait_get = RankChannel._wait_get

        def late(self, keys, what, n):
            if "commit" in what:
                time.sleep(1.0)
            return wait_get(self, keys, what, n)

        RankChannel._wait_get = late
    options = PublisherOptions(sharding=ShardingOptions(timeout_s=60))
    with Publisher(os.path.join(root, "store"), group=dist.group.WORLD, anchor_every=3, options=options) as pub:
        return [pub.publish(_mapping(rank, world, v), version=v).checksum for v in range(3)]
