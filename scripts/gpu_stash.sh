#!/usr/bin/env bash
# On a lent GPU machine: keep the bundle part this call carried (.gpu/part-NN, from
# scripts/gpu_bundle.py) in .gpu-stash/, an ignored folder the machine keeps between calls while
# it stays warm, for the call that runs the job (scripts/gpu_setup.sh joins the parts).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-stash
cp .gpu/part-* .gpu/bundle.sha256 .gpu-stash/
ls -l .gpu-stash
