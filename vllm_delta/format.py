"""One version file <-> tensors. The only module that knows the on-disk layout (docs/FORMAT.md).

A version file is a safetensors file. Its `__metadata__` holds `format` ("vllm-delta"),
`format_version` and `header`, a JSON document (`VersionHeader`). An anchor stores every tensor
under its Hugging Face name, so an anchor file is itself a loadable checkpoint shard. A delta stores
each changed tensor's codec payload under `<hf name>::<part>`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import asdict, dataclass, field

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save, save_file

from .errors import FormatError, ShapeMismatchError

FORMAT_NAME = "vllm-delta"
FORMAT_VERSION = 1
KINDS = ("anchor", "delta")
SEP = "::"

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Every safetensors dtype a version file's payload uses (codec parts: positions, blobs, values).
_ST_DTYPES = {
    **DTYPES,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class TensorEntry:
    shape: list[int]
    dtype: str  # "BF16" | "F16" | "F32"
    checksum: str  # per-tensor positional sum of the tensor at this version (16 hex digits)
    nnz: int = 0  # changed elements (deltas); numel for anchors
    enc: dict = field(default_factory=dict)  # codec metadata (deltas, changed tensors only)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class VersionHeader:
    version: int
    kind: str  # "anchor" | "delta"
    tensors: dict[str, TensorEntry]
    checksum: str  # whole-model checksum at this version
    base: int | None = None  # deltas: the version they apply to
    base_checksum: str | None = None  # deltas: whole-model checksum of the base
    codec: str | None = None  # deltas
    format_version: int = FORMAT_VERSION
    created: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def nnz(self) -> int:
        return sum(t.nnz for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, where: str = "") -> VersionHeader:
        try:
            raw = json.loads(text)
            fv = raw.get("format_version")
            if fv != FORMAT_VERSION:
                raise FormatError(
                    f"unknown format version {fv!r} in {where or 'header'} (this reader knows {FORMAT_VERSION})",
                    version=raw.get("version"),
                )
            tensors = {name: TensorEntry(**entry) for name, entry in raw.pop("tensors").items()}
            header = cls(tensors=tensors, **raw)
        except FormatError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise FormatError(f"malformed version header in {where or 'file'}: {exc}") from None
        header.validate()
        return header

    def validate(self) -> None:
        v = self.version
        if not isinstance(v, int) or v < 0:
            raise FormatError(f"bad version number {v!r}")
        if self.kind not in KINDS:
            raise FormatError(f"unknown kind {self.kind!r}", version=v)
        if self.kind == "delta" and (not isinstance(self.base, int) or self.base >= v or not self.codec):
            raise FormatError(f"delta needs a codec and a base below it (base={self.base!r})", version=v)
        if not _is_hex16(self.checksum) or not (self.base_checksum is None or _is_hex16(self.base_checksum)):
            raise FormatError("checksum and base_checksum must be 16 lower-case hex digits", version=v)
        for name, t in self.tensors.items():
            if not _is_hex16(t.checksum):
                raise FormatError("the checksum must be 16 lower-case hex digits", version=v, tensor=name)
            if t.dtype not in DTYPES:
                raise FormatError(f"unsupported dtype {t.dtype!r}", version=v, tensor=name)
            if not all(isinstance(d, int) and d >= 0 for d in t.shape) or not 0 <= t.nnz <= t.numel:
                raise FormatError(f"bad shape {t.shape} or nnz {t.nnz}", version=v, tensor=name)


def _is_hex16(value: object) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def payload_key(name: str, part: str) -> str:
    return f"{name}{SEP}{part}"


def _metadata(header: VersionHeader) -> dict[str, str]:
    return {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "header": header.to_json()}


def serialize(header: VersionHeader, payload: dict[str, torch.Tensor]) -> bytes:
    """The version file's bytes. `payload`: HF names (anchor) or `name::part` keys (delta)."""
    header.validate()
    return save({k: v.contiguous() for k, v in payload.items()}, metadata=_metadata(header))


def write(path: str, header: VersionHeader, payload: dict[str, torch.Tensor]) -> None:
    header.validate()
    save_file({k: v.contiguous() for k, v in payload.items()}, path, metadata=_metadata(header))


class VersionFile:
    """A local version file, memory-mapped. Validates the container and header on open."""

    def __init__(self, path: str | os.PathLike, *, expect_version: int | None = None):
        self.path = os.fspath(path)
        try:
            self._f = safe_open(self.path, framework="pt", device="cpu")
            meta = self._f.metadata() or {}
            keys = list(self._f.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise FormatError(f"not a readable safetensors file {self.path}: {exc}", version=expect_version) from None
        if meta.get("format") != FORMAT_NAME or "header" not in meta:
            raise FormatError(f"{self.path} is not a vllm-delta version file", version=expect_version)
        self._keys = set(keys)
        self._map: mmap.mmap | None = None  # our own private mapping of the payload (see `_tensor`)
        self._entries: dict[str, dict] = {}
        self._base = 0
        self._parts: dict[str, list[str]] = {}
        for k in keys:
            if SEP in k:
                self._parts.setdefault(k.split(SEP, 1)[0], []).append(k)
        self.header = VersionHeader.from_json(meta["header"], where=self.path)
        if expect_version is not None and self.header.version != expect_version:
            raise FormatError(
                f"file holds version {self.header.version}, expected {expect_version}", version=expect_version
            )
        self._check_payload()

    def _check_payload(self) -> None:
        h = self.header
        for name, entry in h.tensors.items():
            if h.kind == "anchor":
                if name not in self._keys:
                    raise FormatError("anchor lacks the tensor", version=h.version, tensor=name)
                sl = self._f.get_slice(name)
                shape, dtype = list(sl.get_shape()), sl.get_dtype()
                if shape != entry.shape or dtype != entry.dtype:
                    raise ShapeMismatchError(
                        f"stored {dtype}{shape}, header says {entry.dtype}{entry.shape}", version=h.version, tensor=name
                    )

    @property
    def version(self) -> int:
        return self.header.version

    def _tensor(self, key: str) -> torch.Tensor:
        """One stored tensor, a view of a private (copy-on-write) mapping of the file.

        Not `safe_open.get_tensor`: safetensors 0.8's torch path leaks two small Python objects per
        call, which a server applying tens of thousands of versions would accumulate. The container
        was validated by safe_open; its header gives each tensor's dtype, shape and byte range."""
        if self._map is None:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._entries = json.loads(f.read(n))
                self._base = 8 + n
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        entry = self._entries[key]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            return self._f.get_tensor(key)
        start, end = entry["data_offsets"]
        if end == start:
            return torch.empty(entry["shape"], dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - start, offset=self._base + start)
        return raw.view(dtype).reshape(entry["shape"])

    def dense(self, name: str) -> torch.Tensor:
        """An anchor's tensor (memory-mapped)."""
        return self._tensor(name)

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        """A delta's payload for one tensor, by part name (empty if the tensor did not change)."""
        return {k.split(SEP, 1)[1]: self._tensor(k) for k in self._parts.get(name, ())}

    def close(self) -> None:
        # The memory maps go with the last reference (tensors handed out keep theirs alive).
        self._f = None  # type: ignore[assignment]
        self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
