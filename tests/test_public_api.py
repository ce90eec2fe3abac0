"""Every public name, as a user calls it: `from vllm_delta import X` in a fresh interpreter, then use it.

(The lazy package attributes once returned the `materialize` *module* instead of the function: only a
fresh interpreter, where nothing has imported the submodules yet, shows that kind of bug.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import vllm_delta

pytestmark = pytest.mark.vllm_objects  # make check-vllm-next runs them against the newest vLLM

# What each name must do when called in a fresh interpreter. `root` is a temporary directory.
USES = {
    "Publisher": """
        import torch
        with Publisher(root + "/store", anchor_every=2) as pub:
            info = pub.publish({"w": torch.ones(4, 4, dtype=torch.bfloat16)}, version=0)
        assert info.kind == "anchor" and info.version == 0, info
    """,
    "PublishInfo": """
        import dataclasses
        assert dataclasses.is_dataclass(PublishInfo) and "checksum" in {f.name for f in dataclasses.fields(PublishInfo)}
    """,
    "checksum": """
        import torch
        zeros = torch.zeros(3, dtype=torch.bfloat16)
        assert checksum({"w": zeros}) == checksum([("w", zeros)])
        assert len(checksum({"w": torch.ones(2, dtype=torch.bfloat16)})) == 16
    """,
    "checkpoint_tensors": """
        import torch
        names = [n for n, _ in checkpoint_tensors(torch.nn.Linear(3, 2))]
        assert names == ["weight", "bias"], names
    """,
    "DeltaStore": """
        store = DeltaStore(root + "/empty")
        assert store.versions() == []
    """,
    "materialize": """
        import os, torch
        from vllm_delta import Publisher
        with Publisher(root + "/s") as pub:
            pub.publish({"w": torch.ones(4, dtype=torch.bfloat16)}, version=0)
        from vllm_delta import DeltaStore
        out = materialize(DeltaStore(root + "/s"), 0, root + "/out", progress=False)
        assert os.path.exists(os.path.join(out, "model.safetensors")), os.listdir(out)
    """,
    "replay": """
        import torch
        from vllm_delta import DeltaStore, Publisher
        w = torch.arange(6, dtype=torch.bfloat16)
        with Publisher(root + "/r") as pub:
            pub.publish({"w": w}, version=0)
        version, tensors = replay(DeltaStore(root + "/r"), "latest")
        assert version == 0 and torch.equal(tensors["w"].view(torch.int16), w.view(torch.int16))
    """,
    "ShardedTensor": """
        import torch
        from vllm_delta import DeltaStore, Publisher, replay
        full = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
        with Publisher(root + "/h") as pub:  # one rank owning every row: the whole tensor
            pub.publish({"w": ShardedTensor(full.clone(), (4, 3), 0)}, version=0)
        _, tensors = replay(DeltaStore(root + "/h"), 0)
        assert torch.equal(tensors["w"].view(torch.int16), full.view(torch.int16))
    """,
    "__version__": """
        assert isinstance(__version__, str) and __version__.count(".") == 2
    """,
}


def test_every_public_name_has_a_use():
    assert set(USES) == set(vllm_delta.__all__)


@pytest.mark.parametrize("name", sorted(USES))
def test_public_name_in_a_fresh_interpreter(name, tmp_path):
    script = f"from vllm_delta import {name}\nroot = {str(tmp_path)!r}\n" + textwrap.dedent(USES[name])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
