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
from typing import Any

from ..errors import CodecError
from .base import Codec, Ctx, err
from .decoding import CodecDecoder, PieceDecoder

DEFAULT_CODEC = "chunked"

Loader = Callable[[], Any]


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
    with _lock:
        codec = _codecs.get(name)
        if codec is not None:
            return codec
        make = _loaders(name, ctx)[0]
    codec = make()  # outside the lock: importing a codec's module may take a while
    with _lock:
        return _codecs.setdefault(name, codec)


def get_decoder(name: str, ctx: Ctx | None = None) -> CodecDecoder:
    """The staging decoder of the codec registered under `name`; CodecError for an unknown name."""
    with _lock:
        decoder = _decoders.get(name)
        if decoder is not None:
            return decoder
        make = _loaders(name, ctx)[1]
    if make is None:
        decoder = PieceDecoder(get_codec(name, ctx))
    else:
        decoder = make()
    with _lock:
        return _decoders.setdefault(name, decoder)


def _loaders(name: str, ctx: Ctx | None) -> tuple[Loader, Loader | None]:
    """The loaders of a registered codec (the caller holds the lock)."""
    try:
        return _LOADERS[name]
    except KeyError:
        raise err(CodecError, f"unknown codec {name!r} (known: {', '.join(_LOADERS)})", ctx or {}) from None


register_codec("raw", "vllm_delta.codec.raw:RawCodec", "vllm_delta.codec.raw:RawDecoder")
register_codec("compact", "vllm_delta.codec.compact:CompactCodec", "vllm_delta.codec.compact:CompactDecoder")
register_codec("chunked", "vllm_delta.codec.chunked:ChunkedCodec", "vllm_delta.codec.chunked:ChunkedDecoder")
