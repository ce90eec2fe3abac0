"""The collector paused around a header parse (vllm_delta/gc_pause.py): no collection runs while a
version of many tensors is opened, and the collector's switch is as it was afterwards, whatever
happened (nesting, threads, errors, a collector disabled by someone else)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from vllm_delta import gc_pause
from vllm_delta.errors import FormatError
from vllm_delta.format import COLUMNS_FORMAT_VERSION, PartInfo, TensorTable, Version, VersionFile, VersionHeader, write


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_threaded_and_failing_pauses_restore_the_switch():
    with gc_pause.paused():
        assert not gc.isenabled()
        with gc_pause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause is still open
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_pause.paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    inside, go = threading.Barrier(3), threading.Event()

    def worker() -> None:
        with gc_pause.paused():
            inside.wait(timeout=10)
            go.wait(timeout=10)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait(timeout=10)
    assert not gc.isenabled()  # both threads hold a pause
    go.set()
    for t in threads:
        t.join(timeout=10)
    assert gc.isenabled()
    gc.disable()  # disabled by someone else before the pause: it stays disabled
    with gc_pause.paused():
        pass
    assert not gc.isenabled()


def _part(tmp_path, k: int, n: int) -> str:
    names = [f"model.layers.{i // 384}.mlp.experts.{i % 384}.up_proj.weight" for i in range(n)]
    table = TensorTable(
        names, [[8, 4]] * n, ["BF16"] * n, ["0" * 16] * n, [1] * n, [{"at": i, "start": 16 * k} for i in range(n)]
    )
    header = VersionHeader(
        version=2, kind="delta", tensors=table, checksum="0" * 16, base=1, base_checksum="0" * 16, codec="chunked",
        format_version=COLUMNS_FORMAT_VERSION, enc={"chunk_elems": 65536, "elems": n},
        part=PartInfo(index=k, count=2, checksum="0" * 16, rows={nm: [4 * k, 4 * k + 4] for nm in names}),
    )  # fmt: skip
    path = str(tmp_path / f"part{k}.safetensors")
    write(path, header, {"::blob": torch.zeros(8, dtype=torch.uint8)})
    return path


def test_an_open_of_many_tensors_runs_one_collection_per_pause_not_one_per_700_objects(tmp_path, monkeypatch):
    """Paused, the objects a parse makes are collected once, when the pause ends (the first
    allocation after it): three pauses (two part files, the merge), at most three collections.
    Without the pause the same open runs dozens."""
    import contextlib

    paths = [_part(tmp_path, k, 20_000) for k in range(2)]
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    def open_version() -> tuple[list[int], Version]:
        gc.collect()
        runs.clear()
        gc.callbacks.append(count)
        try:
            version = Version([VersionFile(p, expect_version=2) for p in paths], expect_version=2)
        finally:
            gc.callbacks.remove(count)
        return list(runs), version

    paused, version = open_version()
    assert len(paused) <= 3 and gc.isenabled() and version.header.nnz == 2 * 20_000
    monkeypatch.setattr(gc_pause, "paused", contextlib.nullcontext)
    unpaused, _ = open_version()
    assert len(unpaused) > 10 * max(1, len(paused)), (paused, unpaused)
    monkeypatch.undo()
    files = [VersionFile(p, expect_version=2) for p in paths]
    with pytest.raises(FormatError):  # a failing merge restores the switch too
        Version([files[0], files[0]], expect_version=2)
    assert gc.isenabled()


def test_the_upload_encodes_a_version_of_many_tensors_with_few_collections(tmp_path, monkeypatch):
    """Publishing versions of 10K tensors (counted on the upload thread only, its second delta: the
    first makes the per-run table template; the training thread's detection is not paused): in format
    5 (the default) the encoding makes no object per tensor, so the upload thread runs (almost) no
    collection, paused or not; in format 4 (an object per tensor: the header's columns, prepared
    tensors, sections) it runs under a tenth of the collections it runs unpaused."""
    import contextlib

    from vllm_delta import Publisher
    from vllm_delta.trainer.options import PublisherOptions, UploadOptions

    torch.manual_seed(0)
    weights = {
        f"model.layers.{i // 100}.mlp.experts.{i % 100}.up_proj.weight": torch.randn(4, 8) for i in range(10_000)
    }
    runs: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and threading.current_thread().name == "vllm-delta-upload":
            runs.append(info["generation"])

    def upload_collections(root: str, header_format: int) -> int:
        options = PublisherOptions(upload=UploadOptions(header_format=header_format))
        with Publisher(root, anchor_every=1000, options=options) as pub:
            pub.publish(weights)
            pub.flush()
            for _ in range(2):
                for t in weights.values():
                    t.add_(torch.randn_like(t) * (torch.rand_like(t) < 0.1))
                gc.collect()
                runs.clear()
                gc.callbacks.append(count)
                try:
                    assert pub.publish(weights).kind == "delta"
                    pub.flush()
                finally:
                    gc.callbacks.remove(count)
        assert gc.isenabled()
        return len(runs)

    arrays = upload_collections(str(tmp_path / "f5"), 5)
    paused = upload_collections(str(tmp_path / "f4-paused"), 4)
    monkeypatch.setattr(gc_pause, "paused", contextlib.nullcontext)
    arrays_unpaused = upload_collections(str(tmp_path / "f5-unpaused"), 5)
    unpaused = upload_collections(str(tmp_path / "f4-unpaused"), 4)
    print(f"upload thread collections: format 5 {arrays} ({arrays_unpaused} unpaused), format 4 {paused} ({unpaused})")
    assert arrays <= 2 and arrays_unpaused <= 2, (arrays, arrays_unpaused)
    assert unpaused >= 20 and paused * 10 < unpaused, (paused, unpaused)
