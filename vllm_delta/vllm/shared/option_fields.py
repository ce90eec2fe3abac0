"""How a server option is declared, parsed, checked and documented (the options: options.py).

An option is the field of the dataclass it fills, declared with `option(key, default, doc, check)`
(`required_option`, `option_factory`; `group` nests another options dataclass read from the same
keys). The field's annotation is its type; `check(key, value)` returns the value as the field holds
it, or raises ValueError naming the key. From the declarations:

    from_extra(cls, extra)   the parser: a missing key (or null) takes the default, a present one is
                             checked; a required one missing is REQUIRED's error
    check_fields(obj)        the same checks on a dataclass built directly (its __post_init__)
    declared(cls)            the options, in declaration order (the keys taken from vLLM's config)
    options_table(cls)       the docs' table (docs/VLLM.md)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ...server_api import UPDATE_MODES, UpdateMode

if TYPE_CHECKING:
    from ...signatures import TrustedKeys

T = TypeVar("T")
D = TypeVar("D")
Check = Callable[[str, Any], Any]  # (key, value) -> the value as the field holds it; ValueError naming the key

_OPTION = "vllm_delta_option"  # field metadata: the field's Option
_GROUP = "vllm_delta_options"  # field metadata: a nested options dataclass, parsed from the same keys
REQUIRED = "--load-format delta needs --model-loader-extra-config '{{\"{key}\": URI}}'"


@dataclass(frozen=True)
class Option:
    """One `delta_*` key: what it means, how a value is checked, how the docs show its default."""

    key: str
    doc: str
    check: Check
    default_doc: str | None = None  # the docs' default column when it is not the default's JSON
    env: Callable[[str], Any] | None = None  # also read from the environment as VLLM_<KEY>, parsed so

    @property
    def env_name(self) -> str:
        return "VLLM_" + self.key.upper()


def option(key: str, default: T, doc: str, check: Check, **more: Any) -> T:
    """A dataclass field filled by the extra-config key `key` (`more`: the rest of `Option`)."""
    return field(default=default, metadata={_OPTION: Option(key, doc, check, **more)})


def required_option(key: str, doc: str, check: Check, **more: Any) -> Any:
    """A field with no default: the parser refuses a config without `key` (ValueError: REQUIRED)."""
    return field(metadata={_OPTION: Option(key, doc, check, default_doc="required", **more)})


def option_factory(key: str, factory: Callable[[], T], doc: str, check: Check, **more: Any) -> T:
    return field(default_factory=factory, metadata={_OPTION: Option(key, doc, check, **more)})


def group(cls: type[T], *, required: bool = False) -> T:
    """A field holding a nested options dataclass, parsed from the same extra config (`required`: it
    has a required option, so no default)."""
    if required:
        return cast(T, field(metadata={_GROUP: cls}))
    return field(default_factory=cls, metadata={_GROUP: cls})


# -- checks ----------------------------------------------------------------------------------------------
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def positive(kind: type = float, *, optional: bool = False) -> Check:
    def check(key: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if not _is_number(value) or not value > 0:
            raise ValueError(f"{key} must be a positive number, not {value!r}")
        return kind(value)

    return check


def seconds_up_to(most: float) -> Check:
    def check(key: str, value: Any) -> float:
        if not _is_number(value) or not 0 <= value <= most:
            raise ValueError(f"{key} must be a number of seconds from 0 to {most:.0f}, not {value!r}")
        return float(value)

    return check


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, not {value!r}")
    return value


def at_least_one(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1, not {value!r}")
    return value


def text(*, optional: bool = False) -> Check:
    def check(key: str, value: Any) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key} must be a non-empty string, not {value!r}")
        return value

    return check


def mapping(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a JSON object, not {value!r}")
    return dict(value)


def names(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{key} must be a list of tensor names, not {value!r}")
    return tuple(value)


def key_files(key: str, value: Any) -> tuple[str, ...]:
    """A list of key file paths; each must load (KeyFileError naming the file): a server must not start
    believing it checks signatures with a key it cannot use."""
    if (
        isinstance(value, str)
        or not isinstance(value, (list, tuple))
        or not all(isinstance(p, str) and p for p in value)
    ):
        raise ValueError(f"{key} must be a list of public-key file paths, not {value!r}")
    if value:
        from ...errors import KeyFileError

        try:
            load_trusted_keys(tuple(value))
        except KeyFileError as exc:
            raise KeyFileError(f"{key}: {exc}") from None
    return tuple(value)


@functools.cache
def load_trusted_keys(paths: tuple[str, ...]) -> TrustedKeys:
    """The keys of `paths`, loaded once per process (a spec crosses to the workers with every call)."""
    from ...signatures import TrustedKeys

    return TrustedKeys.load(paths)


def key_files_env(raw: str) -> list[str]:
    """The environment's form of a list of paths: a JSON list, or paths separated by os.pathsep."""
    if raw.lstrip().startswith("["):
        paths: list[str] = json.loads(raw)
        return paths
    return [p for p in raw.split(os.pathsep) if p]


def start_version(key: str, value: Any) -> int | str:
    if value == "latest":
        return "latest"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise ValueError(f'{key} must be "latest" or a version number, not {value!r}')


def one_of(values: tuple[str, ...]) -> Check:
    def check(key: str, value: Any) -> Any:
        if value not in values:
            raise ValueError(f"{key} must be one of {', '.join(values)}, not {value!r}")
        return value

    return check


def update_mode(key: str, value: Any) -> UpdateMode:
    if value not in UPDATE_MODES:
        raise ValueError(f"{key} must be one of {', '.join(UPDATE_MODES)}, not {value!r}")
    return cast(UpdateMode, value)


def replica_name(key: str, value: Any) -> str | None:
    from ...store.ledger import valid_replica_id

    if value is not None and (not isinstance(value, str) or not valid_replica_id(value)):
        raise ValueError(f"{key} must be 1-128 letters, digits, '.', '_' or '-' (not first), not {value!r}")
    return value


# -- the parser -----------------------------------------------------------------------------------------
def _fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Option | None, type | None]]:
    for f in dataclasses.fields(cls):
        yield f, f.metadata.get(_OPTION), f.metadata.get(_GROUP)


def from_extra(cls: type[D], extra: Mapping[str, Any]) -> D:
    """`cls` from the extra config's keys: a missing key or null takes the default, a present one is
    checked (ValueError naming the key)."""
    values: dict[str, Any] = {}
    for f, opt, nested in _fields(cls):
        if nested is not None:
            values[f.name] = from_extra(nested, extra)
        elif opt is not None and extra.get(opt.key) is not None:
            values[f.name] = opt.check(opt.key, extra[opt.key])
        elif opt is not None and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(REQUIRED.format(key=opt.key))
    return cls(**values)


def check_fields(obj: Any) -> None:
    """Run the declared checks on a dataclass built directly (its __post_init__): the values as held."""
    for f, opt, _ in _fields(type(obj)):
        if opt is not None:
            object.__setattr__(obj, f.name, opt.check(opt.key, getattr(obj, f.name)))


def declared(cls: type) -> list[Option]:
    """The options of `cls` and of its nested groups, in declaration order."""
    out: list[Option] = []
    for _, opt, nested in _fields(cls):
        out.extend(declared(nested) if nested is not None else [opt] if opt is not None else [])
    return out


def options_table(cls: type) -> str:
    """The docs' table of `cls`'s keys (and its groups'), from the declarations."""
    rows = ["| key | default | environment | meaning |", "|---|---|---|---|"]
    for f in _option_fields(cls):
        opt: Option = f.metadata[_OPTION]
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if isinstance(default, float) and default.is_integer():
            default = int(default)
        shown = opt.default_doc or f"`{json.dumps(list(default) if isinstance(default, tuple) else default)}`"
        env = f"`{opt.env_name}`" if opt.env is not None else ""
        rows.append(f"| `{opt.key}` | {shown} | {env} | {opt.doc} |")
    return "\n".join(rows) + "\n"


def _option_fields(cls: type) -> Iterator[dataclasses.Field[Any]]:
    for f, opt, nested in _fields(cls):
        if nested is not None:
            yield from _option_fields(nested)
        elif opt is not None:
            yield f
