"""The codec registry: a codec's name (a header's `codec`) -> its Codec and its staging decoder.

Entries are loaded lazily, the way vLLM's `weight_transfer/factory.py` looks its backends up: a
codec's module (and what it imports: zstandard, Triton, nvCOMP) is imported the first time its name
is asked for. `register_codec` adds a codec (a plugin's, a test's); a codec registered without a
decoder is staged through its own `unpack`/`finish`, one piece at a time (`decoding.PieceDecoder`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CodecError
from .base import Codec, Ctx, err
from .decoding import CodecDecoder, PieceDecoder

DEFAULT_CODEC = "chunked"

Loader = Callable[[], Any]
T = TypeVar("T")


def _lazy(ref: str) -> Loader:
    """ "package.module:Name" -> a loader of Name() (imported on first call)."""
    module, _, name = ref.partition(":")

    def load() -> Any:
        return getattr(importlib.import_module(module), name)()

    return load


_LOADERS: dict[str, tuple[Loader, Loader | None]] = {}
_codecs: dict[str, Codec] = {}
_decoders: dict[str, CodecDecoder] = {}
_lock = threading.Lock()


def register_codec(
    name: str, codec: str | Callable[[], Codec], decoder: str | Callable[[], CodecDecoder] | None = None
) -> None:
    """Register a codec under `name`: each of `codec` and `decoder` a "module:Class" path (imported
    on first use) or a factory. ValueError if the name is taken."""
    with _lock:
        if name in _LOADERS:
            raise ValueError(f"codec {name!r} is already registered")
        make_codec = _lazy(codec) if isinstance(codec, str) else codec
        make_decoder = _lazy(decoder) if isinstance(decoder, str) else decoder
        _LOADERS[name] = (make_codec, make_decoder)


def names() -> list[str]:
    """The registered codecs' names."""
    return list(_LOADERS)


def get_codec(name: str, ctx: Ctx | None = None) -> Codec:
    """The codec registered under `name` (one instance per process); CodecError for an unknown name."""
    return _once(_codecs, name, lambda: _loaders(name, ctx)[0]())


def get_decoder(name: str, ctx: Ctx | None = None) -> CodecDecoder:
    """The staging decoder of the codec registered under `name`; CodecError for an unknown name."""

    def make() -> CodecDecoder:
        loader = _loaders(name, ctx)[1]
        return loader() if loader is not None else PieceDecoder(get_codec(name, ctx))

    return _once(_decoders, name, make)


def _once(cache: dict[str, T], name: str, make: Callable[[], T]) -> T:
    """cache[name], made on first use (outside the lock: importing a codec's module takes a while)."""
    with _lock:
        if name in cache:
            return cache[name]
    made = make()
    with _lock:
        return cache.setdefault(name, made)


def _loaders(name: str, ctx: Ctx | None) -> tuple[Loader, Loader | None]:
    """The loaders of a registered codec."""
    try:
        return _LOADERS[name]
    except KeyError:
        raise err(CodecError, f"unknown codec {name!r} (known: {', '.join(_LOADERS)})", ctx or {}) from None


register_codec("raw", "vllm_delta.codec.raw:RawCodec", "vllm_delta.codec.raw:RawDecoder")
register_codec("compact", "vllm_delta.codec.compact:CompactCodec", "vllm_delta.codec.compact:CompactDecoder")
register_codec("chunked", "vllm_delta.codec.chunked:ChunkedCodec", "vllm_delta.codec.chunked:ChunkedDecoder")
