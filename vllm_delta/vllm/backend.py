"""vLLM's native weight-transfer API, backed by the store: `--weight-transfer-config '{"backend": "delta"}'`.

    init_weight_transfer_engine {"init_info": {}}            (optional {"store": URI} if the server
                                                               was not started with --load-format delta)
    start_weight_update                                       (no-op: updates are in place)
    update_weights {"update_info": {"version": N | "latest", "allow_reanchor": false}}
    finish_weight_update                                      (no-op)

`update_weights` runs on every rank at once: each stages its share, the ranks exchange checksum
partials and verify them against the version header before anyone writes, then all commit; if a
rank fails, every rank rolls back. Pausing generation around it is the caller's business, as for
every native backend (vLLM's /pause and /resume, or `LLM` being synchronous).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..checksums import Sums, verify_partials
from ..errors import http_status
from . import dist
from .options import StoreSpec, server_store
from .plan import plan_update
from .replica import replica_of
from .worker import open_store

log = logging.getLogger(__name__)


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    store: str | None = None
    storage_options: dict = field(default_factory=dict)


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    version: int | str = "latest"
    allow_reanchor: bool = False


class DeltaWeightTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        load = vllm_config.load_config
        self.spec: StoreSpec | None = server_store(load.load_format, load.model_loader_extra_config)

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        if init_info.store:
            self.spec = StoreSpec(init_info.store, dict(init_info.storage_options or {}))

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def receive_weights(self, update_info: DeltaUpdateInfo) -> None:
        if self.spec is None:
            raise ValueError("no store: start with --load-format delta or pass init_info {'store': URI}")
        store = open_store(self.spec.to_dict())
        replica = replica_of(self.model)
        target = store.resolve(update_info.version)
        if not replica.prepared:  # every rank gets here together: the probe's exchange is collective
            replica.prepare({n: tuple(e.shape) for n, e in store.open(target, fresh=True).header.tensors.items()})
        plan = plan_update(store, replica.served.version, replica.served.checksum, target, update_info.allow_reanchor)
        if not plan.versions:
            return
        try:
            files = [store.open(r.version, record=r) for r in plan.records]
        except Exception as exc:
            if http_status(exc) == 422:  # a damaged copy must not stay in the cache
                store.prune_cache(versions=plan.versions)
            raise
        ticket = uuid.uuid4().hex
        # Stage everywhere, then agree: every rank raises the same error if any rank failed.
        error: BaseException | None = None
        partials: Sums | None = None
        try:
            partials = replica.stage(ticket, files).partials
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below, or the others hang
            error = exc
        gathered: list[Sums | None] = dist.all_gather_object(partials)
        try:
            if error is not None:
                raise error
            ranks = [p for p in gathered if p is not None]
            if len(ranks) != len(gathered):
                raise RuntimeError("staging failed on another rank")
            current = replica.served.sums if replica.served.version is not None else replica.live_sums_all_ranks()
            verify_partials(current, ranks, files[-1].header)
            ok = True
            try:
                replica.commit(ticket)
            except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised
                ok, error = False, exc
            if not all(dist.all_gather_object(ok)):
                replica.rollback(ticket)
                raise error or RuntimeError("the update failed on another rank; every rank rolled back")
        except Exception as exc:
            if http_status(exc) == 422:
                store.prune_cache(versions=plan.versions)
            raise
        finally:
            replica.release(ticket)
        if replica.rank == 0:  # the ranks of a host share the cache: keep the served version's chain
            try:
                keep = [r.version for r in store.chain(plan.target)]
                store.prune_cache(keep, max_bytes=self.spec.cache_max_bytes)
            except Exception as exc:  # noqa: BLE001 - pruned next time
                log.warning("vllm-delta: pruning the download cache failed: %s", exc)
