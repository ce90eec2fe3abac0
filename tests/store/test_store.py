"""DeltaStore behaviour on local stores (plain path and file://). `StoreContract` is reused as is on the
real S3 server by test_store_s3.py: every store operation goes through the same fsspec code."""

from __future__ import annotations

import logging
import os
import time
import uuid

import pytest
import torch

import vllm_delta.store.writes as storewrite_mod
from vllm_delta.bits import int_view
from vllm_delta.checksums import checksum, tensor_sum, to_hex
from vllm_delta.codec import decode
from vllm_delta.errors import (
    FormatError,
    IntegrityError,
    MissingBaseError,
    VersionExistsError,
    VersionNotFoundError,
)
from vllm_delta.format import VersionFile, VersionHeader, write
from vllm_delta.store import LEFTOVER_AGE_S, DeltaStore, VersionRecord
from vllm_delta.store.marks import BadMark, blocked_by, reachable_prefix
from vllm_delta.store.records import StoreHead
from vllm_delta.writer import encode_anchor, encode_delta

# -- helpers shared with test_store_s3.py and test_store_crash.py (imported from here: a name of its own,
# unlike `conftest`, which several test folders have) ------------------------------------------------


class History:
    """bf16 weights of versions 0, 1, 2, ...: each version moves a seeded share of elements by a few ULPs.

    Deterministic in (shapes, seed, density), so a separate process rebuilds the same weights."""

    CHECKPOINT_EVERY = 16  # keeps memory flat over hundreds of versions of larger tensors
    RECENT = 4

    def __init__(self, shapes: dict[str, tuple[int, ...]] | None = None, *, seed: int = 0, density: float = 0.05):
        self.shapes = shapes or {"layer.weight": (64, 48), "layer.bias": (48,)}
        self.seed = seed
        self.density = density
        gen = torch.Generator().manual_seed(seed)
        self._sums: dict[int, tuple[str, dict[str, str]]] = {}
        self._states = {0: {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in self.shapes.items()}}

    def _step(self, state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + version)
        new = {}
        for name, t in state.items():
            bits = int_view(t.clone()).reshape(-1)
            k = max(1, int(bits.numel() * self.density))
            pos = torch.randperm(bits.numel(), generator=gen)[:k]
            step = torch.randint(1, 4, (k,), generator=gen, dtype=torch.int16)
            bits[pos] += step  # a few ULPs up: stays a finite bf16 for these magnitudes
            new[name] = bits.view(torch.bfloat16).reshape(t.shape)
        return new

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        if version in self._states:
            return self._states[version]
        v = max(k for k in self._states if k <= version)
        state = self._states[v]
        while v < version:
            v += 1
            state = self._step(state, v)
            if v % self.CHECKPOINT_EVERY == 0:
                self._states[v] = state
        self._states[version] = state
        recent = sorted(k for k in self._states if k % self.CHECKPOINT_EVERY)
        for k in recent[: -self.RECENT]:
            del self._states[k]
        return state

    def sums(self, version: int) -> tuple[str, dict[str, str]]:
        """(whole-model checksum, per-tensor checksums) of a version, computed once."""
        if version not in self._sums:
            w = self.weights(version)
            self._sums[version] = (checksum(w), {n: to_hex(tensor_sum(t)) for n, t in w.items()})
        return self._sums[version]

    def write_anchor(self, path: str, version: int) -> VersionHeader:
        w = self.weights(version)
        header, payload = encode_anchor(version, w, {n: int(c, 16) for n, c in self.sums(version)[1].items()})
        write(path, header, payload)
        return header

    def write_delta(self, path: str, version: int, base: int, codec: str = "compact") -> VersionHeader:
        old, new = self.weights(base), self.weights(version)
        changes = {}
        for name, t in new.items():
            old_bits, new_bits = int_view(old[name]).reshape(-1), int_view(t).reshape(-1)
            positions = (old_bits != new_bits).nonzero().reshape(-1)
            changes[name] = (positions, new_bits[positions], old_bits[positions])
        header, payload = encode_delta(
            version=version,
            base=base,
            base_checksum=self.sums(base)[0],
            codec=codec,
            shapes={n: tuple(t.shape) for n, t in new.items()},
            dtypes={n: t.dtype for n, t in new.items()},
            changes=changes,
            sums={n: int(c, 16) for n, c in self.sums(version)[1].items()},
        )
        assert header.checksum == self.sums(version)[0]
        write(path, header, payload)
        return header

    def check_file(self, vf: VersionFile) -> None:
        """Every tensor of the file reads back in full and equals this history's weights, bit for bit."""
        h = vf.header
        want = self.weights(h.version)
        assert set(h.tensors) == set(want)
        for name, entry in h.tensors.items():
            if h.kind == "anchor":
                got = vf.dense(name)
                assert to_hex(tensor_sum(got)) == entry.checksum, (h.version, name)
                assert torch.equal(int_view(got), int_view(want[name])), (h.version, name)
                continue
            old_bits = int_view(self.weights(h.base)[name]).reshape(-1)
            bits = old_bits.clone()
            if entry.nnz:
                changes = decode(
                    h.codec, vf.parts(name), entry.enc, numel=entry.numel, nnz=entry.nnz, dtype=entry.torch_dtype
                )
                bits[changes.positions] = changes.new_bits(old_bits[changes.positions])
            assert to_hex(tensor_sum(bits.view(torch.bfloat16))) == entry.checksum, (h.version, name)
            assert torch.equal(bits, int_view(want[name]).reshape(-1)), (h.version, name)


def publish_history(store, history: History, tmp_dir: str, plan: list[tuple[int, int | None]]) -> list:
    """Publish (version, base) pairs from `history` (base None: an anchor). Returns the records."""
    records = []
    for version, base in plan:
        path = os.path.join(tmp_dir, f"v{version}.safetensors")
        if base is None:
            header = history.write_anchor(path, version)
        else:
            header = history.write_delta(path, version, base)
        records.append(store.writer.commit_file(header, path))
    return records


@pytest.fixture
def history() -> History:
    return History()


# anchors at 0, 3 and 6; every delta on the version before it
PLAN = [(0, None), (1, 0), (2, 1), (3, None), (4, 3), (5, 4), (6, None), (7, 6)]


def _versions(plan):
    return [v for v, _ in plan]


class StoreContract:
    """What every backend must do. Subclasses provide `new_store(**kwargs) -> DeltaStore` (a fresh, empty
    store each call) and `plant(store, relpath, data, age_s)` (write a raw file that looks `age_s` old)."""

    @pytest.fixture
    def filled(self, new_store, history, tmp_path):
        store = new_store()
        publish_history(store, history, str(tmp_path), PLAN)
        return store

    # -- helpers that reach past the API, through the store's own filesystem --------------------
    @staticmethod
    def raw_path(store: DeltaStore, relpath: str) -> str:
        return store.root + "/" + relpath

    def rm(self, store: DeltaStore, relpath: str) -> None:
        store.fs.rm_file(self.raw_path(store, relpath))

    def cat(self, store: DeltaStore, relpath: str) -> bytes:
        return store.fs.cat_file(self.raw_path(store, relpath))

    def pipe(self, store: DeltaStore, relpath: str, data: bytes) -> None:
        store.fs.pipe_file(self.raw_path(store, relpath), data)

    def listing(self, store: DeltaStore, folder: str) -> list[str]:
        path = self.raw_path(store, folder)
        store.fs.invalidate_cache(path)
        try:
            return sorted(os.path.basename(p) for p in store.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    # -- the tests ---------------------------------------------------------------------------------
    def test_empty_store(self, new_store):
        store = new_store()
        assert store.versions() == []
        assert store.latest() is None
        assert store.records() == []
        assert store.objects.assets() == []
        assert store.retain(1) == []
        with pytest.raises(VersionNotFoundError):
            store.resolve("latest")
        with pytest.raises(VersionNotFoundError):
            store.resolve(0)
        with pytest.raises(VersionNotFoundError):
            store.record(0)
        with pytest.raises(VersionNotFoundError):
            store.chain(0)
        with pytest.raises(VersionNotFoundError):
            store.local_path(0)

    def test_publish_list_resolve_record(self, filled, history):
        store = filled
        assert store.versions() == _versions(PLAN)
        assert store.latest() == 7
        assert store.resolve("latest") == 7
        assert store.resolve(2) == 2 and store.resolve("2") == 2
        for bad in (8, "8", 100):
            with pytest.raises(VersionNotFoundError):
                store.resolve(bad)
        with pytest.raises(ValueError):
            store.resolve("newest")
        assert [r.version for r in store.records()] == _versions(PLAN)

        anchor, delta = store.record(3), store.record(4)
        assert (anchor.kind, anchor.base, anchor.codec, anchor.base_checksum) == ("anchor", None, None, None)
        assert anchor.nnz == anchor.numel == 64 * 48 + 48 and anchor.density == 1.0
        assert (delta.kind, delta.base, delta.codec) == ("delta", 3, "compact")
        assert 0 < delta.nnz < delta.numel and delta.density == delta.nnz / delta.numel
        assert delta.base_checksum == anchor.checksum
        for v in store.versions():
            rec = store.record(v)
            assert rec.file.startswith("data/") and rec.file.endswith(".safetensors")
            assert store.fs.size(self.raw_path(store, rec.file)) == rec.bytes
            assert time.time() - 600 < rec.created <= time.time()
            with store.open(v) as vf:
                assert vf.header.checksum == rec.checksum
                history.check_file(vf)
        # the record round-trips through its JSON
        assert VersionRecord.from_json(store.record(4).to_json()) == store.record(4)

    def test_chain_and_plan(self, filled):
        store = filled

        def vs(records):
            return [r.version for r in records]

        assert vs(store.chain(0)) == [0]
        assert vs(store.chain(2)) == [0, 1, 2]
        assert vs(store.chain(5)) == [3, 4, 5]
        assert vs(store.plan(None, 5)) == [3, 4, 5]
        assert vs(store.plan(3, 5)) == [4, 5]  # holding the anchor
        assert vs(store.plan(4, 5)) == [5]
        assert vs(store.plan(5, 5)) == []
        assert vs(store.plan(2, 5)) == [3, 4, 5]  # 2 is not on 5's chain: start over from 5's anchor
        assert vs(store.plan(1, 7)) == [6, 7]
        assert vs(store.plan(7, 5)) == [3, 4, 5]  # going back means a full chain
        assert vs(store.plan(6, 7)) == [7]
        with pytest.raises(VersionNotFoundError):
            store.plan(None, 9)
        with pytest.raises(VersionNotFoundError):
            store.plan(9, 9)

    def test_version_exists(self, filled, history, tmp_path):
        store = filled
        data_before = self.listing(store, "data")
        path = str(tmp_path / "again.safetensors")
        header = history.write_anchor(path, 4)
        with pytest.raises(VersionExistsError, match="version 4"):
            store.writer.commit_file(header, path)
        assert store.record(4).kind == "delta"
        assert self.listing(store, "data") == data_before  # refused before any upload

    def test_missing_base(self, filled):
        store = filled
        self.rm(store, "versions/0000000001.json")
        fresh = DeltaStore(store.uri, store.storage_options)
        assert fresh.versions() == [0, 2, 3, 4, 5, 6, 7]
        with pytest.raises(MissingBaseError) as info:
            fresh.chain(2)
        assert info.value.version == 1 and "version 1" in str(info.value)
        with pytest.raises(MissingBaseError):
            fresh.plan(None, 2)
        assert [r.version for r in fresh.chain(7)] == [6, 7]
        # the store that had cached record 1 learns of its removal at its next listing
        assert store.versions() == [0, 2, 3, 4, 5, 6, 7]
        with pytest.raises(MissingBaseError):
            store.chain(2)

    def test_broken_records_are_ignored(self, filled, caplog):
        store = filled
        good = self.cat(store, "versions/0000000003.json")
        self.pipe(store, "versions/0000000008.json", good[: len(good) // 2])  # torn write
        self.pipe(store, "versions/0000000009.json", good)  # names version 9, describes 3
        self.pipe(store, "versions/0000000010.json", b'{"format": "something-else"}')
        self.pipe(store, "versions/notes.txt", b"hello")
        fresh = DeltaStore(store.uri, store.storage_options)
        with caplog.at_level(logging.WARNING, logger="vllm_delta.store"):
            assert fresh.versions() == _versions(PLAN)
        assert fresh.latest() == 7
        warned = caplog.text
        for name in ("0000000008.json", "0000000009.json", "0000000010.json", "notes.txt"):
            assert name in warned
        for v in (8, 9, 10):
            with pytest.raises(VersionNotFoundError):
                fresh.record(v)
        with pytest.raises(FormatError):
            VersionRecord.from_json(good[:-5])

    def test_truncated_data_is_detected(self, filled):
        store = filled
        rec = store.record(3)
        data = self.cat(store, rec.file)
        self.pipe(store, rec.file, data[: len(data) - 100])
        fresh = DeltaStore(store.uri, store.storage_options)
        with pytest.raises(IntegrityError, match=r"version 3\b") as info:
            fresh.local_path(3)
        assert info.value.version == 3
        with pytest.raises(IntegrityError):
            fresh.open(3)
        # same size, other bytes: the record's checksum catches a swapped file
        other = self.cat(store, store.record(0).file)
        if len(other) == len(data):
            self.pipe(store, rec.file, other)
            with pytest.raises(IntegrityError):
                DeltaStore(store.uri, store.storage_options).open(3)

    def test_missing_data_file(self, filled):
        store = filled
        self.rm(store, store.record(2).file)
        with pytest.raises(IntegrityError, match="missing"):
            DeltaStore(store.uri, store.storage_options).local_path(2)

    def test_retain(self, filled):
        store = filled
        assert store.retain(3) == []
        assert store.retain(2) == [0, 1, 2]
        assert store.versions() == [3, 4, 5, 6, 7]
        kept_files = sorted(os.path.basename(store.record(v).file) for v in store.versions())
        assert self.listing(store, "data") == kept_files
        assert self.listing(store, "versions") == [f"{v:010d}.json" for v in range(3, 8)]
        with pytest.raises(VersionNotFoundError):
            store.record(1)
        assert [r.version for r in store.plan(1, 7)] == [6, 7]
        assert store.retain(2) == []
        assert store.retain(1) == [3, 4, 5]
        assert store.versions() == [6, 7]
        with pytest.raises(ValueError):
            store.retain(0)

    def test_retain_keeps_the_chains_of_kept_versions(self, new_store, history, tmp_path):
        store = new_store()
        # 3 is a delta on 1, although anchor 2 came in between: keeping 3 keeps 0 and 1
        publish_history(store, history, str(tmp_path), [(0, None), (1, 0), (2, None), (3, 1)])
        assert store.retain(1) == []
        assert store.versions() == [0, 1, 2, 3]
        publish_history(store, history, str(tmp_path), [(4, None), (5, 4)])
        assert store.retain(1) == [0, 1, 2, 3]
        assert store.versions() == [4, 5]

    def test_retain_removes_old_leftovers_only(self, filled):
        store = filled
        committed = self.listing(store, "data")
        hour = LEFTOVER_AGE_S
        self.plant(store, "data/0000000008.anchor.0123456789abcdef.safetensors", b"x" * 10, age_s=hour + 600)
        self.plant(store, "data/.tmp-0123456789abcdef.safetensors", b"x", age_s=hour + 600)
        self.plant(store, "versions/.tmp-0123456789abcdef.json", b"{", age_s=hour + 600)
        self.plant(store, "data/0000000009.delta.fedcba9876543210.safetensors", b"y", age_s=60)  # in flight
        self.plant(store, "data/README.txt", b"not ours", age_s=hour + 600)
        assert store.retain(5) == []
        assert self.listing(store, "data") == sorted(
            committed + ["0000000009.delta.fedcba9876543210.safetensors", "README.txt"]
        )
        assert self.listing(store, "versions") == [f"{v:010d}.json" for v in _versions(PLAN)]
        assert store.versions() == _versions(PLAN)

    def test_orphan_data_is_invisible(self, filled):
        # what a publisher killed between its upload and its commit leaves behind
        store = filled
        data = self.cat(store, store.record(7).file)
        self.pipe(store, "data/0000000008.delta.00000000000000aa.safetensors", data)
        self.pipe(store, "versions/.tmp-00000000000000aa.json", store.record(7).to_json().encode())
        assert DeltaStore(store.uri, store.storage_options).versions() == _versions(PLAN)

    def test_move_hands_the_file_over(self, new_store, history, tmp_path):
        store = new_store()
        path = str(tmp_path / "v0.safetensors")
        header = history.write_anchor(path, 0)
        rec = store.writer.commit_file(header, path, move=True)
        assert not os.path.exists(path)
        assert store.versions() == [0]
        with store.open(0) as vf:
            history.check_file(vf)
        assert rec == store.record(0)

    def test_publish_refuses_a_file_that_is_not_its_header(self, new_store, history, tmp_path):
        store = new_store()
        path = str(tmp_path / "v0.safetensors")
        history.write_anchor(path, 0)
        header1 = history.write_anchor(str(tmp_path / "v1.safetensors"), 1)
        with pytest.raises(FormatError):  # the file holds version 0
            store.writer.commit_file(header1, path)
        header1.version = 0
        with pytest.raises(IntegrityError):  # right version, other weights
            store.writer.commit_file(header1, path)
        truncated = str(tmp_path / "cut.safetensors")
        with open(path, "rb") as src, open(truncated, "wb") as dst:
            dst.write(src.read()[:-64])
        with pytest.raises(IntegrityError):
            store.writer.commit_file(header1, truncated)
        assert store.versions() == []
        assert self.listing(store, "data") == []

    def test_listing_is_fresh_across_instances(self, new_store, history, tmp_path):
        writer = new_store()
        # its own filesystem instance, as in another process: fsspec would otherwise share the writer's caches
        reader = DeltaStore(writer.uri, {**writer.storage_options, "skip_instance_cache": True})
        assert reader.versions() == []
        publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
        assert reader.versions() == [0, 1] and reader.latest() == 1
        publish_history(writer, history, str(tmp_path), [(2, None)])
        assert reader.latest() == 2
        writer.retain(1)
        assert reader.versions() == [2]
        with pytest.raises(VersionNotFoundError):
            reader.resolve(0)

    def test_assets(self, new_store):
        store = new_store()
        store.objects.put_asset("config.json", b'{"a": 1}')
        store.objects.put_asset("tokenizer/tokenizer.json", b"{}")
        store.objects.put_asset("config.json", b'{"a": 2}')  # replaced whole
        assert store.objects.assets() == ["config.json", "tokenizer/tokenizer.json"]
        assert store.objects.get_asset("config.json") == b'{"a": 2}'
        assert store.objects.get_asset("tokenizer/tokenizer.json") == b"{}"
        with pytest.raises(FileNotFoundError):
            store.objects.get_asset("missing.json")
        for bad in ("", "../x", "/abs", "a//b", "a/./b", ".tmp-x", "a\\b"):
            with pytest.raises(ValueError):
                store.objects.put_asset(bad, b"")
        assert store.versions() == []  # assets are not versions

    # -- bad-version marks (marks.py) -----------------------------------------------------------------
    def test_mark_bad_once_and_what_it_blocks(self, filled, caplog):
        assert filled.marks() == {}
        mark = filled.mark_bad(4, "diverged: loss spike", by="test")
        assert (mark.version, mark.checksum, mark.by) == (4, filled.record(4).checksum, "test")
        assert filled.marks() == {4: mark}
        assert filled.mark_bad(4, "another reason") == mark  # written once: the first mark stays
        assert self.listing(filled, "bad") == ["0000000004.json"]
        marks = filled.marks()
        assert blocked_by(filled.chain(4), marks) == mark and blocked_by(filled.chain(5), marks) == mark
        assert blocked_by(filled.chain(3), marks) is None and blocked_by(filled.chain(7), marks) is None
        assert [r.version for r in reachable_prefix(filled.chain(5), marks)] == [3]
        # bad input changes nothing
        with pytest.raises(VersionNotFoundError):
            filled.mark_bad(99, "no such version")
        for reason in ("", "   ", "x" * 1001, None):
            with pytest.raises(ValueError):
                filled.mark_bad(5, reason)  # type: ignore[arg-type]
        assert self.listing(filled, "bad") == ["0000000004.json"]
        # a mark left by an earlier run of the store (another checksum) blocks nothing
        self.pipe(filled, "bad/0000000002.json", BadMark(2, "0" * 16, "old run", 0.0, "x").to_json().encode())
        assert blocked_by(filled.chain(2), filled.marks()) is None
        # garbage is skipped with a warning, never hiding the other marks
        self.pipe(filled, "bad/0000000001.json", b"not json")
        self.pipe(filled, "bad/0000000000.json", BadMark(5, "0" * 16, "wrong name", 0.0, "x").to_json().encode())
        self.pipe(filled, "bad/notes.txt", b"x")
        with caplog.at_level(logging.WARNING):
            assert sorted(filled.marks()) == [2, 4]
        assert "not a mark name" in caplog.text and "marks version 5" in caplog.text
        # retention removes a mark only once its version is gone
        assert filled.retain(1) == [0, 1, 2, 3, 4, 5]
        assert self.listing(filled, "bad") == ["0000000000.json", "0000000001.json", "notes.txt"]

    # -- the head and polls that stay O(1) (polling.py) ------------------------------------------------
    def test_polls_do_not_list_the_versions(self, new_store, history, tmp_path):
        writer = new_store()
        reader = DeltaStore(writer.uri, {**writer.storage_options, "skip_instance_cache": True})
        publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
        assert reader.latest() == 1  # the first poll lists everything
        assert writer.head() is not None and writer.head().version == 1  # type: ignore[union-attr]
        listed = reader.record_reader.poller.counts.full_listings
        folders: list[str] = []
        real_ls = reader.io.ls
        reader.io.ls = lambda folder: folders.append(folder) or real_ls(folder)  # type: ignore[method-assign]
        publish_history(writer, history, str(tmp_path), [(2, 1), (3, 2)])
        assert reader.latest() == 3 and reader.latest() == 3
        # A head that lags (its writer died between the record and the head): the forward check.
        lagging = writer.head()
        publish_history(writer, history, str(tmp_path), [(4, 3)])
        self.pipe(writer, "head.json", lagging.to_json().encode())  # type: ignore[union-attr]
        assert reader.latest() == 4
        polls = reader.record_reader.poller.counts
        assert folders == [] and polls.full_listings == listed, "a poll listed the versions"
        # Lagging on a gap in the numbering: the next full listing finds it.
        publish_history(writer, history, str(tmp_path), [(10, None)])
        self.pipe(writer, "head.json", lagging.to_json().encode())  # type: ignore[union-attr]
        assert reader.latest() == 4
        reader.record_reader.poller.full_listing_s = 0.0
        assert reader.latest() == 10
        reader.record_reader.poller.full_listing_s = 60.0
        # A head the records do not confirm (another run's checksum, a version without a record): a
        # full listing, and the right answer.
        listed = reader.record_reader.poller.counts.full_listings
        for version, check in ((10, "0" * 16), (20, writer.record(10).checksum)):
            self.pipe(writer, "head.json", StoreHead(version, check, time.time()).to_json().encode())
            assert reader.latest() == 10
        assert reader.record_reader.poller.counts.full_listings == listed + 2
        # A head never moves back: committing an older version leaves it at the newest.
        publish_history(writer, history, str(tmp_path), [(11, 10), (7, None)])
        assert writer.head().version == 11  # type: ignore[union-attr]
        assert reader.latest() == 11
        # The newest version disappears while the head still names it (records removed by hand).
        self.rm(writer, "versions/0000000011.json")
        assert reader.latest() == 10

    def test_stores_without_a_head_are_read_as_before(self, new_store, history, tmp_path, caplog):
        writer = new_store()
        reader = DeltaStore(writer.uri, {**writer.storage_options, "skip_instance_cache": True})
        publish_history(writer, history, str(tmp_path), [(0, None), (1, 0)])
        self.rm(writer, "head.json")  # what an older publisher leaves
        assert reader.latest() == 1 and reader.head() is None
        publish_history(writer, history, str(tmp_path), [(2, 1)])
        self.rm(writer, "head.json")
        listed = reader.record_reader.poller.counts.full_listings
        assert reader.latest() == 2
        # Without a head, S3 polls with StartAfter; other stores list versions/ as before heads.
        assert reader.record_reader.poller.counts.full_listings == listed + (0 if writer.io.is_s3 else 1)
        self.pipe(writer, "head.json", b"{not a head")
        with caplog.at_level(logging.WARNING):
            assert reader.latest() == 2
            publish_history(writer, history, str(tmp_path), [(3, 2)])  # a garbage head is replaced
        assert writer.head() is not None and reader.latest() == 3
        if not writer.io.is_s3:
            assert "unreadable store head" in caplog.text


class LocalContract(StoreContract):
    scheme = ""

    @pytest.fixture
    def new_store(self, tmp_path):
        def make(**kwargs) -> DeltaStore:
            root = tmp_path / f"store-{uuid.uuid4().hex[:8]}"
            return DeltaStore(f"{self.scheme}{root}", **kwargs)

        return make

    def plant(self, store: DeltaStore, relpath: str, data: bytes, age_s: float) -> None:
        path = os.path.join(store.root, relpath)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        then = time.time() - age_s
        os.utime(path, (then, then))


class TestPlainPath(LocalContract):
    scheme = ""


class TestFileURI(LocalContract):
    scheme = "file://"


# -- local-only behaviour -------------------------------------------------------------------------


def test_uri_normalization(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = DeltaStore("runs/one/")
    assert plain.uri == str(tmp_path / "runs" / "one") and plain.is_local
    as_uri = DeltaStore(f"file://{tmp_path}/runs/one/")
    assert as_uri.uri == f"file://{tmp_path}/runs/one" and as_uri.is_local
    assert as_uri.root == plain.root


def test_plain_path_and_file_uri_see_the_same_store(tmp_path, history):
    a = DeltaStore(str(tmp_path / "s"))
    publish_history(a, history, str(tmp_path), [(0, None), (1, 0)])
    b = DeltaStore(f"file://{tmp_path / 's'}")
    assert b.versions() == [0, 1]
    assert b.local_path(1) == a.local_path(1)  # local stores hand out the file itself


def test_local_layout_and_modes(tmp_path, history):
    store = DeltaStore(str(tmp_path / "s"))
    src = str(tmp_path / "v0.safetensors")
    os.close(os.open(src, os.O_CREAT | os.O_WRONLY, 0o600))  # like mkstemp
    header = history.write_anchor(src, 0)
    os.chmod(src, 0o600)
    rec = store.writer.commit_file(header, src, move=True)
    assert sorted(os.listdir(store.root)) == ["data", "head.json", "versions"]
    assert os.listdir(os.path.join(store.root, "versions")) == ["0000000000.json"]
    assert os.listdir(os.path.join(store.root, "data")) == [os.path.basename(rec.file)]
    for path in (rec.file, "head.json"):
        mode = os.stat(os.path.join(store.root, path)).st_mode & 0o777
        assert mode & 0o044 == 0o044 & ~storewrite_mod._UMASK  # readable by a server running as another user


def test_records_are_cached(tmp_path, history):
    store = DeltaStore(str(tmp_path / "s"))
    publish_history(store, history, str(tmp_path), [(0, None)])
    rec = store.record(0)
    os.remove(os.path.join(store.root, "versions", "0000000000.json"))
    assert store.record(0) is rec  # immutable records are not re-read...
    assert store.versions() == []  # ...but a listing notices that one is gone
    with pytest.raises(VersionNotFoundError):
        store.record(0)


def test_concurrent_publishers_of_one_version(tmp_path):
    """Two publishers race for the same version number: exactly one wins, the other gets VersionExistsError."""
    import threading

    root = str(tmp_path / "s")
    histories = [History(seed=1), History(seed=2)]
    paths = [str(tmp_path / f"p{i}.safetensors") for i in range(2)]
    headers = [h.write_anchor(p, 0) for h, p in zip(histories, paths)]
    outcomes = []
    barrier = threading.Barrier(2)

    def publish(i):
        store = DeltaStore(root)
        barrier.wait()
        try:
            outcomes.append(store.writer.commit_file(headers[i], paths[i]).checksum)
        except VersionExistsError:
            outcomes.append("exists")

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    winners = [o for o in outcomes if o != "exists"]
    assert len(outcomes) == 2 and len(winners) == 1
    store = DeltaStore(root)
    assert store.versions() == [0]
    assert store.record(0).checksum == winners[0]
    store.open(0).close()
    assert len(os.listdir(os.path.join(root, "data"))) == 1  # the loser cleaned up its data


def test_hf_bucket_uri_resolves_offline():
    """hf://buckets/<ns>/<bucket>/<prefix> goes to huggingface_hub's HfFileSystem, on the same fsspec code.
    Nothing here reaches the Hub (it can't be reached from the test machines)."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import HfFileSystem
    from huggingface_hub.utils import parse_hf_uri

    store = DeltaStore("hf://buckets/some-org/some-bucket/runs/one/", storage_options={"token": False})
    assert isinstance(store.fs, HfFileSystem)
    assert not store.is_local
    assert store.uri == "hf://buckets/some-org/some-bucket/runs/one"
    assert store.root == "buckets/some-org/some-bucket/runs/one"
    # the bucket grammar HfFileSystem.resolve_path uses, without its network call (bucket_info)
    uri = parse_hf_uri("hf://" + store.root + "/versions/0000000001.json")
    assert (uri.type, uri.id, uri.path_in_repo) == (
        "bucket",
        "some-org/some-bucket",
        "runs/one/versions/0000000001.json",
    )


def test_version_file_helpers_agree(tmp_path, history):
    # guards the test helpers themselves: a delta written by History replays to History's weights
    path = str(tmp_path / "d.safetensors")
    history.write_delta(path, 2, 0)
    with VersionFile(path) as vf:
        history.check_file(vf)
        assert vf.header.base == 0
