#!/usr/bin/env bash
# Chains against trees, and EAGLE-3 against DFlash, in one run on the default SmolLM2 target
# (docs/benchmarks.md, "Trees and EAGLE-3 in one run"): every configuration on each prompt
# before the next, HumanEval and MT-Bench, greedy and T = 1, each pair compared over the same
# prompts. EAGLE3 is the drafter benchmarks/train_smollm2_eagle3.sh trains.
# Usage: [EAGLE3=runs/eagle3-smollm2] [LIMIT=5] [TOKENS=64] bash benchmarks/trees_eagle3.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"
out=docs/results/smollm2-trees-eagle3
pairs=(lookup:lookup-branches=3/lookup dflash:tree-budget=16/dflash
       dflash+lookup:tree-budget=16/dflash+lookup eagle3:tree-budget=16/eagle3
       eagle3/dflash eagle3:tree-budget=16/dflash:tree-budget=16
       dflash:tree-budget=16/lookup eagle3:tree-budget=16/lookup)
compare=()
for p in "${pairs[@]}"; do compare+=(--compare "$p"); done
.venv/bin/mlxspec bench \
  --drafters none,lookup,lookup:lookup-branches=3,dflash,dflash:tree-budget=16,dflash+lookup,dflash+lookup:tree-budget=16,eagle3,eagle3:tree-budget=16 \
  --eagle3-model "${EAGLE3:-runs/eagle3-smollm2}" --suite humaneval,mtbench --temp 0,1 \
  --limit "${LIMIT:-5}" --max-tokens "${TOKENS:-64}" --no-mlx-lm --no-llama-cpp "${compare[@]}" \
  --out "$out.json" --markdown "$out.md" --plot "$out.png"
# Fixed node budgets (name@K fixes K: a tree's budget), greedy: tau and speed at 4, 8, 16, 32 nodes.
.venv/bin/mlxspec bench \
  --drafters none,eagle3@4,eagle3:tree-budget=32@4,eagle3:tree-budget=32@8,eagle3:tree-budget=32@16,eagle3:tree-budget=32@32,dflash:tree-budget=32@8,dflash:tree-budget=32@32 \
  --eagle3-model "${EAGLE3:-runs/eagle3-smollm2}" --suite humaneval,mtbench --temp 0 \
  --limit "${LIMIT:-5}" --max-tokens "${TOKENS:-64}" --no-mlx-lm --no-llama-cpp \
  --out "$out-budgets.json" --markdown "$out-budgets.md"
