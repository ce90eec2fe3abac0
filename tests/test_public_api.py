"""Every public name, as a user calls it: `from vllm_delta import X` in a fresh interpreter, then use it.

(The lazy package attributes once returned the `materialize` *module* instead of the function: only a
fresh interpreter, where nothing has imported the submodules yet, shows that kind of bug.)

The interpreters are forked from one that has imported torch and nothing of vllm_delta (FRESH): each is
fresh as far as vllm_delta is concerned, without paying torch's import ten times."""

from __future__ import annotations

import json
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


# One interpreter imports torch, checks that nothing of vllm_delta is loaded, then forks one child per
# script; a child runs its script and exits 0, or prints the traceback and exits 1.
FRESH = """
import json, os, sys, traceback
import torch  # noqa: F401 - what every use needs; vllm_delta stays unimported in this parent
assert not [m for m in sys.modules if m.split(".")[0] == "vllm_delta"], "vllm_delta imported before the fork"
scripts = json.loads(sys.argv[1])
results = {}
for name, script in scripts.items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 0
        try:
            exec(compile(script, name, "exec"), {"__name__": "__main__"})
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        err = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    results[name] = {"code": os.waitstatus_to_exitcode(status), "stderr": err}
print("RESULTS " + json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def fresh_runs(tmp_path_factory) -> dict:
    scripts = {
        name: f"from vllm_delta import {name}\nroot = {str(tmp_path_factory.mktemp(name))!r}\n" + textwrap.dedent(use)
        for name, use in USES.items()
    }
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, json.dumps(scripts)], capture_output=True, text=True, timeout=600
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(line[len("RESULTS ") :])


@pytest.mark.parametrize("name", sorted(USES))
def test_public_name_in_a_fresh_interpreter(name, fresh_runs):
    run = fresh_runs[name]
    assert run["code"] == 0, run["stderr"][-3000:]
