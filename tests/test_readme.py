"""The README's Python snippets and store commands, run as a reader would run them (README.md, extracted
at test time: a refactor that breaks a snippet fails here). Local stores stand in for /data and /tmp,
the session's S3 server for s3://bucket; each substitution must still match the README
(readme_snippets.substitute). The TRL snippet needs a running server: integrations/test_trl.py runs it
against that module's server."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from readme_snippets import one_snippet, run_python, snippets

from vllm_delta import DeltaStore, Publisher
from vllm_delta.cli import main as cli_main
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.training import build_master_model, train_steps

SPEC = TinyModelSpec(arch="qwen3", num_heads=2, num_kv_heads=1, vocab_size=500)

# The first line of every Python block of the README, and where it runs. A new block needs a test.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PYTHON_SNIPPETS = {
    "from vllm_delta import Publisher, checkpoint_tensors, checksum": "test_readme.py::test_trainer_side_snippet",
    'Publisher("s3://bucket/run1", anchor_every=20,': "test_readme.py::test_publisher_storage_options_snippet",
    "from vllm_delta.trainer import DetectOptions, PublisherOptions, ShardingOptions, StoreOptions, UploadOptions": (
        "test_readme.py::test_publisher_options_snippet"
    ),
    "# train_fsdp.py -- torchrun --nproc-per-node 2 train_fsdp.py": "test_readme.py::test_sharded_trainer_snippet",
    "from vllm_delta import Publisher": "test_readme.py::test_signing_snippets",
    "from vllm_delta.integrations.trl import DeltaGRPOTrainer as GRPOTrainer      # instead of trl's": (
        "integrations/test_trl.py::test_the_readme_trl_snippet_builds_a_trainer_for_this_server"
    ),
}


def test_every_python_snippet_has_a_test():
    found = [s.first for s in snippets("python")]
    assert sorted(found) == sorted(PYTHON_SNIPPETS), "a README Python block without a test (or a test without one)"
    for snippet in snippets("python"):
        compile(snippet.code, f"README.md:{snippet.line}", "exec")  # every block is valid Python as written
    here = os.path.dirname(__file__)
    for where in PYTHON_SNIPPETS.values():
        path, name = where.split("::")
        with open(os.path.join(here, path)) as f:
            assert f"def {name}(" in f.read(), where


def _trainer_namespace(num_steps: int) -> dict:
    """What the trainer snippet leaves to the reader: a model, a training step, a step count, torch."""
    model = build_master_model(SPEC, seed=0)
    steps = train_steps(model, num_steps, lr=1e-5, seed=0)
    return {"torch": torch, "model": model, "train_step": lambda m: next(steps), "num_steps": num_steps}


def test_trainer_side_snippet(tmp_path):
    snippet = one_snippet("python", "checkpoint_tensors(model)")
    ran = run_python(snippet, _trainer_namespace(3), {"file:///data/run1": f"file://{tmp_path}/run1"})
    printed = [line.split() for line in ran.stdout.splitlines()]
    assert [p[:2] for p in printed] == [["0", "anchor"], ["1", "delta"], ["2", "delta"]], ran.stdout
    store = DeltaStore(str(tmp_path / "run1"))
    assert store.versions() == [0, 1, 2]
    assert [p[3] for p in printed] == [store.record(v).checksum for v in range(3)]
    # The snippet's last line: what a server reports for the trainer's weights, the last version's checksum.
    assert ran.value == store.record(2).checksum


def _publishes_to(pub: Publisher, uri: str, s3_server) -> None:
    """The Publisher a snippet built publishes a version that the store then holds."""
    try:
        info = pub.publish(build_master_model(SPEC, seed=0), version=0)
        pub.flush()
    finally:
        pub.close()
    assert DeltaStore(uri, s3_server.storage_options).record(0).checksum == info.checksum


def test_publisher_storage_options_snippet(s3_server):
    snippet = one_snippet("python", 'storage_options={"key"')
    uri = s3_server.uri("readme-storage-options")
    fsspec_options = 'storage_options={"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}'
    ran = run_python(
        snippet,
        {"Publisher": Publisher, "S3_OPTIONS": s3_server.storage_options},  # Publisher: the block above
        {'"s3://bucket/run1"': repr(uri), fsspec_options: "storage_options=S3_OPTIONS"},
    )
    _publishes_to(ran.value, uri, s3_server)  # the snippet's one expression: the Publisher it builds


def test_publisher_options_snippet(s3_server):
    snippet = one_snippet("python", "options=PublisherOptions(")
    uri = s3_server.uri("readme-options")
    ran = run_python(
        snippet,
        {"torch": torch, "Publisher": Publisher, "S3": s3_server.storage_options},  # Publisher: the block above
        {'"s3://bucket/run1"': repr(uri), "StoreOptions(storage_options=None": "StoreOptions(storage_options=S3"},
    )
    _publishes_to(ran.value, uri, s3_server)  # the snippet's one expression: the Publisher it builds


@pytest.mark.slow  # two torchrun ranks importing torch and transformers
def test_sharded_trainer_snippet(tmp_path):
    """The FSDP2 script under the command its first line gives (torchrun, 2 ranks, gloo), then the claim
    the README makes right after it: `vllm-delta inspect` lists versions 0-3 with 2 parts each."""
    snippet = one_snippet("python", "fully_shard(model)")
    name, command = re.match(r"# (\S+) -- torchrun (.+)", snippet.first).groups()
    store = str(tmp_path / "run1")
    (tmp_path / name).write_text(snippet.code.replace('"/tmp/run1"', repr(store)))
    assert repr(store) in (tmp_path / name).read_text()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *shlex.split(command)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = [line.split() for line in proc.stdout.splitlines() if re.match(r"\d+ (anchor|delta) ", line)]
    assert [p[:2] for p in printed] == [["0", "anchor"], ["1", "delta"], ["2", "delta"], ["3", "delta"]], proc.stdout
    records = DeltaStore(store).records()
    assert [(r.version, len(r.files)) for r in records] == [(0, 2), (1, 2), (2, 2), (3, 2)]
    assert [p[3] for p in printed] == [r.checksum for r in records]
    note = "`vllm-delta inspect /tmp/run1` then lists versions 0-3 with 2 parts each."
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")) as f:
        assert note in f.read()


def _cli(capsys, line: str, substitutions: dict[str, str]) -> tuple[int, str]:
    for old, new in substitutions.items():
        line = line.replace(old, new)
    argv = shlex.split(line, comments=True)
    assert argv[0] == "vllm-delta", line
    capsys.readouterr()
    code = cli_main(argv[1:])
    return code, capsys.readouterr().out


def test_store_commands(tmp_path, capsys):
    """The README's store commands on a local store (version 42 of the README is version 2 here; the mirror
    makes one pass instead of following; `coverage` asks a running server: test_vllm_moe.py runs it)."""
    snippet = one_snippet("bash", "vllm-delta inspect /data/run1")
    lines = [line for line in snippet.code.splitlines() if line.startswith("vllm-delta ")]
    assert [line.split()[1] for line in lines] == [
        "inspect",
        "inspect",
        "materialize",
        "retain",
        "mark-bad",
        "mirror",
        "coverage",
    ]
    store = str(tmp_path / "run1")
    trainer = one_snippet("python", "checkpoint_tensors(model)")
    ran = run_python(trainer, _trainer_namespace(3), {"file:///data/run1": store})
    assert ran.value == DeltaStore(store).record(2).checksum
    subs = {"/data/run1": store, "./step42": str(tmp_path / "step2"), "42": "2"}  # in this order
    inspect_all, inspect_latest, materialize, retain, mark_bad, mirror, _coverage = lines

    code, out = _cli(capsys, inspect_all, subs)
    listed = [row.split()[:2] for row in out.splitlines()[1:]]
    assert code == 0 and listed == [["0", "anchor"], ["1", "delta"], ["2", "delta"]], out
    code, out = _cli(capsys, inspect_latest, subs)
    assert code == 0 and json.loads(out)["version"] == 2 and json.loads(out)["checksum"] == ran.value
    code, _ = _cli(capsys, materialize, subs)
    assert code == 0 and any(n.endswith(".safetensors") for n in os.listdir(tmp_path / "step2"))
    code, _ = _cli(capsys, retain, subs)
    assert code == 0 and DeltaStore(store).versions() == [0, 1, 2]  # one anchor: nothing to delete
    code, _ = _cli(capsys, mark_bad, subs)
    assert code == 0 and "BAD: diverged" in _cli(capsys, inspect_all, subs)[1]
    dst = str(tmp_path / "region")
    assert " --follow" in mirror
    code, _ = _cli(capsys, mirror.replace(" --follow", ""), {"s3://a/run1": store, "s3://b/run1": dst})
    assert code == 0 and DeltaStore(dst).versions()[:1] == [0]


def test_signing_snippets(tmp_path, capsys):
    """keygen, a signing Publisher, `verify` against the trusted key: as the README's "Signed versions" gives
    them (/secrets and /data stand for temporary directories)."""
    secrets = str(tmp_path / "secrets")
    os.mkdir(secrets)
    subs = {"/secrets": secrets, "/data/run1": str(tmp_path / "run1")}
    (keygen,) = [line for line in one_snippet("bash", "vllm-delta keygen").code.splitlines() if line.startswith("vllm")]
    code, out = _cli(capsys, keygen, subs)
    assert code == 0 and "fingerprint" in out and os.path.exists(f"{secrets}/trainer.key.pub")
    snippet = one_snippet("python", 'signing_key="/secrets/trainer.key"')
    model = build_master_model(SPEC, seed=0)
    run_python(snippet, {"model": model}, {'"/secrets': f'"{secrets}', '"/data/run1"': repr(subs["/data/run1"])})
    servers = one_snippet("bash", "vllm-delta verify")
    assert '"delta_trusted_keys": ["/secrets/trainer.key.pub"]' in servers.code  # the server's option, as documented
    (verify,) = [line for line in servers.code.splitlines() if line.startswith("vllm-delta ")]
    code, out = _cli(capsys, verify, subs)
    assert code == 0 and "1 of 1 version(s) signed by a trusted key" in out, out
