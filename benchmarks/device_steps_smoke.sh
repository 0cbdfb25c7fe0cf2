#!/usr/bin/env bash
# Device steps on the GPU machine, each part under a hard limit (a device that waits for
# a flag nobody sets would otherwise hold the call): the handshake's latency, then one
# constrained batch of 64 through the engine on random weights, with device steps and
# with host steps (ASYNCLLM_GRAMMAR_DEVICE_STEPS=0). Logs to $OUT.
set -uo pipefail
OUT=${OUT:-h200-logs}
mkdir -p "$OUT"
bash benchmarks/h200.sh info > "$OUT/setup.txt" 2>&1  # (installs .whl_a's wheels)
export PYTHONPATH=src:kernels:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export ASYNCLLM_CACHE=/tmp/asyncllm-cache
timeout 60 python3 -P benchmarks/handshake_latency.py > "$OUT/handshake-latency.log" 2>&1
echo "latency rc $?"; tail -n 12 "$OUT/handshake-latency.log"
for steps in 1 0; do
    ASYNCLLM_GRAMMAR_DEVICE_STEPS=$steps timeout 120 python3 -P benchmarks/structured_throughput.py \
        --device cuda --model .whl_a/smol-config --load-format dummy --batch 64 --repeat 1 \
        > "$OUT/dummy-throughput-$steps.log" 2>&1
    echo "device steps $steps: rc $?"; grep -v '^{' "$OUT/dummy-throughput-$steps.log" | tail -n 3
done
