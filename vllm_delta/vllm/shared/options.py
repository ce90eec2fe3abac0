"""Where the server's store is and how to read it: fixed when the server starts, never sent by clients.

Taken from `--model-loader-extra-config` when the load format is "delta", else from the
environment (`VLLM_DELTA_STORE`, `VLLM_DELTA_STORAGE_OPTIONS` as JSON, `VLLM_DELTA_STORE_TIMEOUT_S`,
`VLLM_DELTA_UPDATE_TIMEOUT_S`, `VLLM_DELTA_CACHE_MAX_BYTES`, `VLLM_DELTA_MIN_VERSION_WAIT_S`,
`VLLM_DELTA_AUDIT_S`, `VLLM_DELTA_WEIGHT_VERSIONS`), so that a server started from a plain
checkpoint can still take store versions. `VLLM_DELTA_WEIGHT_VERSIONS` applies without a store too
(`weight_versions_policy`).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from ...server_api import UPDATE_MODES, UpdateMode

if TYPE_CHECKING:
    from ...store import DeltaStore

LOADER_KEYS = (
    "delta_store",  # URI of the store (path, file://, s3://, hf://buckets/...)
    "delta_version",  # "latest" (default) or a version number
    "delta_storage_options",  # fsspec storage options (dict)
    "delta_cache_dir",  # where remote version files are downloaded
    "delta_cache_max_bytes",  # cap on the download cache of this store (default: no cap beyond pruning)
    "delta_store_timeout_s",  # deadline of one store operation (default 60; a download: plus 1 s per 5 MB)
    "delta_update_timeout_s",  # deadline of a whole update or prefetch before its pause (default 600)
    "delta_validate",  # check the probed layout against vLLM's sparse path on start-up (default true)
    "delta_fallback",  # HF names forced through vLLM's sparse path (diagnostics, tests)
    # Follow mode (follower.py, docs/DEPLOY.md):
    "delta_follow",  # poll the store and apply every newer version on its own (default false)
    "delta_poll_s",  # seconds between polls (default 2)
    "delta_follow_mode",  # how in-flight requests ride through a follower's update: keep | wait | abort | inflight
    "delta_chain_cap",  # at most this many versions per update; longer chains are walked in steps (64)
    "delta_report",  # write this replica's report to the store's ledger (default false)
    "delta_report_s",  # heartbeat period of the report (default 10)
    "delta_replica_id",  # the report's name, replicas/<id>.json (default host-pid-random)
    # The API process (service.py, gating.py):
    "delta_min_version_wait_s",  # how long a request whose min_weight_version is ahead waits (default 5)
    "delta_audit_s",  # recompute the live checksum in the background every so many seconds (default 0: never)
    "delta_weight_versions",  # "requested" (default): spans for requests that set return_weight_versions; "always"
)


def default_cache_dir() -> str:
    # Shared by the API process and the workers of one host: the API process downloads a version
    # once, before staging, and the workers find it there.
    return os.environ.get("VLLM_DELTA_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "vllm-delta-cache")


DEFAULT_STORE_TIMEOUT_S = 60.0
DEFAULT_UPDATE_TIMEOUT_S = 600.0


def _positive(extra: dict[str, Any], key: str, default: float | None, kind: type = float) -> Any:
    value = extra.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{key} must be a positive number, not {value!r}")
    return kind(value)


@dataclass
class StoreSpec:
    """The server's store and how to read it (it crosses to the workers in rpc.py's arguments)."""

    uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = field(default_factory=default_cache_dir)
    timeout_s: float = DEFAULT_STORE_TIMEOUT_S  # one store operation
    update_timeout_s: float = DEFAULT_UPDATE_TIMEOUT_S  # a whole update before its pause (API process)
    cache_max_bytes: int | None = None

    @classmethod
    def from_extra(
        cls, extra: dict[str, Any], uri: str, storage_options: dict | None, cache_dir: str | None
    ) -> StoreSpec:
        """From our loader keys (or the same keys read from the environment by `server_store`)."""
        return cls(
            uri,
            dict(storage_options or {}),
            cache_dir or default_cache_dir(),
            _positive(extra, "delta_store_timeout_s", DEFAULT_STORE_TIMEOUT_S),
            _positive(extra, "delta_update_timeout_s", DEFAULT_UPDATE_TIMEOUT_S),
            _positive(extra, "delta_cache_max_bytes", None, int),
        )

    def open(self) -> DeltaStore:
        from ...store import DeltaStore

        return DeltaStore(
            self.uri, storage_options=self.storage_options, cache_dir=self.cache_dir, timeout_s=self.timeout_s
        )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class FollowOptions:
    """Follow mode and ledger reports, from the `delta_follow*` / `delta_report*` keys. Checked here, at
    server start, so that a typo fails the start-up instead of a follower that silently does nothing."""

    follow: bool = False
    poll_s: float = 2.0
    mode: UpdateMode = "keep"  # how updates ride through: the update_weights modes
    chain_cap: int = 64
    report: bool = False
    report_s: float = 10.0
    replica_id: str | None = None

    def __post_init__(self) -> None:
        for key, flag in (("delta_follow", self.follow), ("delta_report", self.report)):
            if not isinstance(flag, bool):
                raise ValueError(f"{key} must be true or false, not {flag!r}")
        for key, seconds in (("delta_poll_s", self.poll_s), ("delta_report_s", self.report_s)):
            if not _is_number(seconds) or not seconds > 0:
                raise ValueError(f"{key} must be a positive number of seconds, not {seconds!r}")
        if self.mode not in UPDATE_MODES:
            raise ValueError(f"delta_follow_mode must be one of {', '.join(UPDATE_MODES)}, not {self.mode!r}")
        if not isinstance(self.chain_cap, int) or isinstance(self.chain_cap, bool) or self.chain_cap < 1:
            raise ValueError(f"delta_chain_cap must be an integer >= 1, not {self.chain_cap!r}")
        from ...store.ledger import valid_replica_id

        if self.replica_id is not None and not valid_replica_id(self.replica_id):
            raise ValueError(
                f"delta_replica_id must be 1-128 letters, digits, '.', '_' or '-' (not first), not {self.replica_id!r}"
            )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> FollowOptions:
        d = cls()
        return cls(
            follow=extra.get("delta_follow", d.follow),
            poll_s=extra.get("delta_poll_s", d.poll_s),
            mode=extra.get("delta_follow_mode", d.mode),
            chain_cap=extra.get("delta_chain_cap", d.chain_cap),
            report=extra.get("delta_report", d.report),
            report_s=extra.get("delta_report_s", d.report_s),
            replica_id=extra.get("delta_replica_id", d.replica_id),
        )


DEFAULT_MIN_VERSION_WAIT_S = 5.0
MAX_WAIT_S = 3600.0  # a request held longer than an hour is a mistake, not a policy
MAX_AUDIT_S = 7 * 86400.0
SpansPolicy = Literal["requested", "always"]
SPANS_POLICIES: tuple[SpansPolicy, ...] = get_args(SpansPolicy)
SPANS_ENV = "VLLM_DELTA_WEIGHT_VERSIONS"


def weight_versions_policy(options: ServerOptions | None) -> SpansPolicy:
    """Which completion requests get `weight_versions` / `prefill_weight_versions` filled (api_server/spans.py):
    the server's option, or without a store the environment's (a server with the plugin and no store
    still attributes its completions)."""
    if options is not None:
        return options.service.weight_versions
    return ServiceOptions.from_extra_config(
        {"delta_weight_versions": os.environ.get(SPANS_ENV) or "requested"}
    ).weight_versions


@dataclass(frozen=True)
class ServiceOptions:
    """The API process's own knobs, checked at server start: how long a generation request whose
    `min_weight_version` is ahead of the served version waits for it (0: answer 409 at once), and how
    often the live checksum is recomputed in the background (0: never; `?verify=true` always can), and
    which completion requests get their spans filled: those that set `return_weight_versions` (vLLM
    0.33's flag), or "always" (for clients that cannot send it)."""

    min_version_wait_s: float = DEFAULT_MIN_VERSION_WAIT_S
    audit_s: float = 0.0
    weight_versions: SpansPolicy = "requested"

    def __post_init__(self) -> None:
        for key, seconds, most in (
            ("delta_min_version_wait_s", self.min_version_wait_s, MAX_WAIT_S),
            ("delta_audit_s", self.audit_s, MAX_AUDIT_S),
        ):
            if not _is_number(seconds) or not 0 <= seconds <= most:
                raise ValueError(f"{key} must be a number of seconds from 0 to {most:.0f}, not {seconds!r}")
        if self.weight_versions not in SPANS_POLICIES:
            raise ValueError(
                f"delta_weight_versions must be one of {', '.join(SPANS_POLICIES)}, not {self.weight_versions!r}"
            )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ServiceOptions:
        d = cls()
        return cls(
            min_version_wait_s=extra.get("delta_min_version_wait_s", d.min_version_wait_s),
            audit_s=extra.get("delta_audit_s", d.audit_s),
            weight_versions=extra.get("delta_weight_versions", d.weight_versions),
        )


@dataclass(frozen=True)
class LoaderOptions:
    store: StoreSpec
    version: int | str = "latest"
    validate: bool = True
    fallback: tuple[str, ...] = ()
    follow: FollowOptions = field(default_factory=FollowOptions)
    service: ServiceOptions = field(default_factory=ServiceOptions)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> LoaderOptions:
        if not extra.get("delta_store"):
            raise ValueError("--load-format delta needs --model-loader-extra-config '{\"delta_store\": URI}'")
        version = extra.get("delta_version", "latest")
        if not (version == "latest" or (isinstance(version, int) and version >= 0) or str(version).isdigit()):
            raise ValueError(f'delta_version must be "latest" or a version number, not {version!r}')
        spec = StoreSpec.from_extra(
            extra, str(extra["delta_store"]), extra.get("delta_storage_options"), extra.get("delta_cache_dir")
        )
        fallback = extra.get("delta_fallback") or ()
        return cls(
            spec,
            int(version) if str(version).isdigit() else "latest",
            bool(extra.get("delta_validate", True)),
            tuple(fallback),
            FollowOptions.from_extra_config(extra),
            ServiceOptions.from_extra_config(extra),
        )


def split_extra_config(extra: dict[str, Any] | None) -> tuple[dict, dict]:
    """(our keys, the rest): vLLM's default loader rejects keys it does not know."""
    extra = dict(extra or {})
    ours = {k: extra.pop(k) for k in LOADER_KEYS if k in extra}
    return ours, extra


@dataclass(frozen=True)
class ServerOptions:
    """What the API process needs: the store, whether (and how) to follow it, its own knobs."""

    store: StoreSpec
    follow: FollowOptions = field(default_factory=FollowOptions)
    service: ServiceOptions = field(default_factory=ServiceOptions)


def server_options(load_format: str | None, extra: dict | str | None) -> ServerOptions | None:
    """The store a server was started with (see the module docstring) and its follow options; None if it
    has no store. Follow mode is set in --model-loader-extra-config only (load format "delta")."""
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    ours, _ = split_extra_config(extra if isinstance(extra, dict) else {})
    if load_format == "delta" and ours.get("delta_store"):
        opts = LoaderOptions.from_extra_config(ours)
        return ServerOptions(opts.store, opts.follow, opts.service)
    uri = os.environ.get("VLLM_DELTA_STORE")
    if not uri:
        return None
    opts = json.loads(os.environ.get("VLLM_DELTA_STORAGE_OPTIONS") or "{}")
    env: dict[str, Any] = {}
    for key in (
        "delta_store_timeout_s",
        "delta_update_timeout_s",
        "delta_cache_max_bytes",
        "delta_min_version_wait_s",
        "delta_audit_s",
    ):
        value = os.environ.get("VLLM_" + key.upper())
        if value:
            env[key] = float(value)
    if os.environ.get(SPANS_ENV):
        env["delta_weight_versions"] = os.environ[SPANS_ENV]
    return ServerOptions(StoreSpec.from_extra(env, uri, opts, None), service=ServiceOptions.from_extra_config(env))


def server_store(load_format: str | None, extra: dict | str | None) -> StoreSpec | None:
    """The store a server was started with; None if it has none."""
    options = server_options(load_format, extra)
    return None if options is None else options.store
