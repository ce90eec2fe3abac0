"""Codec `chunked` (format 3, the default): one set of streams per file, cut into independent chunks.

Every changed element of a version file (all its tensors, one after the other: tensor t holds the
elements [at_t, at_t + nnz_t), `enc["at"]` in its header entry) is coded as

  gap_lo, gap_hi  u8   the gap (unchanged elements skipped since the previous changed element of the
                       tensor; the first counts from the piece's start, `enc["start"]`) as uint16
                       byte planes; 0xFFFF is a gap escape (the real gap in the int64 table `gap_esc`)
  sign            bit  the bit difference d = new - old (mod 2^bits, read signed) is negative
  big             bit  |d| > 1 (in RL updates ~89% of changed bf16 elements move by one ULP)
  mag             u8   big elements only: |d| - 2; 255 is a value escape (|d| in int64 `mag_esc`)

Chunk k covers elements [k·E, (k+1)·E) (E = `chunk_elems`, a multiple of 128). Each of its five
planes is one zstd frame (none when the plane is empty: only `mag` can be), each frame padded with
zeros to FRAME_ALIGN bytes; the chunks follow each other in the `blob`. Every frame is a standard
zstd frame: the CPU (zstandard) and the GPU (nvCOMP, `gpu.py`) write the same layout and read each
other's frames. The `index` table (int64, one row per chunk) gives the five frames' compressed sizes,
the chunk's big elements and escapes, and a positional hash of its padded bytes
(`checksums.chunk_hash`), checked before anything is decompressed: a corrupt chunk is a CodecError
naming its version, tensor and chunk, on either path. Measured on `benchmarks/payload.py`'s
AdamW deltas: 1.10 B per changed element, against 1.215 for `compact` (docs/PERFORMANCE.md).

The package, one module per job:

  planes.py    the format's constants, where planes sit in a buffer, bit helpers, the backend choice
  encode.py    changes -> planes on the device (`encode_planes`); planes -> frames on the host
  write.py     a batch's planes -> the payload, streamed into a sink (`ChunkedBatch`, `StreamEncoder`)
  codec.py     `ChunkedCodec` (base.FileCodec), the per-piece reader (`unpack`/`finish`) included
  streams.py   reading: a file's streams checked, chunks verified and decompressed (`FileStreams`)
  decode.py    planes -> positions and differences on the device (`decode_planes`, `Spans`, `Carry`)
  decoder.py   `ChunkedDecoder`, a server's staging decoder (codec/decoding.py's interface)
  gpu.py       nvCOMP (optional): frames compressed and decompressed on the GPU
  kernels.py   Triton kernels (optional): the device halves of encode and decode, fused
"""

from __future__ import annotations

from .codec import ChunkedCodec
from .decode import Carry, Decoded, Spans, decode_planes
from .decoder import GPU_RUN_ELEMS, ChunkedDecoder
from .encode import compress_cpu, encode_planes, index_row, planes_to_host
from .planes import (
    CHUNK_ELEMS,
    COL_BIG,
    COL_GAP_ESC,
    COL_HASH,
    COL_MAG_ESC,
    FRAME_ALIGN,
    GAP_ESCAPE,
    INDEX_WIDTH,
    MAG_BIAS,
    MAG_ESCAPE,
    MAX_CHUNK_ELEMS,
    N_PLANES,
    PAYLOAD_LAYOUT,
    PAYLOAD_PARTS,
    PLANES,
    PLANES_BACKENDS,
    PLANES_ENV,
    SLICE_ELEMS,
    ZSTD_LEVEL,
    PlaneLayout,
    Planes,
    PlanesBackend,
    PlaneViews,
    align,
    chunk_counts,
    chunk_ranks,
    pack_bits,
    plane_views,
    unpack_bits,
)
from .streams import FileStreams, piece_at
from .write import ChunkedBatch, EncodeSettings, FilePack, FilePlan, StreamEncoder

__all__ = [
    "CHUNK_ELEMS",
    "COL_BIG",
    "COL_GAP_ESC",
    "COL_HASH",
    "COL_MAG_ESC",
    "FRAME_ALIGN",
    "GAP_ESCAPE",
    "GPU_RUN_ELEMS",
    "INDEX_WIDTH",
    "MAG_BIAS",
    "MAG_ESCAPE",
    "MAX_CHUNK_ELEMS",
    "N_PLANES",
    "PAYLOAD_LAYOUT",
    "PAYLOAD_PARTS",
    "PLANES",
    "PLANES_BACKENDS",
    "PLANES_ENV",
    "SLICE_ELEMS",
    "ZSTD_LEVEL",
    "Carry",
    "ChunkedBatch",
    "ChunkedCodec",
    "ChunkedDecoder",
    "Decoded",
    "EncodeSettings",
    "FilePack",
    "FilePlan",
    "FileStreams",
    "PlaneLayout",
    "PlaneViews",
    "Planes",
    "PlanesBackend",
    "Spans",
    "StreamEncoder",
    "align",
    "chunk_counts",
    "chunk_ranks",
    "compress_cpu",
    "decode_planes",
    "encode_planes",
    "index_row",
    "pack_bits",
    "piece_at",
    "plane_views",
    "planes_to_host",
    "unpack_bits",
]
