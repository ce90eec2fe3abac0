"""Publish a trainer's policy to a store and make its rollout servers live on it, before it generates.

The trainer side of "sync, then generate" for trainers that sample from vllm-delta servers (TRL's
GRPO trainers: `integrations/trl.py`). TRL-free and vLLM-free: the servers are reached over HTTP
(`/v1/delta/*`), the store through the Publisher.

    sync = RolloutSync(RolloutSyncOptions("s3://bucket/run1", mode="push"), servers=["http://rollout-0:8000"])
    record = sync.sync(model, version=step)    # returns once every server serves `step`, checksum-verified

One `sync`:

1. publishes the version (every rank of a sharded trainer calls `sync` at the same step and
   publishes its own part: `Publisher(group=...)`), and waits until it is visible in the store;
2. makes every server live on it (rank 0): `mode="push"` asks each server to apply it
   (`POST /v1/delta/update_weights`), `mode="follow"` waits until each server's follower has applied
   it on its own (`GET /v1/delta/status`, polled);
3. checks that each server's live checksum equals the published checksum (the trainer's bf16
   weights), and hands every rank the same outcome.

Every wait is bounded (`live_timeout_s`, `publish_timeout_s`); every failure raises a
`RolloutSyncError` naming the server and the version, and the servers keep what they served: a
version that fails its checks is never applied. A failed publish leaves nothing visible; the next
`sync` starts a new chain (an anchor) on a fresh Publisher.

The first sync of a run may find its version already in the store (the servers were started from
it): it is then not published again but checked, bit for bit through the checksum, against the
trainer's weights; a store that holds later versions than the trainer's step is refused (a store,
or prefix, per run).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..checksums import combine, tensor_sum, to_hex
from ..errors import DeltaError, StalenessTimeoutError
from ..server_api import FollowStatus, from_wire
from ..store import DeltaStore
from ..trainer.detect import named_tensors
from ..trainer.options import PublisherOptions
from ..trainer.publisher import Publisher, PublishInfo
from ..trainer.shard import ShardedTensor
from ..trainer.staleness import StalenessPolicy

log = logging.getLogger(__name__)

SyncMode = Literal["push", "follow"]
SYNC_MODES: tuple[SyncMode, ...] = ("push", "follow")
UpdateMode = Literal["keep", "wait", "abort", "inflight"]


class RolloutSyncError(DeltaError):
    """A sync did not make the servers live on the trainer's version; nothing was generated from it."""


class ServerUnreachableError(RolloutSyncError):
    """A server did not answer (connection refused, timeout) within the sync's bounded wait."""


class ServerBehindError(RolloutSyncError):
    """A following server did not reach the version within `live_timeout_s`."""


class VersionRefusedError(RolloutSyncError):
    """A server refused the version (not a successor, failed integrity checks, unknown): it keeps
    serving the previous one."""


class LiveMismatchError(RolloutSyncError):
    """A server serves the version, but its live weights' checksum is not the published one, or it
    serves a version this trainer did not publish."""


class PublishFailedError(RolloutSyncError):
    """The version could not be published (nothing of it is visible in the store)."""


@dataclass(frozen=True)
class RolloutSyncOptions:
    """How a trainer syncs its rollout servers through the store.

    `store`/`storage_options`: where versions go (file path, `s3://`, `hf://buckets/...`).
    `mode`: "push" (the trainer asks each server to apply each version) or "follow" (the servers
    follow the store, `"delta_follow": true`; the trainer only waits for them). `update_mode`: how
    running requests ride through a pushed update. `servers`: servers to keep live beside the one
    the trainer generates from. `anchor_every`, `codec`: the Publisher's. `max_staleness`,
    `min_replicas`, `staleness_timeout_s`: the Publisher's ledger gate (asynchronous trainers).
    `wait_live`: in mode "follow", False publishes and returns without waiting for the servers
    (asynchronous trainers whose rollouts carry the version that produced them). `signing_key`: the
    Publisher's (a private key file from `vllm-delta keygen`): every version signed, for servers started
    with `delta_trusted_keys` (docs/SECURITY.md)."""

    store: str
    storage_options: dict[str, Any] | None = None
    mode: SyncMode = "push"
    update_mode: UpdateMode = "keep"
    servers: tuple[str, ...] = ()
    api_key: str | None = None
    anchor_every: int = 20
    codec: str = "chunked"
    live_timeout_s: float = 300.0
    publish_timeout_s: float = 600.0
    request_timeout_s: float = 30.0
    poll_s: float = 0.25
    max_staleness: int | None = None
    min_replicas: int = 1
    staleness_timeout_s: float = 600.0
    wait_live: bool = True
    signing_key: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ValueError(f"mode must be one of {SYNC_MODES}, not {self.mode!r}")
        for name in ("live_timeout_s", "publish_timeout_s", "request_timeout_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True)
class ServedState:
    """What one server says it serves (the fields of GET /v1/delta/status a sync reads)."""

    version: int | None
    checksum: str | None  # live, summed over the server's ranks
    busy: bool  # an update or prefetch runs: the answer is the state from before it
    follow: FollowStatus | None

    @classmethod
    def from_status(cls, doc: dict[str, Any]) -> ServedState:
        follow = doc.get("follow")
        return cls(
            version=doc.get("version"),
            checksum=doc.get("checksum"),
            busy=doc.get("update_in_progress") is not None,
            follow=from_wire(FollowStatus, follow) if follow is not None else None,
        )


@dataclass(frozen=True)
class ServerLive:
    """A server, checked live on a version after a sync."""

    url: str
    version: int
    checksum: str
    waited_s: float


@dataclass
class SyncRecord:
    """One sync: the version, how it was published, and (rank 0) where each server stands."""

    version: int
    checksum: str  # of the trainer's bf16 weights (what each server must report)
    published: bool  # False: the version was already in the store (the run's starting point)
    kind: str | None = None  # "anchor" | "delta" when published
    nnz: int | None = None
    bytes: int | None = None
    live: list[ServerLive] = field(default_factory=list)
    sync_s: float = 0.0


class RolloutSync:
    """Publishes versions and makes servers live on them (module docstring). `servers`: the URLs to
    keep live (besides `options.servers`). `group`: the process group of a sharded trainer (every
    rank constructs a RolloutSync and calls `sync` at the same steps); None for one process."""

    def __init__(self, options: RolloutSyncOptions, *, servers: list[str] | None = None, group: Any = None):
        self.options = options
        self.servers = list(dict.fromkeys(s.rstrip("/") for s in [*(servers or []), *options.servers]))
        self.group = group
        self.rank = _group_rank(group)
        self.store = DeltaStore(options.store, storage_options=options.storage_options)
        self.publisher: Publisher | None = None
        self.records: list[SyncRecord] = []
        self._session: Any = None

    # -- the sync ---------------------------------------------------------------------------------
    def sync(self, source: torch.nn.Module | dict[str, torch.Tensor], version: int) -> SyncRecord:
        """Publish `source` as `version` and make every server live on it (module docstring). Every
        rank of a sharded trainer calls it at the same step and gets the same record or error."""
        t0 = time.monotonic()
        record = self._publish(source, version)
        outcome: _Outcome | None = None
        failure: RolloutSyncError | None = None
        if self.rank == 0 and (self.options.wait_live or self.options.mode == "push"):
            try:
                record.live = [self._make_live(url, record) for url in self.servers]
            except RolloutSyncError as exc:
                failure = exc
                outcome = _Outcome(
                    f"{type(exc).__name__}: {exc}", isinstance(exc, (VersionRefusedError, LiveMismatchError))
                )
        shared = _broadcast(outcome, self.group)
        if shared is not None:
            if shared.breaks_chain:  # servers refused the version: the next one starts a new chain (an anchor)
                self._drop_publisher()
            if failure is not None:
                raise failure
            raise RolloutSyncError(f"rank 0: {shared.message}", version=version)
        record.sync_s = time.monotonic() - t0
        self.records.append(record)
        return record

    def close(self) -> None:
        """Waits for uploads in flight; an upload error is logged (the sync that made it raised)."""
        if self.publisher is not None:
            try:
                self.publisher.close()
            except Exception as exc:  # noqa: BLE001 - already raised by the sync that published it
                log.warning("vllm-delta: closing the publisher: %s", exc)
            self.publisher = None

    # -- publishing -------------------------------------------------------------------------------
    def _publish(self, source: torch.nn.Module | dict[str, torch.Tensor], version: int) -> SyncRecord:
        last = self.records[-1] if self.records else None
        if last is not None and last.version == version:  # synced already: a version is published once
            return SyncRecord(version, last.checksum, False)
        if self.publisher is None:
            start = self._starting_point(source, version)
            if start is not None:
                return start
            self.publisher = self._new_publisher()
        try:
            info: PublishInfo = self.publisher.publish(source, version=version)
            rec = info.uploaded.result(timeout=self.options.publish_timeout_s)
        except StalenessTimeoutError:
            raise  # nothing was published: the Publisher stays usable
        except concurrent.futures.TimeoutError as exc:
            self.publisher = None  # its upload hangs: abandoned (closing it would wait for the upload)
            raise PublishFailedError(
                f"the version was not visible in {self.store.uri} after {self.options.publish_timeout_s:.0f} s",
                version=version,
            ) from exc
        except Exception as exc:  # noqa: BLE001 - every rank sees the same outcome (sharded Publisher)
            self._drop_publisher()
            raise PublishFailedError(f"publishing to {self.store.uri} failed: {exc}", version=version) from exc
        return SyncRecord(version, info.checksum, True, kind=info.kind, nnz=info.nnz, bytes=rec.bytes)

    def _starting_point(self, source: torch.nn.Module | dict[str, torch.Tensor], version: int) -> SyncRecord | None:
        """The first sync: None to publish `version`; a record when the store already holds it with
        the trainer's weights (the servers started from it). Refuses a store that is ahead."""
        latest = self.store.latest()
        if latest is None or latest < version:
            return None
        if latest > version:
            raise RolloutSyncError(
                f"the store {self.store.uri} already holds versions up to {latest}, after this trainer's step "
                f"{version}: use a fresh store (or prefix) per run, or resume training from step {latest}",
                version=version,
            )
        want = image_checksum(source, self.group)
        have = self.store.record(version).checksum
        if have != want:
            raise LiveMismatchError(
                f"the store's version {version} (checksum {have}) is not the trainer's weights at step {version} "
                f"(checksum {want}): it was published by another run; use a fresh store (or prefix) per run",
                version=version,
            )
        return SyncRecord(version, want, False)

    def _new_publisher(self) -> Publisher:
        o = self.options
        return Publisher(
            self.store,
            anchor_every=o.anchor_every,
            codec=o.codec,
            group=self.group,
            signing_key=o.signing_key,
            options=PublisherOptions(
                staleness=None
                if o.max_staleness is None
                else StalenessPolicy(o.max_staleness, o.min_replicas, timeout_s=o.staleness_timeout_s)
            ),
        )

    def _drop_publisher(self) -> None:
        """After a failed publish: the chain is broken, so the next sync starts over on a fresh
        Publisher (its first version is an anchor). The pending error was raised already."""
        pub, self.publisher = self.publisher, None
        if pub is not None:
            try:
                pub.close()
            except Exception:  # noqa: BLE001 - the error this sync raises
                pass

    # -- making servers live ------------------------------------------------------------------------
    def _make_live(self, url: str, record: SyncRecord) -> ServerLive:
        t0 = time.monotonic()
        if self.options.mode == "push":
            self._push(url, record.version)
        state = self._wait_served(url, record.version, t0)
        if state.checksum != record.checksum:
            raise LiveMismatchError(
                f"{url} serves version {record.version} but its live weights' checksum is {state.checksum}, not "
                f"{record.checksum} (the trainer's bf16 weights)",
                version=record.version,
            )
        return ServerLive(url, record.version, state.checksum, time.monotonic() - t0)

    def _push(self, url: str, version: int) -> None:
        body = {"version": version, "mode": self.options.update_mode}
        try:
            r = self._http().post(
                f"{url}/v1/delta/update_weights", json=body, timeout=self.options.live_timeout_s, headers=self._auth()
            )
        except OSError as exc:
            raise ServerUnreachableError(f"{url} did not answer the update: {exc}", version=version) from exc
        if r.status_code == 200:
            return
        text = r.text[:500]
        if 400 <= r.status_code < 500:
            raise VersionRefusedError(f"{url} refused the update (HTTP {r.status_code}): {text}", version=version)
        raise RolloutSyncError(f"{url} failed the update (HTTP {r.status_code}): {text}", version=version)

    def _wait_served(self, url: str, version: int, t0: float) -> ServedState:
        """Poll until `url` serves `version` with a known live checksum; bounded by live_timeout_s."""
        deadline = t0 + self.options.live_timeout_s
        last: ServedState | None = None
        last_error: str | None = None
        while True:
            try:
                last = self._status(url)
                last_error = None
            except OSError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if last is not None and last_error is None:
                if not last.busy and last.version == version and last.checksum is not None:
                    return last
                self._check_progress(url, version, last)
            if time.monotonic() >= deadline:
                break
            time.sleep(self.options.poll_s)
        waited = time.monotonic() - t0
        if last_error is not None and last is None:
            raise ServerUnreachableError(f"{url} did not answer for {waited:.0f} s: {last_error}", version=version)
        if last_error is not None:
            raise ServerUnreachableError(
                f"{url} stopped answering while the trainer waited for it ({waited:.0f} s): {last_error}",
                version=version,
            )
        assert last is not None
        detail = ""
        if last.follow is not None:
            f = last.follow
            detail = f"; its follower: newest seen {f.newest_seen}, last error {f.last_error}"
        raise ServerBehindError(
            f"{url} still serves version {last.version} after {waited:.0f} s (live_timeout_s), waiting for "
            f"{version}{detail}",
            version=version,
        )

    def _check_progress(self, url: str, version: int, state: ServedState) -> None:
        """Fail fast where waiting cannot help: a follower that skipped the version, a server that
        does not follow (in mode follow), a server ahead of the trainer."""
        if state.version is not None and state.version > version:
            raise LiveMismatchError(
                f"{url} serves version {state.version}, after the trainer's {version}: another publisher writes "
                "to this store, or the server follows another one",
                version=version,
            )
        if self.options.mode != "follow" or state.busy:
            return
        if state.follow is None or not state.follow.following:
            raise RolloutSyncError(
                f'{url} does not follow the store: start it with "delta_follow": true, or sync with mode "push"',
                version=version,
            )
        why = state.follow.skipped.get(version)
        if why is not None:
            raise VersionRefusedError(f"{url} refused the version (its follower skipped it): {why}", version=version)

    def _status(self, url: str) -> ServedState:
        r = self._http().get(f"{url}/v1/delta/status", timeout=self.options.request_timeout_s, headers=self._auth())
        if r.status_code != 200:
            raise OSError(f"GET /v1/delta/status answered HTTP {r.status_code}: {r.text[:300]}")
        return ServedState.from_status(r.json())

    def _http(self) -> Any:
        if self._session is None:
            import requests

            self._session = requests.Session()
        return self._session

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}


# -- helpers -----------------------------------------------------------------------------------------
def image_checksum(source: torch.nn.Module | dict[str, torch.Tensor], group: Any = None) -> str:
    """The checksum of `source`'s bf16 image under checkpoint names (what a server holding it
    reports). DTensors are gathered one at a time (a collective: every rank of `group` calls it)."""
    parts: list[tuple[str, int]] = []
    for name, t in named_tensors(source):
        if isinstance(t, ShardedTensor):
            raise RolloutSyncError(f"tensor {name!r} is hand-sharded: its checksum needs every rank's rows")
        assert isinstance(t, torch.Tensor)
        full: Any = t.full_tensor() if hasattr(t, "full_tensor") else t
        parts.append((name, tensor_sum(full.detach().to(torch.bfloat16))))
    return to_hex(combine(parts))


def _group_rank(group: Any) -> int:
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)


@dataclass(frozen=True)
class _Outcome:
    """A failed make-live step, as rank 0 tells the other ranks."""

    message: str
    breaks_chain: bool  # the servers refused the version: its successors cannot be applied either


def _broadcast(value: _Outcome | None, group: Any) -> _Outcome | None:
    """Rank 0's value on every rank of `group` (the value itself without a group)."""
    if group is None:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[0], group=group)
    return box[0]


def default_group() -> Any:
    """The world group of an initialized torch.distributed job of several ranks, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


__all__ = [
    "LiveMismatchError",
    "PublishFailedError",
    "RolloutSync",
    "RolloutSyncError",
    "RolloutSyncOptions",
    "SYNC_MODES",
    "ServedState",
    "ServerBehindError",
    "ServerLive",
    "ServerUnreachableError",
    "SyncMode",
    "SyncRecord",
    "VersionRefusedError",
    "image_checksum",
]
