#!/usr/bin/env bash
# Two ranks on loopback against one process (docs/benchmarks.md, "Targets split across ranks"):
# the split run under mlx.launch, each rank pinned to a core of its own with one OpenBLAS thread;
# one process on one core (the compute each rank has) and on both cores (this machine's best).
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}" HF_HUB_OFFLINE=1
tmp=$(mktemp -d)
py=.venv/bin/python
.venv/bin/mlx.launch -n 2 --backend ring --env OPENBLAS_NUM_THREADS=1 -- \
  bash -c 'exec taskset -c "$MLX_RANK" "$@"' pin $py benchmarks/distributed_loopback.py run "$tmp/split.json"
OPENBLAS_NUM_THREADS=1 taskset -c 0 $py benchmarks/distributed_loopback.py run "$tmp/one-core.json"
$py benchmarks/distributed_loopback.py run "$tmp/two-cores.json"
$py benchmarks/distributed_loopback.py report docs/results/smollm2-distributed-loopback \
  "$tmp/split.json" "$tmp/one-core.json" "$tmp/two-cores.json"
for f in split one-core two-cores; do cp "$tmp/$f.json" "docs/results/smollm2-distributed-loopback-$f.json"; done
