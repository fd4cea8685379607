# One entry point for people and CI. The virtualenv lives in .venv; CPU torch is pinned first so
# that the project's own "torch" requirement is already satisfied and pip never pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test demo lint venv vllm-venv gpu-test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Real vLLM (CPU build) in its own virtualenv: it pins torch 2.13.0+cpu and transformers < 5.20.
VLLM_STAMP := .venv-vllm/.installed

$(VLLM_STAMP): scripts/setup_vllm_venv.sh
	PYTHON=$(PYTHON) bash scripts/setup_vllm_venv.sh

vllm-venv: $(VLLM_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint $(VLLM_STAMP)
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	bash scripts/demo.sh $(BIN)

gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

# Needs a CUDA machine; results as JSON under out/ (see docs/benchmarks.md).
bench: $(STAMP)
	mkdir -p out
	$(BIN)/python -m benchmarks.transfer out/bench-transfer.json
	$(BIN)/python -m benchmarks.e2e --json-out out/bench-e2e.json

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info
