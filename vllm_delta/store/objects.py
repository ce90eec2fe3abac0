"""The small files a store keeps beside its versions: assets (config.json, tokenizer files: `assets/`)
and small mutable objects under a folder of their own (the replica ledger's `replicas/<id>.json`, a
mirror's lease), each written whole and atomically (readers see the old one or the new one), read and
listed afresh (no listing cache: they change under a reader)."""

from __future__ import annotations

from .fs import StoreFS, basename
from .records import ASSETS_DIR, TMP_PREFIX, asset_parts, check_object_name


class StoreObjects:
    """A store's assets and small objects (`DeltaStore.objects`)."""

    def __init__(self, io: StoreFS):
        self.io = io

    @property
    def uri(self) -> str:
        return self.io.uri

    # -- assets ------------------------------------------------------------------------------------
    def put_asset(self, name: str, data: bytes) -> None:
        """Store a small file (config.json, tokenizer files) atomically, replacing an older one."""
        self.io.write_small(self.io.path(ASSETS_DIR, *asset_parts(name)), data)

    def get_asset(self, name: str) -> bytes:
        path = self.io.path(ASSETS_DIR, *asset_parts(name))
        try:
            return self.io.cat(path, f"reading {path}")
        except FileNotFoundError:
            raise FileNotFoundError(f"no asset {name!r} in store {self.io.uri}") from None

    def assets(self) -> list[str]:
        names = self.io.find(ASSETS_DIR)
        return sorted(n for n in names if not basename(n).startswith(TMP_PREFIX))

    # -- small mutable objects ---------------------------------------------------------------------
    def write(self, folder: str, name: str, data: bytes) -> None:
        """A small mutable object at `<folder>/<name>` under the store root (e.g. `replicas/<id>.json`),
        written atomically (readers see the old or the new one, whole)."""
        self.io.write_small(self._path(folder, name), data)

    def read(self, folder: str, name: str) -> bytes:
        """An object as it is now (listing caches bypassed: it may have changed or just appeared)."""
        path = self._path(folder, name)
        return self.io.cat(path, f"reading {path}")

    def names(self, folder: str) -> list[str]:
        """Names of the committed objects directly in `folder` (temporary files skipped), listed afresh."""
        check_object_name(folder, "x")
        names = (basename(e["name"]) for e in self.io.ls(folder))
        return sorted(n for n in names if not n.startswith(TMP_PREFIX))

    def delete(self, folder: str, name: str) -> None:
        self.io.remove(self._path(folder, name), f"deleting {folder}/{name}")

    def _path(self, folder: str, name: str) -> str:
        check_object_name(folder, name)
        return self.io.path(folder, name)


__all__ = ["StoreObjects"]
