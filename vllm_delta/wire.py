"""One generic codec for the typed messages (server_api.py, vllm/shared/messages.py): dataclass <-> plain values.

Plain values are what crosses vLLM's msgpack boundary (API process -> engine core -> workers carry
plain values only, vllm/v1/serial_utils.py) and what the HTTP answers are: dicts, lists, str, int,
float, bool and None. The codec walks a dataclass's fields with their type hints, so each message
states its fields once and nothing else spells them:

    encode(value)        -> the plain form (fields in declaration order)
    decode(cls, data)    -> an instance of `cls`, every field checked against its hint (nested
                            dataclasses, `X | None`, `Literal[...]`, list, dict); unknown keys are
                            ignored (a newer peer may send more), a missing or null field with a
                            default takes the default

Hooks, all declared on the type:

* `HexSums` (`Annotated[dict[str, int], HEX64]`): 64-bit checksum sums travel as 16 hex digits;
* `Millis` (`Annotated[float, Rounded(3)]`): durations rounded to microseconds in the plain form;
* `omit_none()` as a field's default: the key is left out while the value is None;
* a `check_wire(data)` classmethod on a message: validates the raw payload before decoding (the
  HTTP requests use it so that a 400 names the first problem in a fixed order).

Decoding errors are ValueError / TypeError naming the field (a `check_wire` raises what it likes).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from .checksums import from_hex, to_hex

T = TypeVar("T")


@dataclass(frozen=True)
class _Hex64:
    """Marker: a dict of 64-bit sums, encoded as 16 hex digits each."""


@dataclass(frozen=True)
class Rounded:
    """Marker: a float rounded to `digits` decimals when encoded."""

    digits: int


HEX64 = _Hex64()
HexSums = Annotated[dict[str, int], HEX64]
Millis = Annotated[float, Rounded(3)]

_OMIT_NONE = "omit_none"


def omit_none() -> Any:
    """A field default of None whose key is left out of the plain form while the value is None."""
    return dataclasses.field(default=None, metadata={_OMIT_NONE: True})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _unwrap(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the type, its Annotated markers)."""
    if get_origin(hint) is Annotated:
        base, *extras = get_args(hint)
        return base, tuple(extras)
    return hint, ()


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _members(hint: Any) -> list[Any]:
    return [a for a in get_args(hint) if a is not type(None)]


# -- encode ----------------------------------------------------------------------------------------
def encode(value: Any, hint: Any = None) -> Any:
    """The plain form of `value` (a message, or a plain value described by `hint`)."""
    if value is None:
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = _hints(type(value))
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v is None and f.metadata.get(_OMIT_NONE):
                continue
            out[f.name] = encode(v, hints[f.name])
        return out
    if _is_union(hint):
        members = _members(hint)
        hint = members[0] if len(members) == 1 else None
    base, extras = _unwrap(hint)
    for marker in extras:
        if marker == HEX64:
            return {name: to_hex(s) for name, s in value.items()}
        if isinstance(marker, Rounded):
            return round(value, marker.digits)
    args = get_args(base)
    if isinstance(value, Mapping):
        item = args[1] if len(args) == 2 else None
        return {(str(k) if isinstance(k, int) else k): encode(v, item) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        item = args[0] if args else None
        return [encode(v, item) for v in value]
    return value


# -- decode ----------------------------------------------------------------------------------------
def decode(cls: type[T], data: Any) -> T:
    """An instance of `cls` from its plain form."""
    return cast(T, _decode(cls, data, cls.__name__))


def _decode(hint: Any, data: Any, where: str) -> Any:
    base, extras = _unwrap(hint)
    if base is Any or base is object:
        return data
    if _is_union(base):
        return _decode_union(base, data, where)
    if data is None:
        if base is type(None):
            return None
        raise TypeError(f"{where}: null where {_name(base)} is expected")
    if HEX64 in extras:
        return {str(k): from_hex(v) for k, v in _mapping(data, where).items()}
    if dataclasses.is_dataclass(base) and isinstance(base, type):
        return _decode_dataclass(base, data, where)
    origin = get_origin(base)
    args = get_args(base)
    if origin is Literal:
        if data in args and type(data) in {type(a) for a in args}:
            return data
        raise ValueError(f"{where}: {data!r:.60} is not one of {list(args)}")
    if base in (list, tuple) or origin in (list, tuple):
        if not isinstance(data, (list, tuple)):
            raise TypeError(f"{where}: a list is expected, not {type(data).__name__}")
        item = args[0] if args else Any
        return [_decode(item, x, f"{where}[{i}]") for i, x in enumerate(data)]
    if base is dict or origin is dict:
        key, item = args if len(args) == 2 else (Any, Any)
        return {
            (int(k) if key is int else _decode(key, k, where)): _decode(item, v, f"{where}[{k!r}]")
            for k, v in _mapping(data, where).items()
        }
    return _decode_scalar(base, data, where)


def _decode_union(hint: Any, data: Any, where: str) -> Any:
    if data is None:
        if type(None) in get_args(hint):
            return None
        raise TypeError(f"{where}: null where {_name(hint)} is expected")
    members = _members(hint)
    if len(members) == 1:
        return _decode(members[0], data, where)
    for member in members:  # e.g. `int | str`: the first member that takes the value
        try:
            return _decode(member, data, where)
        except (TypeError, ValueError):
            continue
    raise TypeError(f"{where}: {data!r:.60} is none of {_name(hint)}")


def _decode_dataclass(cls: type, data: Any, where: str) -> Any:
    check = getattr(cls, "check_wire", None)
    if check is not None:
        check(data)
    fields = _mapping(data, where)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        value = fields.get(f.name)
        if value is None and has_default and not _allows_none(hints[f.name]):
            continue  # missing, or null for a field that has a default: the default
        if f.name not in fields and not has_default:
            raise ValueError(f"{where}: the field {f.name!r} is missing")
        if f.name in fields:
            kwargs[f.name] = _decode(hints[f.name], value, f"{where}.{f.name}")
    return cls(**kwargs)


def _decode_scalar(base: Any, data: Any, where: str) -> Any:
    if base is float and isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if base is int and isinstance(data, bool):
        raise TypeError(f"{where}: a boolean where an integer is expected")
    if isinstance(base, type) and not isinstance(data, base):
        raise TypeError(f"{where}: {type(data).__name__} where {base.__name__} is expected")
    return data


def _allows_none(hint: Any) -> bool:
    base, _ = _unwrap(hint)
    return base is Any or (_is_union(base) and type(None) in get_args(base))


def _mapping(data: Any, where: str) -> Mapping[Any, Any]:
    if not isinstance(data, Mapping):
        raise TypeError(f"{where}: an object is expected, not {type(data).__name__}")
    return data


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
