#!/usr/bin/env bash
# Set up (as scripts/setup.sh --test) and run the whole test suite, slow tests included.
# --fast: only the tests not marked slow (tiny random models: no real model, no χ² sampling
# tests), a few minutes instead of half an hour. Other arguments pass on to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--fast" ]]; then
  shift
  set -- -m "not slow" "$@"
fi
bash scripts/setup.sh --test
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"  # converted models, ignored by git
exec .venv/bin/python -m pytest -q -ra --durations=20 "$@"
