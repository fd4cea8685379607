#!/usr/bin/env bash
# The main job on the built-in model: capture → inspect → verify → restore --check.
# Usage: scripts/demo.sh [VENV_BIN]   (make demo passes .venv/bin)
set -euo pipefail
bin=${1:-.venv/bin}
out=${KVSNAP_DEMO_DIR:-out/demo}
mkdir -p "$out"
snap="$out/demo.safetensors"
set -x
"$bin/kvsnap" capture -o "$snap" --prompt "The capital of France is" --prompt "KV caches are paged"
"$bin/kvsnap" inspect "$snap" --stats --plot "$out/norms.png"
"$bin/kvsnap" verify "$snap" --recompute
"$bin/kvsnap" restore "$snap" --max-new-tokens 16 --check
