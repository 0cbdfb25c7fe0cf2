#!/usr/bin/env bash
# Device steps on the GPU machine, with a hard limit on each part (a device that waits for
# a flag nobody sets would otherwise hold the call): the handshake's tests, then one
# constrained batch through the engine on random weights. Logs to $OUT.
set -uo pipefail
OUT=${OUT:-h200-logs}
mkdir -p "$OUT"
bash benchmarks/h200.sh info > "$OUT/setup.txt" 2>&1  # (installs .whl_a's wheels)
export PYTHONPATH=src:kernels:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export ASYNCLLM_CACHE=/tmp/asyncllm-cache
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -x \
    tests/worker/test_gpu_grammar_handshake.py tests/worker/test_gpu_mask_staging.py \
    > "$OUT/handshake-tests.log" 2>&1
echo "tests rc $?"; tail -n 30 "$OUT/handshake-tests.log"
timeout 150 python3 -P benchmarks/structured_throughput.py --device cuda \
    --model .whl_a/smol-config --load-format dummy --batch 64 --repeat 1 \
    > "$OUT/dummy-throughput.log" 2>&1
echo "dummy rc $?"; grep -v '^{' "$OUT/dummy-throughput.log" | tail -n 20
