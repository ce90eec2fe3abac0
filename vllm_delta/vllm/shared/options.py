"""The server's options: every `delta_*` key of `--model-loader-extra-config`, declared once.

Each key is the field of the dataclass it fills (option_fields.py: key, default, one-line doc, check);
the parser, the checks, LOADER_KEYS and the docs' table (docs/VLLM.md, "Keys of
--model-loader-extra-config"; `python -m vllm_delta.vllm.shared.options` prints it, and a test compares
the two) come from those declarations. A bad value is a ValueError naming the key, at server start.

    StoreSpec       the store and how to read it (crosses to the workers in rpc.py's arguments)
    LoaderOptions   everything --load-format delta reads: the store, the start version, the probe,
                    follow mode (FollowOptions), the API process's knobs (ServiceOptions)

Where the keys come from: `--model-loader-extra-config` when the load format is "delta"; else, so that
a server started from a plain checkpoint can still take store versions, the environment: the options
declared with `env` as `VLLM_<KEY>` (VLLM_DELTA_STORE, VLLM_DELTA_STORAGE_OPTIONS as JSON, ...).
Follow mode is set in the extra config only. `VLLM_DELTA_WEIGHT_VERSIONS` applies without a store too
(`weight_versions_policy`).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from ...server_api import UpdateMode
from .option_fields import (
    at_least_one,
    boolean,
    check_fields,
    declared,
    from_extra,
    group,
    key_files,
    key_files_env,
    load_trusted_keys,
    mapping,
    names,
    one_of,
    option,
    option_factory,
    options_table,
    positive,
    replica_name,
    required_option,
    seconds_up_to,
    start_version,
    text,
    update_mode,
)

if TYPE_CHECKING:
    from ...signatures import TrustedKeys
    from ...store import DeltaStore


# -- the options ----------------------------------------------------------------------------------------
def default_cache_dir() -> str:
    # Shared by the API process and the workers of one host: the API process downloads a version
    # once, before staging, and the workers find it there.
    return os.environ.get("VLLM_DELTA_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "vllm-delta-cache")


TRUSTED_KEYS = "delta_trusted_keys"


@dataclass
class StoreSpec:
    """The server's store and how to read it (it crosses to the workers in rpc.py's arguments)."""

    uri: str = required_option(
        "delta_store", "store URI: path, `file://`, `s3://`, `hf://buckets/...`", text(), env=str
    )
    storage_options: dict[str, Any] = option_factory(
        "delta_storage_options", dict, "fsspec storage options (S3 endpoint, credentials, ...)", mapping, env=json.loads
    )
    cache_dir: str = option_factory(
        "delta_cache_dir",
        default_cache_dir,
        "where remote version files are downloaded; shared by the API process and the workers of a host",
        text(),
        default_doc="`$VLLM_DELTA_CACHE_DIR` or `<tmp>/vllm-delta-cache`",
    )
    timeout_s: float = option(
        "delta_store_timeout_s",
        60.0,
        "deadline of one store operation; a data file download or upload gets 60 s + 1 s per 5 MB",
        positive(),
        env=float,
    )
    update_timeout_s: float = option(
        "delta_update_timeout_s",
        600.0,
        "deadline of everything an update or prefetch does before its pause",
        positive(),
        env=float,
    )
    cache_max_bytes: int | None = option(
        "delta_cache_max_bytes",
        None,
        "cap on the download cache of this store (below)",
        positive(int, optional=True),
        default_doc="none",
        env=float,
    )
    trusted_keys: tuple[str, ...] = option(
        TRUSTED_KEYS,
        (),
        "public-key files (`vllm-delta keygen` writes PATH.pub): the server takes only versions signed by one "
        "of them, of the run it serves; a push of any other answers 403 `SignatureError`, a follower skips "
        "it, a start-up at one refuses to start (docs/SECURITY.md). Empty: signatures are not checked",
        key_files,
        default_doc="`[]`",
        env=key_files_env,
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def open(self) -> DeltaStore:
        from ...store import DeltaStore

        return DeltaStore(
            self.uri,
            storage_options=self.storage_options,
            cache_dir=self.cache_dir,
            timeout_s=self.timeout_s,
            check_digests=bool(self.trusted_keys),  # a signature binds the digests: check local files too
        )

    def trust(self) -> TrustedKeys | None:
        """The trusted keys, loaded (once per process); None: signatures are not checked. KeyFileError
        naming a file that is not an Ed25519 public key."""
        return load_trusted_keys(self.trusted_keys) if self.trusted_keys else None


@dataclass(frozen=True)
class FollowOptions:
    """Follow mode and ledger reports (follower.py, docs/DEPLOY.md). Checked at server start, so that a
    typo fails the start-up instead of a follower that silently does nothing."""

    follow: bool = option(
        "delta_follow", False, "poll the store and apply every newer version, with no call from anyone", boolean
    )
    poll_s: float = option(
        "delta_poll_s",
        2.0,
        'seconds between polls; a poll is three small reads whatever the store\'s size (docs/FORMAT.md, "Reading")',
        positive(),
    )
    mode: UpdateMode = option(
        "delta_follow_mode",
        "keep",
        "how in-flight requests ride through a follower's update (the `mode` of `update_weights`): `keep`, "
        '`wait`, `abort`, or `inflight` (no pause: running requests continue on the new weights; "In-flight '
        'updates" below; an engine that refuses it makes the follower fall back to `keep`, logged once)',
        update_mode,
    )
    chain_cap: int = option(
        "delta_chain_cap", 64, "at most this many versions per update; a longer chain is walked in steps", at_least_one
    )
    report: bool = option(
        "delta_report",
        False,
        "write this replica's report to the store's ledger (needs write access to `replicas/`)",
        boolean,
    )
    report_s: float = option("delta_report_s", 10.0, "heartbeat period of the report", positive())
    replica_id: str | None = option(
        "delta_replica_id",
        None,
        "the report's name (`replicas/<id>.json`)",
        replica_name,
        default_doc="host-pid-random",
    )
    leave_marked: bool = option(
        "delta_leave_marked",
        True,
        "a follower serving a version marked bad (or built on one) moves back to the newest unmarked version on "
        "its chain by itself, at its next poll (a backward update); `false`: it keeps serving it until a newer "
        "usable version appears",
        boolean,
    )

    def __post_init__(self) -> None:
        check_fields(self)


MAX_WAIT_S = 3600.0  # a request held longer than an hour is a mistake, not a policy
MAX_AUDIT_S = 7 * 86400.0
SpansPolicy = Literal["requested", "always"]
SPANS_POLICIES: tuple[SpansPolicy, ...] = get_args(SpansPolicy)
SPANS_KEY = "delta_weight_versions"


@dataclass(frozen=True)
class ServiceOptions:
    """The API process's own knobs (service.py, gating.py, spans.py)."""

    min_version_wait_s: float = option(
        "delta_min_version_wait_s",
        5.0,
        "how long a generation request whose `min_weight_version` is ahead of the served version waits for it "
        '(0: answer 409 at once; at most 3600); "Version bounds" below',
        seconds_up_to(MAX_WAIT_S),
        env=float,
    )
    audit_s: float = option(
        "delta_audit_s",
        0.0,
        "recompute the live checksum from every rank's parameters every so many seconds, off the hot path "
        '("Status", below)',
        seconds_up_to(MAX_AUDIT_S),
        default_doc="`0` (off)",
        env=float,
    )
    weight_versions: SpansPolicy = option(
        SPANS_KEY,
        "requested",
        "which completion and chat requests get `weight_versions` and `prefill_weight_versions` filled: "
        "`requested` (those that set `return_weight_versions`, vLLM 0.33's flag) or `always` (for clients "
        'that cannot send it); "Attribution" below',
        one_of(SPANS_POLICIES),
        env=str,
    )

    def __post_init__(self) -> None:
        check_fields(self)


def weight_versions_policy(options: ServerOptions | None) -> SpansPolicy:
    """Which completion requests get `weight_versions` / `prefill_weight_versions` filled (api_server/spans.py):
    the server's option, or without a store the environment's (a server with the plugin and no store
    still attributes its completions). A bad value is a ValueError naming the key."""
    if options is not None:
        return options.service.weight_versions
    opt = next(o for o in declared(ServiceOptions) if o.key == SPANS_KEY)
    raw = os.environ.get(opt.env_name)
    policy: SpansPolicy = from_extra(ServiceOptions, {opt.key: raw} if raw else {}).weight_versions
    return policy


@dataclass(frozen=True)
class LoaderOptions:
    """Everything `--load-format delta` reads from `--model-loader-extra-config`."""

    store: StoreSpec = group(StoreSpec, required=True)
    version: int | str = option("delta_version", "latest", "version to start at", start_version)
    validate: bool = option(
        "delta_validate", True, "check the probed layout against vLLM's sparse path at start-up", boolean
    )
    fallback: tuple[str, ...] = option(
        "delta_fallback",
        (),
        "HF tensor names forced through vLLM's sparse path (diagnostics, tests)",
        names,
        default_doc="`[]`",
    )
    follow: FollowOptions = group(FollowOptions)
    service: ServiceOptions = group(ServiceOptions)

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> LoaderOptions:
        return from_extra(cls, extra)


LOADER_KEYS = tuple(opt.key for opt in declared(LoaderOptions))
STORE_KEY = declared(StoreSpec)[0].key  # the one key a store needs
NO_STORE = (
    f"vllm-delta has no store: start the server with --load-format delta and --model-loader-extra-config "
    f"'{{\"{STORE_KEY}\": URI}}', or set {declared(StoreSpec)[0].env_name}"
)


def split_extra_config(extra: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
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


def server_options(load_format: str | None, extra: dict[str, Any] | str | None) -> ServerOptions | None:
    """The store a server was started with (see the module docstring) and its follow options; None if it
    has no store."""
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    ours, _ = split_extra_config(extra if isinstance(extra, dict) else {})
    if load_format != "delta" or not ours.get(STORE_KEY):
        ours = from_environment()  # no follow options there
        if not ours.get(STORE_KEY):
            return None
    opts = LoaderOptions.from_extra_config(ours)
    return ServerOptions(opts.store, opts.follow, opts.service)


def server_store(load_format: str | None, extra: dict[str, Any] | str | None) -> StoreSpec | None:
    """The store a server was started with; None if it has none."""
    options = server_options(load_format, extra)
    return None if options is None else options.store


def trusted_keys_from_environment() -> tuple[str, ...]:
    """`VLLM_DELTA_TRUSTED_KEYS`, checked (for a store named at run time, not at start-up)."""
    keys: tuple[str, ...] = StoreSpec("-", trusted_keys=from_environment().get(TRUSTED_KEYS, ())).trusted_keys
    return keys


def from_environment() -> dict[str, Any]:
    """The options set in the environment (VLLM_<KEY>), parsed, as extra-config keys."""
    return {
        opt.key: opt.env(os.environ[opt.env_name])
        for opt in declared(LoaderOptions)
        if opt.env is not None and os.environ.get(opt.env_name)
    }


if __name__ == "__main__":
    print(options_table(LoaderOptions), end="")
