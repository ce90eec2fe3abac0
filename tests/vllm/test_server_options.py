"""The server's options (vllm_delta/vllm/shared/options.py): each `delta_*` key declared once, and the
parser, the checks, the environment path and the docs' table all taken from the declarations."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from vllm_delta.vllm.shared.option_fields import declared
from vllm_delta.vllm.shared.options import (
    LOADER_KEYS,
    FollowOptions,
    LoaderOptions,
    ServiceOptions,
    StoreSpec,
    options_table,
    server_options,
    weight_versions_policy,
)

ROOT = Path(__file__).resolve().parent.parent.parent
BEGIN, END = "<!-- options table: generated, do not edit by hand -->\n", "<!-- end of options table -->\n"


def test_the_docs_table_is_the_declarations():
    text = (ROOT / "docs" / "VLLM.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    documented = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    want = options_table(LoaderOptions)
    assert documented == want, "regenerate with: python -m vllm_delta.vllm.shared.options\n" + want
    for key in LOADER_KEYS:  # every key has its row
        assert f"| `{key}` |" in documented


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_each_key_is_spelled_once_in_the_server_package():
    """Outside its declaration, no code of the plugin (vllm_delta/vllm/) spells a key: docstrings aside,
    every string that names one counts (a lookup, a message)."""
    spelled: dict[str, list[str]] = {key: [] for key in LOADER_KEYS}
    for path in sorted((ROOT / "vllm_delta" / "vllm").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for key in LOADER_KEYS:
                    if node.value == key or f'"{key}"' in node.value:
                        spelled[key].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    options = "vllm_delta/vllm/shared/options.py"
    assert {k: len(v) for k, v in spelled.items() if len(v) != 1 or not v[0].startswith(options)} == {}, spelled
    assert len(LOADER_KEYS) == len(set(LOADER_KEYS)) == 21


def test_defaults_and_a_full_config():
    assert FollowOptions() == FollowOptions(False, 2.0, "keep", 64, False, 10.0, None, True)
    assert ServiceOptions() == ServiceOptions(5.0, 0.0, "requested")
    spec = StoreSpec("/s")
    assert (spec.storage_options, spec.timeout_s, spec.update_timeout_s, spec.cache_max_bytes, spec.trusted_keys) == (
        {},
        60.0,
        600.0,
        None,
        (),
    )
    assert spec.trust() is None and spec.open().check_digests is False
    opts = LoaderOptions.from_extra_config(
        {
            "delta_store": "s3://b/run",
            "delta_version": "7",
            "delta_storage_options": {"anon": True},
            "delta_cache_dir": "/c",
            "delta_cache_max_bytes": 1e9,
            "delta_store_timeout_s": 5,
            "delta_update_timeout_s": 30,
            "delta_validate": False,
            "delta_fallback": ["w"],
            "delta_min_version_wait_s": 0,
            "delta_audit_s": 600,
            "delta_weight_versions": "always",
            "delta_poll_s": None,  # null: the default
        }
    )
    assert opts.store == StoreSpec("s3://b/run", {"anon": True}, "/c", 5.0, 30.0, 1_000_000_000)
    assert isinstance(opts.store.cache_max_bytes, int)
    assert (opts.version, opts.validate, opts.fallback) == (7, False, ("w",))
    assert opts.service == ServiceOptions(0.0, 600.0, "always") and opts.follow == FollowOptions()


BAD = {
    "delta_store": "",
    "delta_version": -1,
    "delta_storage_options": "anon=true",
    "delta_cache_dir": 3,
    "delta_cache_max_bytes": 0,
    "delta_store_timeout_s": "60",
    "delta_update_timeout_s": -1,
    "delta_validate": "false",
    "delta_fallback": "w",
    "delta_follow": "yes",
    "delta_poll_s": 0,
    "delta_follow_mode": "later",
    "delta_chain_cap": 0,
    "delta_report": 1,
    "delta_report_s": float("nan"),
    "delta_replica_id": "../etc",
    "delta_leave_marked": "no",
    "delta_min_version_wait_s": 3601,
    "delta_audit_s": True,
    "delta_weight_versions": "sometimes",
    "delta_trusted_keys": "trainer.key.pub",  # a list of paths, not one
}


def test_every_bad_value_is_an_error_naming_its_key():
    assert set(BAD) == set(LOADER_KEYS)
    for key, value in BAD.items():
        with pytest.raises(ValueError, match=key):
            LoaderOptions.from_extra_config({"delta_store": "/s", key: value})
    with pytest.raises(ValueError, match="delta_store"):
        LoaderOptions.from_extra_config({})
    # The same checks when a dataclass is built directly.
    with pytest.raises(ValueError, match="delta_poll_s"):
        FollowOptions(poll_s=0)
    with pytest.raises(ValueError, match="delta_audit_s"):
        ServiceOptions(audit_s=-1)
    with pytest.raises(ValueError, match="delta_weight_versions"):
        ServiceOptions(weight_versions="never")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="delta_update_timeout_s"):
        StoreSpec("/s", update_timeout_s=0)


def test_the_environment_path(monkeypatch):
    """A server started from a plain checkpoint reads the options declared with `env` (VLLM_<KEY>)."""
    env = {opt.env_name for opt in declared(LoaderOptions) if opt.env is not None}
    assert env == {
        "VLLM_DELTA_STORE",
        "VLLM_DELTA_STORAGE_OPTIONS",
        "VLLM_DELTA_STORE_TIMEOUT_S",
        "VLLM_DELTA_UPDATE_TIMEOUT_S",
        "VLLM_DELTA_CACHE_MAX_BYTES",
        "VLLM_DELTA_MIN_VERSION_WAIT_S",
        "VLLM_DELTA_AUDIT_S",
        "VLLM_DELTA_WEIGHT_VERSIONS",
        "VLLM_DELTA_TRUSTED_KEYS",
    }
    for name in env:
        monkeypatch.delenv(name, raising=False)
    assert server_options("auto", {}) is None
    monkeypatch.setenv("VLLM_DELTA_STORE", "/data/run")
    monkeypatch.setenv("VLLM_DELTA_STORAGE_OPTIONS", '{"anon": true}')
    monkeypatch.setenv("VLLM_DELTA_CACHE_MAX_BYTES", "2e9")
    monkeypatch.setenv("VLLM_DELTA_AUDIT_S", "30")
    options = server_options("auto", {"delta_follow": True})  # follow mode: the extra config only
    assert options is not None and options.store.uri == "/data/run" and options.store.storage_options == {"anon": True}
    assert options.store.cache_max_bytes == 2_000_000_000 and options.service.audit_s == 30.0
    assert options.follow == FollowOptions()
    monkeypatch.setenv("VLLM_DELTA_UPDATE_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="delta_update_timeout_s"):
        server_options("auto", {})


def test_the_spans_policy_with_and_without_a_store(monkeypatch):
    """`delta_weight_versions` from the server's options; without a store, VLLM_DELTA_WEIGHT_VERSIONS alone
    (a server with the plugin and no store still attributes its completions)."""
    for opt in declared(LoaderOptions):
        monkeypatch.delenv(opt.env_name, raising=False)
    assert weight_versions_policy(None) == "requested"
    monkeypatch.setenv("VLLM_DELTA_WEIGHT_VERSIONS", "always")
    assert weight_versions_policy(None) == "always"
    options = server_options("delta", {"delta_store": "/s"})
    assert options is not None and weight_versions_policy(options) == "requested"  # the extra config wins
    monkeypatch.setenv("VLLM_DELTA_STORE", "/data/run")
    options = server_options("auto", {})
    assert options is not None and weight_versions_policy(options) == "always"  # read with the store's
    monkeypatch.setenv("VLLM_DELTA_WEIGHT_VERSIONS", "sometimes")
    with pytest.raises(ValueError, match="delta_weight_versions"):
        weight_versions_policy(None)


def test_trusted_keys_load_at_start_and_a_bad_file_names_itself(tmp_path, monkeypatch):
    """`delta_trusted_keys`: each file must load when the options are read (a server never starts believing it
    checks signatures with a key it cannot use); a store opened with trusted keys checks its files' digests."""
    from vllm_delta.errors import KeyFileError
    from vllm_delta.signatures import keygen
    from vllm_delta.vllm.shared.options import trusted_keys_from_environment

    a, b = keygen(tmp_path / "a.key"), keygen(tmp_path / "b.key")
    pubs = [f"{a.path}.pub", f"{b.path}.pub"]
    opts = LoaderOptions.from_extra_config({"delta_store": "/s", "delta_trusted_keys": pubs})
    assert opts.store.trusted_keys == tuple(pubs)
    trust = opts.store.trust()
    assert trust is not None and sorted(trust.keys) == sorted([a.fingerprint, b.fingerprint])
    assert opts.store.open().check_digests is True
    garbage = tmp_path / "garbage.pub"
    garbage.write_text("not a key")
    for bad, what in (([str(garbage)], f"{garbage} is not a PEM public key"), ([str(a.path)], "is a private key")):
        with pytest.raises(KeyFileError, match="delta_trusted_keys") as info:
            LoaderOptions.from_extra_config({"delta_store": "/s", "delta_trusted_keys": bad})
        assert what in str(info.value)
    for name in ("VLLM_DELTA_STORE", "VLLM_DELTA_TRUSTED_KEYS"):
        monkeypatch.delenv(name, raising=False)
    assert trusted_keys_from_environment() == ()
    monkeypatch.setenv("VLLM_DELTA_TRUSTED_KEYS", os.pathsep.join(pubs))
    assert trusted_keys_from_environment() == tuple(pubs)
    monkeypatch.setenv("VLLM_DELTA_TRUSTED_KEYS", json.dumps(pubs[:1]))
    monkeypatch.setenv("VLLM_DELTA_STORE", "/data/run")
    options = server_options("auto", {})
    assert options is not None and options.store.trusted_keys == tuple(pubs[:1])
