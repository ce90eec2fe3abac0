"""vLLM's native weight-transfer API, backed by the store: `--weight-transfer-config '{"backend": "delta"}'`.

    init_weight_transfer_engine {"init_info": {}}            (optional {"store": URI} if the server
                                                               was not started with --load-format delta)
    start_weight_update                                       (no-op: updates are in place)
    update_weights {"update_info": {"version": N | "latest", "allow_reanchor": false}}   (an older N on the
                                                               served chain: backward, shared/plan.py)
    finish_weight_update                                      (no-op)

`update_weights` runs on every rank at once: each stages its share, the ranks exchange checksum
partials and verify them against the version header before anyone writes, then all write in place; if a
rank fails, every rank rolls back. Pausing generation around it is the caller's business, as for
every native backend (vLLM's /pause and /resume, or `LLM` being synchronous).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...checksums import Sums
from ...errors import PatchFailedError, RollbackFailedError
from ...format import VersionHeader, VersionLike
from ...server_api import Method
from ..shared import rpc
from ..shared.cache_keep import PRUNE_FAILED, CacheKeeper
from ..shared.eplb import refuse_eplb
from ..shared.messages import Patched, RolledBack, StageSummary
from ..shared.options import StoreSpec, server_store, trusted_keys_from_environment
from ..shared.plan import UpdatePlan, plan_update
from ..shared.trust import TrustPolicy
from ..shared.two_phase import (
    AllPatched,
    AllRolledBack,
    PatchOptions,
    Staged,
    TwoPhaseUpdate,
    Update,
    patch_all,
    run_sync,
)
from . import dist
from .methods import open_store
from .replica import DeltaReplica, replica_of

if TYPE_CHECKING:
    from ...store import DeltaStore

log = logging.getLogger(__name__)


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    store: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)


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
        self.trust: TrustPolicy | None = None

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        refuse_eplb(self.vllm_config, "the weight-transfer backend delta")
        if init_info.store:
            # Another store, the same trust: the server's delta_trusted_keys still hold (a client cannot
            # turn the check off by naming a store).
            keys = self.spec.trusted_keys if self.spec is not None else trusted_keys_from_environment()
            self.spec = StoreSpec(init_info.store, dict(init_info.storage_options or {}), trusted_keys=keys)
            self.trust = None

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def receive_weights(self, update_info: DeltaUpdateInfo) -> None:
        refuse_eplb(self.vllm_config, "weight updates through the weight-transfer backend delta")
        if self.spec is None:
            raise ValueError("no store: start with --load-format delta or pass init_info {'store': URI}")
        store = open_store(self.spec)
        replica = replica_of(self.model)
        target = store.resolve(update_info.version)
        if not replica.probed:  # every rank gets here together: the probe's exchange is collective
            replica.probe_layout(store.open(target, fresh=True).header.tensors.shape_map())
        self.trust = self.trust or TrustPolicy.of(self.spec.trust())  # the run pinned once, by the first plan
        served = replica.served
        plan = plan_update(store, served.version, served.checksum, target, update_info.allow_reanchor, self.trust)
        if not plan.versions:
            return
        steps = RankUpdate(replica, store, plan)
        run_sync(steps.apply(Update(uuid.uuid4().hex, plan.versions, plan.target), PatchOptions()))
        if replica.rank == 0:  # the ranks of a host share the cache (shared/cache_keep.py)
            try:
                CacheKeeper(store, self.spec.cache_max_bytes).prune(plan.target)
            except Exception as exc:  # noqa: BLE001 - pruned next time
                log.warning(PRUNE_FAILED, exc)


class GatheredRanks:
    """Every rank at once, seen from one worker rank: this rank's reply, exchanged with the others'
    (a collective: every rank makes the same calls in the same order)."""

    def __init__(self, replica: DeltaReplica):
        self.replica = replica

    async def patch(self, ticket: str, method: Method = "delta", fault: str | None = None) -> rpc.Replies[Patched]:
        def patch() -> Patched:
            return Patched(self.replica.patch(ticket, fault=fault, method=method))

        return rpc.Replies.decode(Patched, dist.all_gather_object(rpc.answer(rpc.PATCH.name, patch)))

    async def rollback(self, ticket: str) -> rpc.Replies[RolledBack]:
        def rollback() -> RolledBack:
            return RolledBack(self.replica.rollback(ticket))

        return rpc.Replies.decode(RolledBack, dist.all_gather_object(rpc.answer(rpc.ROLLBACK.name, rollback)))


class RankUpdate(TwoPhaseUpdate[None]):
    """The protocol's steps on one worker rank (vLLM's weight-transfer backend): every rank stages
    its share synchronously, the ranks exchange their summaries and verify them against the version
    header before anyone writes, all write, and all roll back if one fails. The caller pauses."""

    def __init__(self, replica: DeltaReplica, store: DeltaStore, plan: UpdatePlan):
        self.replica = replica
        self.store = store
        self.plan = plan
        self.files: list[VersionLike] = []

    async def stage_ranks(self, update: Update) -> rpc.Replies[StageSummary]:
        def stage() -> StageSummary:
            # Opened inside the exchanged step: a rank that can't read a file reports it to every rank.
            self.files = [self.store.open(r.version, record=r) for r in self.plan.files]
            return self.replica.stage(update.ticket, self.files, undo=self.plan.undo_to is not None)

        return rpc.Replies.decode(StageSummary, dist.all_gather_object(rpc.answer("staging", stage)))

    async def verification_basis(self, update: Update) -> tuple[Sums, VersionHeader]:
        served = self.replica.served  # the same on every rank: the served version's header
        current = served.sums if served.version is not None else self.replica.live_sums_all_ranks()
        return current, self.files[-1].header

    async def patch_ranks(self, staged: Staged, options: PatchOptions) -> None:
        outcome = await patch_all(
            GatheredRanks(self.replica), staged.update.ticket, method=staged.update.method, after_patch=_nothing
        )
        if isinstance(outcome, AllPatched):
            return
        version = staged.update.target
        if isinstance(outcome, AllRolledBack):
            raise PatchFailedError(
                f"update to version {version} failed and was rolled back on every rank: {outcome.failure}"
            )
        raise RollbackFailedError(
            f"update to version {version} failed ({outcome.failure}) and could not be rolled back: "
            f"{outcome.rollback_failure}"
        )

    async def release(self, ticket: str) -> None:
        self.replica.release(ticket)

    async def drop_cached(self, versions: list[int]) -> None:
        self.store.cache.prune(versions=versions)


def _nothing(written: list[Patched]) -> None:
    return None
