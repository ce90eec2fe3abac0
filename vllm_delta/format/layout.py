"""The names of the on-disk layout: the format versions, the version kinds, the dtypes a file holds,
the payload keys (`<hf name>::<part>`) and the row arithmetic parts are cut by (docs/FORMAT.md)."""

from __future__ import annotations

from typing import Literal, TypeGuard, get_args

import torch

FORMAT_NAME = "vllm-delta"
FORMAT_VERSION = 1  # one-file versions
PART_FORMAT_VERSION = 2  # part files of multi-part versions
STREAMS_FORMAT_VERSION = 3  # deltas of a file-level codec (one file or a part)
COLUMNS_FORMAT_VERSION = 4  # format 3 with the tensor table and a part's rows written as columns
ARRAYS_FORMAT_VERSION = 5  # format 4 with those columns as packed arrays (hex digits of little-endian values)
# what a file-level codec's deltas are
STREAMS_FORMAT_VERSIONS = (STREAMS_FORMAT_VERSION, COLUMNS_FORMAT_VERSION, ARRAYS_FORMAT_VERSION)
READ_FORMAT_VERSIONS = (FORMAT_VERSION, PART_FORMAT_VERSION, *STREAMS_FORMAT_VERSIONS)
FILE_PAYLOAD = ""  # the tensor name of a file-level codec's payload keys (`::<part>`)
VersionKind = Literal["anchor", "delta"]  # what a version is: a full image, or the changes since its base
KINDS: tuple[VersionKind, ...] = get_args(VersionKind)
SEP = "::"
JSON_SEPARATORS = (",", ":")  # headers are JSON without spaces (keys sorted)

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DTYPE_CODES = ("BF16", "F16", "F32")  # format 5's dtype column: the index of the dtype's name here
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Every safetensors dtype a version file's payload uses (codec parts: positions, blobs, values).
ST_DTYPES = {
    **DTYPES,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def is_kind(value: object) -> TypeGuard[VersionKind]:
    """Whether `value` is a version kind (the check where a kind comes in as a plain string)."""
    return value in KINDS


def num_rows(shape: list[int] | tuple[int, ...]) -> int:
    """Rows of dim 0 (a 0-d tensor is one row of one element): the unit parts own."""
    return int(shape[0]) if len(shape) else 1


def row_size(shape: list[int] | tuple[int, ...]) -> int:
    """Elements per row of dim 0."""
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n


def payload_key(name: str, part: str) -> str:
    """The safetensors key of one payload part of a tensor (a file-level codec's: `FILE_PAYLOAD`)."""
    return f"{name}{SEP}{part}"
