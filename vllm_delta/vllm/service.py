"""The update protocol, run in the API server process against every worker rank (collective_rpc).

    plan      which versions to apply (plan.py: successor rule, 404 / 409)
    prepare   probe the layout on every rank, once
    stage     every rank decodes its share on a background thread; the server keeps generating
    verify    the ranks' checksum partials added to the served version's sums must give the target
              header's sums, per tensor (422 on mismatch: nothing has been written)
    pause     pause scheduling (mode keep | wait | abort)
    commit    every rank writes in place; if any rank fails, every rank rolls back
    reset     the prefix cache (its KV was computed with the old weights), only after a commit
    resume    always (finally)

Updates, prefetches and status reads are serialized by one asyncio.Lock, so a status never sees
a half-applied update and two updates never interleave.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..checksums import MASK64, combine, to_hex, verify_partials
from ..errors import DeltaError
from .options import StoreSpec
from .plan import UpdatePlan, plan_update
from .replica import FAULTS_ENV

log = logging.getLogger(__name__)

MODES = ("keep", "wait", "abort")
METHODS = ("delta", "vllm")
POLL_S = 0.005  # staging poll interval: each poll is one cheap RPC between forward passes
RPC_TIMEOUT_S = float(os.environ.get("VLLM_DELTA_RPC_TIMEOUT_S", "600"))


class WorkerError(DeltaError):
    """An error a worker rank reported, with the HTTP status it maps to."""

    def __init__(self, payload: dict, rank: int):
        super().__init__(f"rank {rank}: {payload.get('type', 'Error')}: {payload.get('message', '')}")
        self.http_status = int(payload.get("status", 500))
        self.payload = payload


class BadRequest(DeltaError):
    http_status = 400


@dataclass
class Prefetched:
    served: int | None
    plan: UpdatePlan
    ticket: str
    method: str
    summaries: list[dict]
    stage_ms: float
    from_prefetch: bool = False  # staged by an earlier /v1/delta/stage


class DeltaService:
    def __init__(self, engine_client: Any, spec: StoreSpec):
        self.engine = engine_client
        self.spec = spec
        self._store = None
        self.lock = asyncio.Lock()
        self.prefetched: Prefetched | None = None
        self.last_update: dict | None = None

    @property
    def store(self):
        if self._store is None:
            self._store = self.spec.open()
        return self._store

    # -- RPC helpers ----------------------------------------------------------------------------
    async def _rpc(self, _name: str, check: bool = True, **kwargs) -> list[dict]:
        results = await self.engine.collective_rpc(_name, timeout=RPC_TIMEOUT_S, kwargs=kwargs)
        if check:
            for rank, r in enumerate(results):
                if isinstance(r, dict) and "error" in r:
                    raise WorkerError(r["error"], rank)
        return results

    async def _served(self) -> dict:
        ranks = await self._rpc("delta_status")
        versions = {(r["version"], r["checksum"]) for r in ranks}
        if len(versions) != 1:
            raise DeltaError(f"worker ranks disagree on the served version: {sorted(versions, key=str)}")
        return ranks[0]

    async def _prepare(self, served: dict, version: int) -> None:
        if not served["prepared"]:
            await self._rpc("delta_prepare", store=self.spec.to_dict(), version=version)

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- staging --------------------------------------------------------------------------------
    async def _stage(self, served: dict, requested, allow_reanchor: bool, method: str) -> Prefetched | None:
        plan: UpdatePlan = await self._in_thread(
            plan_update, self.store, served["version"], served["checksum"], requested, allow_reanchor
        )
        if not plan.versions:
            return None
        p = self.prefetched
        if p is not None and p.served == served["version"] and p.plan.versions == plan.versions and p.method == method:
            self.prefetched = None
            p.from_prefetch = True
            return p
        await self._drop_prefetched()
        t0 = time.perf_counter()
        # Download once here (a cache shared with the workers of this host), off the event loop.
        for v in plan.versions:
            await self._in_thread(self.store.local_paths, v)
        await self._prepare(served, plan.target)
        ticket = uuid.uuid4().hex
        await self._rpc(
            "delta_stage_start", store=self.spec.to_dict(), ticket=ticket, versions=plan.versions, method=method
        )
        try:
            summaries = await self._wait_staged(ticket)
            await self._verify(served, plan, summaries)
        except BaseException:
            await self._rpc("delta_release", check=False, ticket=ticket)
            raise
        return Prefetched(served["version"], plan, ticket, method, summaries, (time.perf_counter() - t0) * 1e3)

    async def _wait_staged(self, ticket: str) -> list[dict]:
        deadline = time.monotonic() + RPC_TIMEOUT_S
        while True:
            results = await self._rpc("delta_stage_poll", ticket=ticket)
            if all(r["done"] for r in results):
                return [r["summary"] for r in results]
            if time.monotonic() > deadline:
                raise DeltaError(f"staging did not finish within {RPC_TIMEOUT_S:.0f} s")
            await asyncio.sleep(POLL_S)

    async def _verify(self, served: dict, plan: UpdatePlan, summaries: list[dict]) -> None:
        target = await self._in_thread(lambda: self.store.open(plan.target).header)
        if served["version"] is not None:
            # The served version's sums as the workers hold them (the store may have retired it).
            held = (await self._rpc("delta_served_sums"))[0]
            current = {n: int(v, 16) for n, v in held["sums"].items()}
        else:
            current = await self._live_sums()
        partials = [{n: int(v, 16) for n, v in s["partials"].items()} for s in summaries]
        verify_partials(current, partials, target)

    async def _drop_prefetched(self) -> None:
        if self.prefetched is not None:
            ticket, self.prefetched = self.prefetched.ticket, None
            await self._rpc("delta_release", check=False, ticket=ticket)

    # -- public operations ----------------------------------------------------------------------
    async def stage(self, body: dict) -> dict:
        requested, allow_reanchor, _, method, _ = _parse(body, update=False)
        async with self.lock:
            served = await self._served()
            staged = await self._stage(served, requested, allow_reanchor, method)
            if staged is None:
                return {"version": served["version"], "staged": [], "stage_ms": 0.0}
            self.prefetched = staged
            return {
                "version": served["version"],
                "staged": staged.plan.versions,
                "target": staged.plan.target,
                "stage_ms": round(staged.stage_ms, 3),
                "nnz": staged.plan.nnz,
                "bytes": staged.plan.bytes,
            }

    async def update(self, body: dict) -> dict:
        requested, allow_reanchor, mode, method, fault = _parse(body, update=True)
        async with self.lock:
            served = await self._served()
            previous = served["version"]
            staged = await self._stage(served, requested, allow_reanchor, method)
            if staged is None:
                target = await self._in_thread(self.store.resolve, requested)
                return _result(target, previous, 0.0, 0.0, 0.0, 0, 0, [], mode, method)
            try:
                pause_ms, apply_ms = await self._commit(staged, mode, method, fault)
            finally:
                await self._rpc("delta_release", check=False, ticket=staged.ticket)
            out = _result(
                staged.plan.target,
                previous,
                pause_ms,
                apply_ms,
                staged.stage_ms,
                staged.plan.nnz,
                staged.plan.bytes,
                staged.plan.versions,
                mode,
                method,
            )
            out["reanchored"] = staged.plan.reanchor
            out["prefetched"] = staged.from_prefetch
            out["elements_written"] = sum(s["nnz"] for s in staged.summaries)
            out["staged_bytes"] = sum(s["bytes"] for s in staged.summaries)
            out["timings"] = staged.summaries[0].get("timings", {})
            self.last_update = {**out, "time": time.time()}
            return out

    async def _commit(self, staged: Prefetched, mode: str, method: str, fault: str | None) -> tuple[float, float]:
        t0 = time.perf_counter()
        # Caches are reset after a successful commit only: a failed update leaves them valid.
        await self.engine.pause_generation(mode=mode, clear_cache=False)
        try:
            results = await self._rpc("delta_commit", check=False, ticket=staged.ticket, method=method, fault=fault)
            failed = [(rank, r["error"]) for rank, r in enumerate(results) if "error" in r]
            if failed:
                await self._rpc("delta_rollback", check=False, ticket=staged.ticket)
                rank, payload = failed[0]
                err = WorkerError(payload, rank)
                raise DeltaError(
                    f"update to version {staged.plan.target} failed and was rolled back on every rank: {err}"
                ) from err
            await self._reset_prefix_cache()
            apply_ms = max(r["apply_ms"] for r in results)
        finally:
            await self.engine.resume_generation()
        return (time.perf_counter() - t0) * 1e3, apply_ms

    async def _reset_prefix_cache(self) -> None:
        for _ in range(50):
            if await self.engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
                return
            await asyncio.sleep(0.01)
        log.warning("vllm-delta: the prefix cache could not be reset after an update")

    async def _live_sums(self) -> dict[str, int]:
        parts = await self._rpc("delta_live_sums")
        total: dict[str, int] = {}
        for p in parts:
            for name, s in p["sums"].items():
                total[name] = (total.get(name, 0) + int(s, 16)) & MASK64
        return total

    async def status(self) -> dict:
        async with self.lock:
            served = await self._served()
            version = served["version"]
            if not served["prepared"]:
                target = version if version is not None else await self._in_thread(self.store.resolve, "latest")
                await self._prepare(served, target)
            sums = await self._live_sums()
            fallback = (await self._rpc("delta_status"))[0]["fallback"]
            return {
                "version": version,
                "store": self.spec.uri,
                "checksum": to_hex(combine(sums.items())),
                "version_checksum": served["checksum"],
                "staged": self.prefetched.plan.versions if self.prefetched else [],
                "last_update": self.last_update,
                "tensors_via_vllm_path": fallback,
            }


def _parse(body: Any, *, update: bool):
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    known = {"version", "allow_reanchor", "method"} | ({"mode", "fault"} if update else set())
    unknown = set(body) - known
    if unknown:
        raise BadRequest(f"unknown fields {sorted(unknown)} (known: {sorted(known)})")
    if "version" not in body:
        raise BadRequest('"version" is required: a version number or "latest"')
    version = body["version"]
    if isinstance(version, bool) or not (version == "latest" or (isinstance(version, int) and version >= 0)):
        raise BadRequest(f'"version" must be a non-negative integer or "latest", not {version!r}')
    allow = body.get("allow_reanchor", False)
    if not isinstance(allow, bool):
        raise BadRequest('"allow_reanchor" must be true or false')
    mode = body.get("mode", "keep")
    if mode not in MODES:
        raise BadRequest(f'"mode" must be one of {", ".join(MODES)}, not {mode!r}')
    method = body.get("method", "delta")
    if method not in METHODS:
        raise BadRequest(f'"method" must be one of {", ".join(METHODS)}, not {method!r}')
    fault = body.get("fault")
    if fault is not None and os.environ.get(FAULTS_ENV) != "1":
        raise BadRequest(f'"fault" is a test hook, enabled only with {FAULTS_ENV}=1')
    return version, allow, mode, method, fault


def _result(version, previous, pause_ms, apply_ms, stage_ms, nnz, nbytes, applied, mode, method) -> dict:
    return {
        "version": version,
        "previous_version": previous,
        "pause_ms": round(pause_ms, 3),
        "apply_ms": round(apply_ms, 3),
        "stage_ms": round(stage_ms, 3),
        "nnz": nnz,
        "bytes": nbytes,
        "applied": applied,
        "mode": mode,
        "method": method,
    }
