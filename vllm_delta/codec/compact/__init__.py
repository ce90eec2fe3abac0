"""Codec `compact` (formats 1 and 2): per tensor, gap-coded positions and ULP differences in zstd frames.

Gap-coded positions (uint16, byte-planed, escapes for gaps >= 65535) + the difference of the bit
patterns new - old mod 2^bits (int8, escapes for |d| > 127), zstd-compressed in independent frames
of at most FRAME_ELEMS elements, one payload (`<name>::blob`) per tensor. Its values need the
base's values. Layout: docs/FORMAT.md.

  frames.py    the frame layer (`Frame`, `parse_frames`, `decompress_frame`, `decode_frames`)
  codec.py     `CompactCodec` (base.Codec)
  decoder.py   `CompactDecoder`, a server's staging decoder (codec/decoding.py's interface)
"""

from __future__ import annotations

from .codec import CompactCodec
from .decoder import CompactDecoder
from .frames import (
    DIFF_ESCAPE,
    FRAME_ELEMS,
    GAP_ESCAPE,
    ZSTD_LEVEL,
    Frame,
    FrameArrays,
    FrameOrder,
    decode_frames,
    decompress_frame,
    parse_frames,
    patch_escapes,
)

__all__ = [
    "DIFF_ESCAPE",
    "FRAME_ELEMS",
    "GAP_ESCAPE",
    "ZSTD_LEVEL",
    "CompactCodec",
    "CompactDecoder",
    "Frame",
    "FrameArrays",
    "FrameOrder",
    "decode_frames",
    "decompress_frame",
    "parse_frames",
    "patch_escapes",
]
