"""The backward path through a real store (issue 36): which deltas a server at S undoes to reach an older N,
and every reason there is none (an anchor in between, a codec that stores new values, a file gone, N not
on S's chain, a store rewritten), each a 409 saying why, before anything is read or staged. Then the
successor rule (shared/plan.py, no vLLM needed): backward without `allow_reanchor`, the replay with it
where no backward path exists."""

from __future__ import annotations

import os

import pytest
import torch
from test_follower import make_weights, step

from vllm_delta import DeltaStore, Publisher
from vllm_delta.errors import NotSuccessorError
from vllm_delta.vllm.shared.plan import plan_update


def published(path, codec: str = "chunked", versions: int = 8, anchor_every: int = 4) -> tuple[DeltaStore, dict]:
    store = DeltaStore(str(path))
    w = make_weights(3)
    with Publisher(store.uri, anchor_every=anchor_every, codec=codec) as pub:
        for v in range(versions):
            step(w, v)
            pub.publish(w, version=v)
    return store, {r.version: r.checksum for r in store.records()}


def test_the_path_back_along_the_chain(tmp_path):
    store, cs = published(tmp_path / "s")  # anchors 0 and 4
    assert {v: store.record(v).kind for v in (0, 4)} == {0: "anchor", 4: "anchor"}
    path = store.undo_path(6, cs[6], 4)
    assert [r.version for r in path.undone] == [6, 5] and path.target.version == 4
    path = store.undo_path(3, cs[3], 1)
    assert [r.version for r in path.undone] == [3, 2] and path.target.version == 1
    assert [r.version for r in store.undo_path(3, None, 0).undone] == [3, 2, 1]


@pytest.mark.parametrize(
    "held,target,why",
    [
        (5, 3, "version 4 is an anchor"),
        (4, 3, "version 4 is an anchor"),
        (7, 2, "version 4 is an anchor"),
    ],
)
def test_no_path_through_an_anchor(tmp_path, held, target, why):
    store, cs = published(tmp_path / "s")
    with pytest.raises(NotSuccessorError, match=why) as exc:
        store.undo_path(held, cs[held], target)
    assert f"version {target} is older than the served version {held}" in str(exc.value)


def test_no_path_for_a_codec_without_differences(tmp_path):
    store, cs = published(tmp_path / "s", codec="raw")
    with pytest.raises(NotSuccessorError, match="coded with 'raw', which stores new values"):
        store.undo_path(3, cs[3], 2)


def test_no_path_when_a_file_is_gone_or_the_store_was_rewritten(tmp_path):
    store, cs = published(tmp_path / "s")
    os.remove(os.path.join(store.root, store.record(2).file))  # type: ignore[arg-type]
    with pytest.raises(NotSuccessorError, match=r"data file data/.*of version 2 is gone"):
        store.undo_path(3, cs[3], 1)
    with pytest.raises(NotSuccessorError, match=r"its data file data/.* is gone"):
        store.undo_path(3, cs[3], 2)  # the target's file: its header is what 2's weights are
    assert [r.version for r in store.undo_path(7, cs[7], 5).undone] == [7, 6]  # elsewhere, paths remain
    with pytest.raises(NotSuccessorError, match="was the store rewritten"):
        store.undo_path(7, "0123456789abcdef", 5)
    with pytest.raises(NotSuccessorError, match="the served version 9 is no longer in the store"):
        store.undo_path(9, None, 5)


def test_the_successor_rule_goes_back_without_allow_reanchor(tmp_path):
    store, cs = published(tmp_path / "s")
    plan = plan_update(store, 6, cs[6], 5)
    assert (plan.versions, plan.undone, plan.target, plan.reanchor) == ([6], [6], 5, False)
    assert plan.undo_to is not None and plan.undo_to.version == 5
    assert [r.version for r in plan.files] == [6, 5] and plan.nnz == store.record(6).nnz
    plan = plan_update(store, 3, cs[3], 1)
    assert (plan.versions, plan.target) == ([3, 2], 1) and plan.bytes == sum(store.record(v).bytes for v in (3, 2))
    # No backward path: 409 saying why, and how to replay instead; with allow_reanchor, the replay.
    with pytest.raises(NotSuccessorError, match='version 4 is an anchor.*send "allow_reanchor": true'):
        plan_update(store, 5, cs[5], 3)
    plan = plan_update(store, 5, cs[5], 3, allow_reanchor=True)
    assert (plan.versions, plan.reanchor, plan.undo_to) == ([0, 1, 2, 3], True, None)
    # allow_reanchor where a backward path exists: the backward path (O(changes))
    assert plan_update(store, 6, cs[6], 4, allow_reanchor=True).undone == [6, 5]
    assert plan_update(store, 5, cs[5], 6).undone == []  # forward, as before
    with pytest.raises(NotSuccessorError, match="rewritten"):
        plan_update(store, 6, "0123456789abcdef", 5)


def test_undone_versions_replay_to_the_target_image(tmp_path):
    """What the path names, undone with the reader's own decode (codec.Changes.old_bits), gives the
    target's image: the same reading of the files that the apply engine makes on the device."""
    from vllm_delta import codec as codecs
    from vllm_delta.bits import int_view
    from vllm_delta.reconstruct import replay

    store, cs = published(tmp_path / "s")
    _, image = replay(store, 7)
    images = {n: int_view(t.clone()).reshape(-1) for n, t in image.items()}
    for rec in store.undo_path(7, cs[7], 4).undone:
        vf = store.open(rec.version)
        for name, entry in vf.header.tensors.items():
            for piece in vf.pieces(name):
                ch = codecs.decode(
                    vf.header.codec or "",
                    piece.payload,
                    piece.enc,
                    numel=entry.numel,
                    nnz=piece.nnz,
                    dtype=entry.torch_dtype,
                    ctx={},
                )
                flat = images[name]
                flat[ch.positions] = ch.old_bits(flat[ch.positions])
    _, want = replay(store, 4)
    for name, t in want.items():
        assert torch.equal(images[name], int_view(t).reshape(-1)), name
