#!/usr/bin/env bash
# The main job on the built-in model: capture → inspect → verify → restore --check, each step
# explained. Usage: scripts/demo.sh [VENV_BIN]   (make demo passes .venv/bin)
set -euo pipefail
bin=${1:-.venv/bin}
out=${KVSNAP_DEMO_DIR:-out/demo}
mkdir -p "$out"
snap="$out/demo.safetensors"

bold='' plain=''
if [[ -t 1 ]]; then bold=$'\033[1m' plain=$'\033[0m'; fi
step() {  # step NUMBER TITLE: a header before each command
    printf '\n%s== %s. %s%s\n' "$bold" "$1" "$2" "$plain"
}
run() {  # run COMMAND...: show the command (quoted as a shell reads it), then run it
    printf '$'
    printf ' %q' "$@"
    printf '\n'
    "$@"
}
say() {  # say TEXT: what the output above showed
    printf '\n%s\n' "$*" | fold -s -w 100
}

cat <<EOF | fold -s -w 100
kvsnap demo on its built-in model: a tiny Llama (4 layers, 2 KV heads of 32 dims) whose weights
are fixed random numbers, built on this machine without any download. It is not a language
model: its continuations are gibberish. What matters is that they are the same with and without
the snapshot.
EOF

step 1 "Capture: prefill two prompts and write their KV cache to a snapshot"
run "$bin/kvsnap" capture -o "$snap" --prompt "The capital of France is" --prompt "KV caches are paged"
say "The model ran prefill on both prompts (its tokens are the prompts' UTF-8 bytes plus BOS) and" \
    "kvsnap wrote the KV of every layer to $snap, one sequence per prompt."

step 2 "Inspect: what the snapshot holds"
run "$bin/kvsnap" inspect "$snap" --stats --plot "$out/norms.png"
say "The first table is the metadata: the model it came from and its fingerprint, the KV" \
    "geometry (layers, KV heads x head dim, tokens per block, dtype). The second lists the" \
    "sequences: tokens and 16-token blocks each. The statistics are per layer tensor, over real" \
    "tokens only: no NaN or Inf. $out/norms.png shows each token's key and value norm per layer."

step 3 "Verify: checksums, then the KV recomputed from scratch"
run "$bin/kvsnap" verify "$snap" --recompute
say "verify checked the structure and the checksum of every block, then --recompute ran prefill" \
    "of the stored token ids again and compared its KV with the snapshot's: the same, tensor by" \
    "tensor (max |diff| 0)."

step 4 "Restore: load the KV into a fresh cache and keep generating"
run "$bin/kvsnap" restore "$snap" --max-new-tokens 16 --check
say "restore loaded each sequence's KV into a new cache and generated 16 tokens from it, without" \
    "running prefill. The text is gibberish because the weights are random. The proof is the last" \
    "line: 'check: match' means generation from the restored cache gave exactly the tokens that" \
    "generation from a full prefill gives. With your own model: --model DIR on every command."
