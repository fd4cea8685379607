# One entry point for people and CI. The virtualenv lives in .venv; CPU torch is pinned first so
# that the project's own "torch" requirement is already satisfied and pip never pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test demo lint venv gpu-test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	bash scripts/demo.sh $(BIN)

gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info
