#!/usr/bin/env bash
# Create .venv-llama: llama-cpp-python built from source, plus the gguf package, for the
# llama.cpp state-file tests (tests/foreign/test_llama_state.py) and for regenerating the committed
# samples under fixtures/foreign/llama/ (scripts/make_foreign_fixtures.py).
#
# Optional and never run by `make test`: the build compiles llama.cpp's C++ (several minutes on
# a 2-core machine), so it lives in its own virtualenv and the tests that need it skip when it is
# absent. The build is CPU-only, with llama.cpp's examples, tools, tests, server and the
# multimodal library switched off, because only libllama is needed to save state files.
# Idempotent: a stamp file records a finished install of this exact script.
#
# Usage: scripts/setup_llama_venv.sh [VENV_DIR]     (default: .venv-llama in the repository root)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$root/.venv-llama}
python=${PYTHON:-python3}
stamp=$venv/.installed
script_sum=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)

if [[ -f $stamp && $(cat "$stamp") == "$script_sum" ]]; then
    echo "llama.cpp virtualenv is ready: $venv"
    exit 0
fi

test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" numpy==2.* gguf==0.19.0
# From the sdist, never a prebuilt wheel: the state files must come from llama.cpp's own code as
# compiled here. One compile job at a time unless the caller asks for more.
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
-DLLAVA_BUILD=OFF -DLLAMA_BUILD_MTMD=OFF"
"${pip[@]}" --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
"$venv/bin/python" -c "import llama_cpp, gguf, numpy; print('llama_cpp', llama_cpp.__version__)"
echo "$script_sum" > "$stamp"
echo "llama.cpp virtualenv is ready: $venv"
