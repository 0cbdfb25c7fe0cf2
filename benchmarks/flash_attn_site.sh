#!/usr/bin/env bash
# Lays out FlashAttention 4 (the flash-attn extra: flash-attn-4, the CuTe-DSL kernels) for
# a GPU machine without a package index: it and what it imports, unpacked for cp312 /
# manylinux x86_64 and CUDA 13 (nvidia-cutlass-dsl's cu13 libraries: a 92 MB wheel, more
# than one 64 MiB transfer), packed and cut into pieces under 60 MB as .fa/site.part.*
# (git-ignored). Send the pieces
# over two calls to one warm machine (`carry` each half), then benchmarks/h200.sh joins
# and unpacks them into its site folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/cp312_wheels.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp312_wheels "$tmp" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
    "apache-tvm-ffi<0.2,>=0.1.11" torch-c-dlpack-ext quack-kernels==0.6.5 einops \
    typing_extensions
mkdir -p .fa && rm -f .fa/site.part.*
tar -C "$tmp/site" -cf - . | xz -T0 -6 | split -b 60000000 -d - .fa/site.part.
ls -la .fa
