#!/usr/bin/env bash
# One device run: install the carried wheels, then the steps named in $@ (tests, bench-quick,
# bench-full, e2e), writing logs and JSON under $OUT. Used from the device tool; see docs/testing.md.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
# A source tree has no kvsnap.cli (pip maps the top-level cli/ in): link it, as a worktree does;
# `pytest -m gpu tests` imports every test module, the CLI's too.
[ -e kvsnap/cli ] || ln -s ../cli kvsnap/cli
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) timeout 400 python3 -m pytest -q -x -m gpu tests 2>&1 | tail -25 ;;
    fixed) timeout 300 python3 -m benchmarks.engine --skip-model --skip-media --repeat 20 --json-out $OUT/fixed.json ;;
    model-quick) timeout 400 python3 -m benchmarks.engine --skip-fixed --skip-media --sizes 128,2048 --json-out $OUT/model.json ;;
    model) timeout 500 python3 -m benchmarks.engine --skip-fixed --skip-media --json-out $OUT/model.json ;;
    media) timeout 400 python3 -m benchmarks.engine --skip-fixed --skip-model --json-out $OUT/media.json ;;
    transfer) timeout 300 python3 -m benchmarks.transfer $OUT/transfer.json ;;
    tp-shared) timeout 300 python3 -m benchmarks.tp_scaling --gpus 2 --share-gpu --gib-per-gpu 1 --shapes 8b --targets shm --json-out $OUT/tp_shared.json ;;
    tp) timeout 500 python3 -m benchmarks.tp_scaling --gpus 2 --json-out $OUT/tp.json ;;
    vllm-worker) timeout 400 python3 -m benchmarks.vllm_worker --packing both --out $OUT/vllm_worker.json ;;
    vllm-worker-shm) mkdir -p /dev/shm/kvsnap-vllm; timeout 400 python3 -m benchmarks.vllm_worker --dir /dev/shm/kvsnap-vllm --load-variants --out $OUT/vllm_worker_shm.json; rm -rf /dev/shm/kvsnap-vllm ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date +%T)"
