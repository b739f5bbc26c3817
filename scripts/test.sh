#!/usr/bin/env bash
# Set up (as scripts/setup.sh --test) and run the whole test suite, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"  # converted models, ignored by git
exec .venv/bin/python -m pytest -q -ra --durations=20 "$@"
