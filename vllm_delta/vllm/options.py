"""Where the server's store is and how to read it: fixed when the server starts, never sent by clients.

Taken from `--model-loader-extra-config` when the load format is "delta", else from the
environment (`VLLM_DELTA_STORE`, `VLLM_DELTA_STORAGE_OPTIONS` as JSON, `VLLM_DELTA_STORE_TIMEOUT_S`,
`VLLM_DELTA_UPDATE_TIMEOUT_S`, `VLLM_DELTA_CACHE_MAX_BYTES`), so that a server started from a plain
checkpoint can still take store versions.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..store import DeltaStore

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
    uri: str
    storage_options: dict = field(default_factory=dict)
    cache_dir: str = field(default_factory=default_cache_dir)
    timeout_s: float = DEFAULT_STORE_TIMEOUT_S  # one store operation
    update_timeout_s: float = DEFAULT_UPDATE_TIMEOUT_S  # a whole update before its pause (API process)
    cache_max_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StoreSpec:
        return cls(
            d["uri"],
            dict(d.get("storage_options") or {}),
            d.get("cache_dir") or default_cache_dir(),
            float(d.get("timeout_s") or DEFAULT_STORE_TIMEOUT_S),
            float(d.get("update_timeout_s") or DEFAULT_UPDATE_TIMEOUT_S),
            d.get("cache_max_bytes"),
        )

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
        from ..store import DeltaStore

        return DeltaStore(
            self.uri, storage_options=self.storage_options, cache_dir=self.cache_dir, timeout_s=self.timeout_s
        )


@dataclass
class LoaderOptions:
    store: StoreSpec
    version: int | str = "latest"
    validate: bool = True
    fallback: tuple[str, ...] = ()

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
        )


def split_extra_config(extra: dict[str, Any] | None) -> tuple[dict, dict]:
    """(our keys, the rest): vLLM's default loader rejects keys it does not know."""
    extra = dict(extra or {})
    ours = {k: extra.pop(k) for k in LOADER_KEYS if k in extra}
    return ours, extra


def server_store(load_format: str | None, extra: dict | str | None) -> StoreSpec | None:
    """The store a server was started with (see the module docstring); None if it has none."""
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    ours, _ = split_extra_config(extra if isinstance(extra, dict) else {})
    if load_format == "delta" and ours.get("delta_store"):
        return LoaderOptions.from_extra_config(ours).store
    uri = os.environ.get("VLLM_DELTA_STORE")
    if not uri:
        return None
    opts = json.loads(os.environ.get("VLLM_DELTA_STORAGE_OPTIONS") or "{}")
    env = {}
    for key in ("delta_store_timeout_s", "delta_update_timeout_s", "delta_cache_max_bytes"):
        value = os.environ.get("VLLM_" + key.upper())
        if value:
            env[key] = float(value)
    return StoreSpec.from_extra(env, uri, opts, None)
