"""One generic codec for the typed messages (server_api.py, vllm/shared/messages.py) and the store's
JSON documents (`Document`): dataclass <-> plain values.

Plain values are what crosses vLLM's msgpack boundary (API process -> engine core -> workers carry
plain values only, vllm/v1/serial_utils.py) and what the HTTP answers are: dicts, lists, str, int,
float, bool and None. The codec walks a dataclass's fields with their type hints, so each message
states its fields once and nothing else spells them:

    encode(value)        -> the plain form (fields in declaration order)
    decode(cls, data)    -> an instance of `cls`, every field checked against its hint (nested
                            dataclasses, `X | None`, `Literal[...]`, list, tuple, dict, NamedTuple);
                            unknown keys are ignored (a newer peer may send more), a missing or null
                            field with a default takes the default

Hooks, all declared on the type:

* `HexSums` (`Annotated[dict[str, int], HEX64]`): 64-bit checksum sums travel as 16 hex digits;
* `Millis` (`Annotated[float, Rounded(3)]`): durations rounded to microseconds in the plain form;
* `Number` (`Annotated[float, AS_WRITTEN]`): a float field that keeps an integer as it was written
  (a document read and written again is the same bytes);
* `omit_none()` as a field's default: the key is left out while the value is None; `omit_when(test)`:
  left out while `test(the instance)` holds (e.g. a key that only some format versions have);
* a `check_wire(data)` classmethod on a message: validates the raw payload before decoding (the
  HTTP requests use it so that a 400 names the first problem in a fixed order); `Closed` is the
  one that refuses unknown keys;
* a `NamedTuple` travels as a JSON array of its fields (a mapping by field name is read too);
* a type with its own plain form: `to_plain(self)` and a classmethod `from_plain(data, where)` (e.g.
  `format.TensorTable`, a header's table of tens of thousands of tensors, read and written as
  columns); `decode_as(hint, data, where)` is the generic decoder it can fall back on.

`Document` is the base of a dataclass stored as a small versioned JSON object (the store's records,
head, marks, replica reports, a mirror's lease): `{"format": FORMAT, "format_version": N, ...fields}`,
keys sorted, one space of indent; `to_json()` / `from_json(text)` through this codec, errors a
`FormatError` that names the document and the field.

Decoding errors are ValueError / TypeError naming the field (a `check_wire` raises what it likes).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    TypeVar,
    Union,
    cast,
    get_args,
    get_origin,
    get_type_hints,
)

from .checksums import from_hex, to_hex
from .errors import FormatError, short

T = TypeVar("T")
D = TypeVar("D", bound="Document")


@dataclass(frozen=True)
class _Hex64:
    """Marker: a dict of 64-bit sums, encoded as 16 hex digits each."""


@dataclass(frozen=True)
class Rounded:
    """Marker: a float rounded to `digits` decimals when encoded."""

    digits: int


@dataclass(frozen=True)
class _AsWritten:
    """Marker: a number decoded as it was written (an int stays an int where a float is declared)."""


HEX64 = _Hex64()
AS_WRITTEN = _AsWritten()
HexSums = Annotated[dict[str, int], HEX64]
Millis = Annotated[float, Rounded(3)]
Number = Annotated[float, AS_WRITTEN]

_OMIT_NONE = "omit_none"
_OMIT_WHEN = "omit_when"


def omit_none() -> Any:
    """A field default of None whose key is left out of the plain form while the value is None."""
    return dataclasses.field(default=None, metadata={_OMIT_NONE: True})


def omit_when(test: Callable[[Any], bool], **field_options: Any) -> Any:
    """A field whose key is left out of the plain form while `test(instance)` holds (`field_options`:
    those of `dataclasses.field`, e.g. its default). A key left out is read back as the default."""
    return dataclasses.field(**field_options, metadata={_OMIT_WHEN: test})


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
# Both directions build one function per type hint, once (functools.cache), so that the per-value
# work is the value's own: a version header of 20,000 tensors is 20,000 entries to walk.
Encoder = Callable[[Any], Any]
Decoder = Callable[[Any, Any], Any]  # (data, where it is): `where` is a path, made a string only for an error
_SCALARS = (str, int, float, bool)


def encode(value: Any, hint: Any = None) -> Any:
    """The plain form of `value` (a message, or a plain value described by `hint`)."""
    return _encoder(hint)(value)


@functools.cache
def _encoder(hint: Any) -> Encoder:
    if _is_union(hint):
        members = _members(hint)
        return _encoder(members[0] if len(members) == 1 else None)
    base, extras = _unwrap(hint)
    marked: Encoder | None = None
    for marker in extras:
        if marker == HEX64:
            marked = _encode_hex
            break
        if isinstance(marker, Rounded):
            marked = functools.partial(_encode_rounded, digits=marker.digits)
            break
    args = get_args(base)
    item_hint = args[1] if len(args) == 2 else None  # of a mapping
    element_hint = args[0] if args else None  # of a list or tuple

    def enc(value: Any) -> Any:
        if value is None:
            return None
        cls: Any = type(value)
        if hasattr(cls, "to_plain") and not isinstance(value, type):
            return value.to_plain()
        if hasattr(cls, "__dataclass_fields__") and not isinstance(value, type):
            return _dataclass_encoder(cls)(value)
        if marked is not None:
            return marked(value)
        if cls in _SCALARS:
            return value
        if isinstance(value, Mapping):
            item = _encoder(item_hint)
            return {(str(k) if isinstance(k, int) else k): item(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            element = _encoder(element_hint)
            return [element(v) for v in value]
        return value

    return enc


def _encode_hex(value: Any) -> Any:
    return {name: to_hex(s) for name, s in value.items()}


def _encode_rounded(value: Any, digits: int) -> Any:
    return round(value, digits)


@functools.cache
def _dataclass_encoder(cls: type) -> Encoder:
    hints = _hints(cls)
    plan = [
        (f.name, _encoder(hints[f.name]), bool(f.metadata.get(_OMIT_NONE)), f.metadata.get(_OMIT_WHEN))
        for f in dataclasses.fields(cls)
    ]

    def enc(value: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, field_encoder, omit_if_none, omit_test in plan:
            v = getattr(value, name)
            if (v is None and omit_if_none) or (omit_test is not None and omit_test(value)):
                continue
            out[name] = field_encoder(v)
        return out

    return enc


# -- decode ----------------------------------------------------------------------------------------
def decode(cls: type[T], data: Any) -> T:
    """An instance of `cls` from its plain form."""
    hint: Any = cls
    return cast(T, _decoder(hint)(data, cls.__name__))


def decode_as(hint: Any, data: Any, where: Any) -> Any:
    """The value `hint` describes, from its plain form (`where`: the path named in errors)."""
    return _decoder(hint)(data, where)


def _as_is(data: Any, where: Any) -> Any:
    return data


def _field(where: Any, suffix: str) -> Any:
    """The path of a field (`suffix` is ".name"), built without formatting anything."""
    return (where, suffix)


def _item(where: Any, key: Any) -> Any:
    """The path of a list item or a mapping's value: `[key!r]` once formatted."""
    return (where, key, None)


def _where(path: Any) -> str:
    """The path as error messages name it: `Message.field[3]['key']`."""
    parts = []
    while isinstance(path, tuple):
        parts.append(path[1] if len(path) == 2 else f"[{path[1]!r}]")
        path = path[0]
    parts.append(str(path))
    return "".join(reversed(parts))


@functools.cache
def _decoder(hint: Any) -> Decoder:
    base, extras = _unwrap(hint)
    if base is Any or base is object:
        return _as_is
    if _is_union(base):
        return _union_decoder(base)
    name = _name(base)
    if base in (str, int, float) and not extras:
        exact = base

        def scalar(data: Any, where: Any) -> Any:
            if type(data) is exact:  # the common case, decided at once
                return data
            if data is None:
                raise TypeError(f"{_where(where)}: null where {name} is expected")
            return _decode_scalar(exact, data, where)

        return scalar
    inner = _value_decoder(base, extras)
    if base is type(None):
        return lambda data, where: None if data is None else inner(data, where)

    def dec(data: Any, where: Any) -> Any:
        if data is None:
            raise TypeError(f"{_where(where)}: null where {name} is expected")
        return inner(data, where)

    return dec


def _value_decoder(base: Any, extras: tuple[Any, ...]) -> Decoder:
    """The decoder of a value that is not null."""
    if isinstance(base, type) and hasattr(base, "from_plain"):
        return cast(Decoder, base.from_plain)
    if HEX64 in extras:
        return lambda data, where: {str(k): from_hex(v) for k, v in _mapping(data, where).items()}
    if AS_WRITTEN in extras:
        return _decode_number
    if dataclasses.is_dataclass(base) and isinstance(base, type):
        return _dataclass_decoder(base)
    if _is_named_tuple(base):
        return _named_tuple_decoder(base)
    origin = get_origin(base)
    args = get_args(base)
    if origin is Literal:
        types_ = {type(a) for a in args}

        def literal(data: Any, where: Any) -> Any:
            if data in args and type(data) in types_:
                return data
            raise ValueError(f"{_where(where)}: {data!r:.60} is not one of {list(args)}")

        return literal
    if base in (list, tuple) or origin in (list, tuple):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"only tuple[X, ...] is supported, not {_name(base)}")  # a declaration's bug
        element = _decoder(args[0] if args else Any)
        as_tuple = base is tuple or origin is tuple
        plain = _plain(args[0] if args else Any)

        def sequence(data: Any, where: Any) -> Any:
            if not isinstance(data, (list, tuple)):
                raise TypeError(f"{_where(where)}: a list is expected, not {type(data).__name__}")
            if plain is object or (plain is not None and _all_of_type(data, plain)):
                items = list(data)  # what the element decoder would return, item by item
            else:
                items = [element(x, (where, i, None)) for i, x in enumerate(data)]  # _item(where, i), inlined
            return tuple(items) if as_tuple else items

        return sequence
    if base is dict or origin is dict or origin is Mapping:  # a Mapping field decodes to a dict
        key_hint, item_hint = args if len(args) == 2 else (Any, Any)
        key = _decoder(key_hint)
        item = _decoder(item_hint)
        int_keys = key_hint is int
        plain_key, plain_item = _plain(key_hint), _plain(item_hint)
        copy_as_is = plain_key is not None and plain_item is not None and not int_keys
        # items that are lists of plain values (a part's row ranges: one per tensor, ~19K at 30B-A3B)
        list_of = _plain(get_args(item_hint)[0]) if get_origin(item_hint) is list and get_args(item_hint) else None
        copy_lists = plain_key is not None and list_of is not None and not int_keys

        def mapping(data: Any, where: Any) -> Any:
            data = _mapping(data, where)
            if (
                copy_as_is
                and (plain_key is object or _all_of_type(data, plain_key))
                and (plain_item is object or _all_of_type(data.values(), plain_item))
            ):
                return dict(data)  # what the key and item decoders would return, one by one
            if (
                copy_lists
                and (plain_key is object or _all_of_type(data, plain_key))
                and _all_lists_of(data.values(), list_of)
            ):
                return dict(zip(data, map(list, data.values())))  # likewise: each list copied as `sequence` would
            return {
                (int(k) if int_keys else key(k, where)): item(v, (where, k, None))  # _item(where, k), inlined
                for k, v in data.items()
            }

        return mapping
    return functools.partial(_decode_scalar, base)


def _all_lists_of(values: Iterable[Any], cls: Any) -> bool:
    """Whether every value is exactly a list whose items are exactly of type `cls` (any, for object).
    The types are collected in C (`map(type, ...)`): a part's ~19K row ranges, per part, per open."""
    values = list(values)
    if not _all_of_type(values, list):
        return False
    return cls is object or _all_of_type(itertools.chain.from_iterable(values), cls)


def _all_of_type(values: Iterable[Any], cls: Any) -> bool:
    """Whether every value is exactly of type `cls` (True for none); the types collected in C."""
    return types_of(values) <= {cls}


def types_of(values: Iterable[Any]) -> set[type]:
    """The exact types among `values`, collected in C (`map(type, ...)`): a column of a header has one
    value per tensor, ~19K of them for a mixture of experts."""
    return set(map(type, values))


def _plain(hint: Any) -> type | None:
    """`object` for a hint that takes any value, the type for a value its decoder returns as it is
    when of exactly that type (str, int, float), else None: lists and mappings of such values are
    copied in one pass."""
    if hint is Any or hint is object:
        return object
    return hint if hint in (str, int, float) else None


def _decode_number(data: Any, where: Any) -> Any:
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return data
    raise TypeError(f"{_where(where)}: {type(data).__name__} where a number is expected")


def _union_decoder(hint: Any) -> Decoder:
    name = _name(hint)
    nullable = type(None) in get_args(hint)
    members = [_decoder(m) for m in _members(hint)]

    def union(data: Any, where: Any) -> Any:
        if data is None:
            if nullable:
                return None
            raise TypeError(f"{_where(where)}: null where {name} is expected")
        if len(members) == 1:
            return members[0](data, where)
        for member in members:  # e.g. `int | str`: the first member that takes the value
            try:
                return member(data, where)
            except (TypeError, ValueError):
                continue
        raise TypeError(f"{_where(where)}: {data!r:.60} is none of {name}")

    return union


def _dataclass_decoder(cls: type) -> Decoder:
    check = getattr(cls, "check_wire", None)
    plan: list[tuple[str, str, Decoder, bool, bool]] | None = None  # built at the first call: a field may be cls

    def dataclass_(data: Any, where: Any) -> Any:
        nonlocal plan
        if plan is None:
            hints = _hints(cls)
            plan = [
                (
                    f.name,
                    f".{f.name}",
                    _decoder(hints[f.name]),
                    f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING,
                    _allows_none(hints[f.name]),
                )
                for f in dataclasses.fields(cls)
                if f.init
            ]
        if check is not None:
            check(data)
        fields = _mapping(data, where)
        kwargs: dict[str, Any] = {}
        for name, suffix, field_decoder, has_default, allows_none in plan:
            if name in fields:
                value = fields[name]
                if value is None and has_default and not allows_none:
                    continue  # null for a field that has a default: the default
                kwargs[name] = field_decoder(value, (where, suffix))  # _field(where, suffix), inlined
            elif not has_default:
                raise ValueError(f"{_where(where)}: the field {name!r} is missing")
        return cls(**kwargs)

    return dataclass_


def _is_named_tuple(base: Any) -> bool:
    return isinstance(base, type) and issubclass(base, tuple) and hasattr(base, "_fields")


def _named_tuple_decoder(cls: type) -> Decoder:
    """A NamedTuple from its array (every field, in order) or from a mapping by field name."""
    names: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]
    plan: list[tuple[str, Decoder]] | None = None  # built at the first call, as for dataclasses

    def named_tuple(data: Any, where: Any) -> Any:
        nonlocal plan
        if plan is None:
            hints = _hints(cls)
            plan = [(n, _decoder(hints[n])) for n in names]
        if isinstance(data, (list, tuple)):
            if len(data) != len(names):
                raise ValueError(f"{_where(where)}: {len(names)} items ({', '.join(names)}) expected, not {len(data)}")
            data = dict(zip(names, data))
        fields = _mapping(data, where)
        missing = [n for n in names if n not in fields]
        if missing:
            raise ValueError(f"{_where(where)}: the field {missing[0]!r} is missing")
        return cls(*(field_decoder(fields[n], _field(where, f".{n}")) for n, field_decoder in plan))

    return named_tuple


def _decode_scalar(base: Any, data: Any, where: Any) -> Any:
    if base is float and isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if base is int and isinstance(data, bool):
        raise TypeError(f"{_where(where)}: a boolean where an integer is expected")
    if isinstance(base, type) and not isinstance(data, base):
        raise TypeError(f"{_where(where)}: {type(data).__name__} where {base.__name__} is expected")
    return data


def _allows_none(hint: Any) -> bool:
    base, _ = _unwrap(hint)
    return base is Any or (_is_union(base) and type(None) in get_args(base))


def _mapping(data: Any, where: Any) -> Mapping[Any, Any]:
    if type(data) is not dict and not isinstance(data, Mapping):
        raise TypeError(f"{_where(where)}: an object is expected, not {type(data).__name__}")
    return data


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)


# -- strict messages and documents -----------------------------------------------------------------
class Closed:
    """Base of a dataclass whose plain form may hold no key it does not declare (a reader that would
    ignore a newer writer's key could misread the rest)."""

    @classmethod
    def check_wire(cls, data: Any) -> None:
        known = _FIELD_NAMES.get(cls)
        if known is None:
            known = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cast(Any, cls)))
        if (type(data) is dict or isinstance(data, Mapping)) and not known.issuperset(data):
            raise ValueError(f"{cls.__name__}: unknown keys {short(sorted(set(data) - known))}")


_FIELD_NAMES: dict[type, frozenset[str]] = {}  # of each Closed type, once


class Document:
    """Base of a dataclass stored as a small versioned JSON document of the store:
    `{"format": FORMAT, "format_version": N, ...its fields}`, keys sorted, one space of indent.

    Declared on the subclass: `FORMAT`; `FORMAT_VERSIONS`, those a reader takes (a writer writes
    `document_version()`, by default the newest); `DESCRIPTION`, what an error calls it
    ("unreadable <DESCRIPTION> <where>: ..."); `validate()`, the checks beyond the fields' types
    (ValueError). Reading ignores unknown keys (a later minor addition must not hide a document) and
    gives a missing field with a default its default."""

    FORMAT: ClassVar[str]
    FORMAT_VERSIONS: ClassVar[tuple[int, ...]] = (1,)
    DESCRIPTION: ClassVar[str]

    def document_version(self) -> int:
        """The format version this document is written in."""
        return self.FORMAT_VERSIONS[-1]

    def validate(self) -> None:
        """Checks beyond the fields' types (ValueError)."""

    def to_json(self) -> str:
        doc = {"format": self.FORMAT, "format_version": self.document_version(), **encode(self)}
        return json.dumps(doc, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls: type[D], data: str | bytes, *, where: str = "") -> D:
        """The document in `data`, checked (FormatError naming the document, `where` it was read, and
        the first problem)."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != cls.FORMAT:
                raise ValueError(f"not a {cls.FORMAT} document")
            fv = doc.get("format_version")
            if isinstance(fv, bool) or fv not in cls.FORMAT_VERSIONS:
                known = " or ".join(f"v{v}" for v in cls.FORMAT_VERSIONS)
                raise ValueError(f"unknown format version {short(fv)}: this reader knows {cls.FORMAT} {known}")
            value = decode(cls, doc)
            value.validate()
        except (ValueError, TypeError) as exc:
            raise FormatError(f"unreadable {cls.DESCRIPTION}{' ' + where if where else ''}: {str(exc)[:300]}") from None
        return value
