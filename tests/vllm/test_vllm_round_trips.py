"""What one follow-mode update costs in round trips and store reads, counted on a real protocol run.

No engine runs: the API process's DeltaService and a Follower drive a real worker replica (a toy
model with vLLM-style fused q/k/v loaders and one tensor through vLLM's sparse path) through the real
worker methods (installed on a stand-in Worker class, as the plugin installs them on vLLM's) and the
real engine-core hooks (patched onto a stand-in EngineCore). The stand-ins only dispatch and count:

* `api:<name>`: a collective_rpc from the API process (through the engine core);
* `worker:<name>`: a call that reaches the workers (model_executor.collective_rpc);
* store reads: DeltaStore.open and the files it finds (VersionFiles.local_paths), full-file sha256 reads,
  version files opened.

The store is remote to the server (fsspec's in-memory filesystem), so files are downloaded into the
cache and verified as on S3. Polls of the staging are counted apart (their number depends on timing).
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from typing import TYPE_CHECKING

import torch

from vllm_delta.store import DeltaStore
from vllm_delta.store import files as files_module
from vllm_delta.store import writes as storewrite_module
from vllm_delta.trainer import Publisher

if TYPE_CHECKING:
    from vllm_delta.vllm.worker.replica import DeltaReplica

POLL = "delta_stage_poll"


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16), requires_grad=False)
        self.wt = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, {"q": 0, "k": 4, "v": 8}[name], 4).copy_(w)
            else:
                self.wt.data.copy_(w.t())  # not a box copy: vLLM's sparse path
        return {"qkv", "wt"}


def toy_replica(files) -> DeltaReplica:
    """A worker's replica of the Toy model at the last of `files` (a version's chain), as --load-format
    delta leaves it: loaded, probed (one tensor through vLLM's sparse path), serving that version."""
    from vllm_delta.reconstruct import replay_tensor
    from vllm_delta.vllm.worker.replica import REPLICA_ATTR, DeltaReplica, Served

    model = Toy()
    model.load_weights((n, replay_tensor(files, n)) for n in files[-1].header.tensors)
    replica = DeltaReplica(model)
    replica.probe_layout({n: tuple(e.shape) for n, e in files[-1].header.tensors.items()})
    replica.fallback.set_shadow("wt", replay_tensor(files, "wt"))
    replica.served = Served.from_header(files[-1].header)
    setattr(model, REPLICA_ATTR, replica)
    return replica


def _publish(uri: str, versions: range, gen: torch.Generator, w: dict[str, torch.Tensor]) -> None:
    with Publisher(uri, anchor_every=100) as pub:
        for version in versions:
            pub.publish({n: t.to(torch.bfloat16) for n, t in w.items()}, version=version)
            for t in w.values():
                t += 0.05 * torch.randn(t.shape, generator=gen)


def test_one_follow_mode_update(tmp_path, monkeypatch):
    from vllm_delta.reconstruct import open_chain
    from vllm_delta.vllm.api_server.follower import Follower, FollowOptions
    from vllm_delta.vllm.api_server.service import DeltaService
    from vllm_delta.vllm.engine_core import calls as enginecore
    from vllm_delta.vllm.shared.options import StoreSpec
    from vllm_delta.vllm.worker import methods as worker

    uri = f"memory://round-trips-{uuid.uuid4().hex[:8]}/run"
    gen = torch.Generator().manual_seed(0)
    w = {n: torch.randn(s, generator=gen) for n, s in {"q": (4, 4), "k": (4, 4), "v": (4, 4), "wt": (6, 4)}.items()}
    _publish(uri, range(2), gen, w)
    cache = str(tmp_path / "cache")

    # The worker: a replica at version 0, as --load-format delta leaves it.
    model = toy_replica(open_chain(DeltaStore(uri, cache_dir=cache), 0)).model

    counts: collections.Counter[str] = collections.Counter()

    class Worker:
        def get_model(self):
            return model

    worker.install(Worker)
    the_worker = Worker()

    class Executor:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            counts[f"worker:{method}"] += 1
            return [getattr(the_worker, method)(*args, **(kwargs or {}))]

    class Core:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return self.model_executor.collective_rpc(method, timeout, args, kwargs)

        def _attach_weight_version(self, outputs):
            pass

    enginecore.patch_engine_core(Core)
    core = Core()
    core.model_executor, core.scheduler, core.batch_queue, core._weight_version = Executor(), None, None, "0"

    class Client:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            counts[f"api:{method}"] += 1
            return core.collective_rpc(method, timeout, args, kwargs)

        async def pause_generation(self, **kwargs):
            counts["engine:pause"] += 1

        async def resume_generation(self):
            counts["engine:resume"] += 1

        async def reset_prefix_cache(self, **kwargs):
            counts["engine:reset_prefix_cache"] += 1
            return True

    reads: collections.Counter[str] = collections.Counter()
    for owner, method in ((DeltaStore, "open"), (files_module.VersionFiles, "local_paths")):
        original = getattr(owner, method)

        def counted(self, *args, _original=original, _name=f"{owner.__name__}.{method}", **kwargs):
            reads[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(owner, method, counted)
    # The store's reading half (files.py) and writing half (writes.py) each name these.
    sha256, version_file = storewrite_module.file_sha256, files_module.VersionFile

    def counted_sha256(path):
        reads["sha256 of a whole file"] += 1
        return sha256(path)

    def counted_version_file(*args, **kwargs):
        reads["version file opened"] += 1
        return version_file(*args, **kwargs)

    monkeypatch.setattr(storewrite_module, "file_sha256", counted_sha256)
    for module in (files_module, storewrite_module):
        monkeypatch.setattr(module, "VersionFile", counted_version_file)

    async def scenario():
        service = DeltaService.of(Client(), StoreSpec(uri, cache_dir=cache))

        async def apply(version):
            result = await service.follow_update(version, "keep")
            return None if result is None else result.pause_ms

        follower = Follower(
            service.store,
            FollowOptions(follow=True, report=True, replica_id="counted"),
            served=service.served_version,
            apply=apply,
            checksums=service.checksums,
        )
        await follower.poll_once()  # warm: the first update after start-up
        assert follower.state.served == 1 and follower.state.last_error is None, follower.state
        _publish(uri, range(2, 3), gen, w)
        counts.clear()
        reads.clear()
        await follower.poll_once()  # one follow-mode update to version 2, and the ledger report after it
        assert follower.state.served == 2 and follower.state.last_error is None, follower.state
        update_counts = collections.Counter(counts)
        counts.clear()
        status = await service.status()  # answered from what the API process keeps current
        assert not counts, counts
        verified = await service.checks.verify("request")  # the explicit recomputation: one worker call
        assert counts == {"api:delta_status": 1, "worker:delta_status": 1}, counts
        counts.clear()
        counts.update(update_counts)
        return status, verified, await service.checksums()

    status, verified, (live, recorded) = asyncio.run(scenario())
    assert live == recorded == status.checksum == status.version_checksum  # the report's: the update landed
    assert verified.ok and verified.checksum == live and verified.mismatched == []
    polls = {k: counts.pop(k) for k in list(counts) if k.endswith(POLL)}
    api = {k: v for k, v in counts.items() if k.startswith("api:")}
    to_workers = {k: v for k, v in counts.items() if k.startswith("worker:")}
    print(f"\nROUND TRIPS api={dict(api)} workers={dict(to_workers)} polls={polls} reads={dict(reads)}")
    assert polls[f"api:{POLL}"] >= 1
    # status, stage start, the commit (one engine-core call: commit + label), release; the report: nothing
    # (its live checksum is the one kept current at the commit)
    assert sum(api.values()) == 4, api
    assert sum(to_workers.values()) == 4, to_workers  # status, stage start, commit, release
    assert counts["engine:pause"] == counts["engine:resume"] == counts["engine:reset_prefix_cache"] == 1
    # The version's files: found (downloaded and verified) once by the API process, once by the worker.
    assert reads["DeltaStore.open"] == 2 and reads["VersionFiles.local_paths"] == 2, reads
