#!/usr/bin/env bash
# Lays out FlashInfer (the flashinfer extra) for a GPU machine without a package index:
# flashinfer-python and what it imports, unpacked for cp312 / manylinux x86_64, less
# the kernel sources of models and chips this project does not run (Blackwell-only,
# MoE, linear-attention and other families' kernels), packed as .fi/site.tar.xz
# (~20 MB; git-ignored). benchmarks/h200.sh unpacks it into its site folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/cp312_wheels.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp312_wheels "$tmp" flashinfer-python==0.7.2.post1 "apache-tvm-ffi<0.2,>=0.1.11" einops \
    ninja click tabulate nvidia-ml-py cuda-python cuda-pathfinder cuda-bindings
cd "$tmp/site/flashinfer"
rm -rf data/cutlass/examples data/cutlass/python moe_ep/kernel_src
for d in cake_dsv4 cake_sampling kda fused_moe cake_fmha gdn experimental blackwell_bf16_fp4 \
    cake_bgmv_moe blackwell_msa alphamoe_nvfp4_sm100.cu nv_internal \
    cake_sage_block_sparse_attention cake_vsa_sm90 cake_batch_deepgemm_fp8 fmha_v2 \
    cake_trtllm_mla_blackwell cake_grouped_fp8_gemm cake_vsa cake_kimi_k3_mla \
    cake_all_gather_matmul cake_trtllm_moe_allreduce_union; do
    rm -rf "data/csrc/$d"
done
cd - > /dev/null
mkdir -p .fi
tar -C "$tmp/site" -cf - . | xz -T0 -6 > .fi/site.tar.xz
ls -la .fi/site.tar.xz
