"""Version files <-> tensors. The only package that knows the on-disk layout (docs/FORMAT.md).

A version file is a safetensors file. Its `__metadata__` holds `format` ("vllm-delta"),
`format_version` and `header`, a JSON document (`VersionHeader`). An anchor stores every tensor
under its Hugging Face name, so an anchor file is itself a loadable checkpoint shard. A delta stores
each changed tensor's codec payload under `<hf name>::<part>`.

A version is one file (format version 1, what a single-process Publisher writes) or several *part*
files (format version 2, one per rank of a sharded publisher). Format version 3 is a delta (one file
or a part) written with a *file-level* codec (`chunked`): its payload is one set of streams for
every changed tensor, stored under `::<part>` keys (an empty tensor name), the file's codec metadata
in the header's `enc`, and each tensor's place in the streams in its own `enc`. Format version 4 (what
writers write for a file-level codec) is format 3 with the header's tensor table written as columns
(one list per field, `TensorTable.to_columns`) and a part's rows as one list in the table's order: a
header is parsed without a JSON object per tensor, and a part's header without each name twice.
Format version 5 (what writers write for a file-level codec since issue 35) is format 4 with those
columns as packed arrays (hex digits of little-endian values; the names one string): written from arrays
and read into arrays, with no Python object per tensor.
A part file's header is the whole version's header (every tensor's shape, dtype and whole-tensor
checksum) with the part's own `nnz` and codec metadata per tensor, plus `part`: its index, the part
count, the rows of dim 0 it owns of each tensor, and the additive checksum of what it contributes.
`Version` reads the parts of one version as one: readers see the same API (`header`, `pieces`,
`dense`) for one file and for many.

    layout.py          the layout's names: format versions, kinds, dtypes, payload keys, rows
    table.py           TensorEntry, TensorTable   a header's tensors, as columns (lists, or arrays)
    arrays.py          TableArrays, RowMap        format 5: the table and a part's rows as packed arrays
    header.py          VersionHeader, PartInfo    the header: read by format version, checked, written
    payload_writer.py  write, serialize, PayloadWriter   a file at once, or while its payload is made
    version_file.py    VersionFile, Piece         an opened file, memory-mapped, checked on open
    mapped_files.py    span_of, pread_into        which open file mapped bytes are in (read them by preadv)
    parts.py           Version, VersionLike       the parts of one version merged and read as one

`from vllm_delta.format import X` is the public import of every name below.
"""

from .arrays import RowMap, TableArrays, join_names
from .header import PartInfo, VersionHeader
from .layout import (
    ARRAYS_FORMAT_VERSION,
    COLUMNS_FORMAT_VERSION,
    DTYPE_CODES,
    DTYPE_NAMES,
    DTYPES,
    FILE_PAYLOAD,
    FORMAT_NAME,
    FORMAT_VERSION,
    KINDS,
    PART_FORMAT_VERSION,
    READ_FORMAT_VERSIONS,
    SEP,
    STREAMS_FORMAT_VERSION,
    STREAMS_FORMAT_VERSIONS,
    VersionKind,
    is_kind,
    num_rows,
    payload_key,
    row_size,
)
from .parts import Version, VersionLike
from .payload_writer import PayloadWriter, serialize, write
from .table import TensorEntry, TensorTable
from .version_file import Piece, VersionFile, header_text

__all__ = [
    "ARRAYS_FORMAT_VERSION",
    "COLUMNS_FORMAT_VERSION",
    "DTYPE_CODES",
    "DTYPE_NAMES",
    "DTYPES",
    "FILE_PAYLOAD",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KINDS",
    "PART_FORMAT_VERSION",
    "READ_FORMAT_VERSIONS",
    "SEP",
    "STREAMS_FORMAT_VERSION",
    "STREAMS_FORMAT_VERSIONS",
    "PartInfo",
    "PayloadWriter",
    "Piece",
    "RowMap",
    "TableArrays",
    "TensorEntry",
    "TensorTable",
    "Version",
    "VersionFile",
    "VersionHeader",
    "VersionKind",
    "VersionLike",
    "header_text",
    "is_kind",
    "join_names",
    "num_rows",
    "payload_key",
    "row_size",
    "serialize",
    "write",
]
