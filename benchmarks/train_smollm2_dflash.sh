#!/usr/bin/env bash
# How the shipped DFlash drafter for SmolLM2-135M-Instruct was made (docs/dflash-training.md).
# Resumable: run it again after a stop and it continues (data, then training, from the last save).
# Usage: [NUM_PROMPTS=N] [STOP_AFTER=S] bash benchmarks/train_smollm2_dflash.sh [STEPS]
# The shipped drafter was made in three resumed stages (STEPS is the cosine schedule's length; a
# resume with a longer one raises the learning rate again):
#   NUM_PROMPTS=656 STOP_AFTER=800 bash benchmarks/train_smollm2_dflash.sh 1150
#   NUM_PROMPTS=656 bash benchmarks/train_smollm2_dflash.sh 2200
#   NUM_PROMPTS=912 STOP_AFTER=2800 bash benchmarks/train_smollm2_dflash.sh 3400   (+256 answers)
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"
steps="${1:-1150}"
out=runs/dflash-smollm2
resume=()
[[ -f $out/train_state/state.json ]] && resume=(--resume)
# Responses: the target's own greedy answers to ShareGPT prompts (batched, torch: 2x MLX here);
# their token ids are committed in data/dflash-smollm2/responses (all of the store is used).
# Training: torch steps (3x MLX on this CPU), one drafter layer started from the target's last,
# conditioned on target layers 1, 14, 27; the loss over the 8192 most frequent response tokens;
# held-out tau on 8 ShareGPT prompts never trained on.
.venv/bin/mlxspec train dflash --prompts sharegpt --num-prompts "${NUM_PROMPTS:-912}" \
  --data-dir data/dflash-smollm2/responses --heldout 16 --max-new-tokens 256 \
  --generate-with torch --backend torch --out $out --layers 1 --block-size 16 \
  --target-layer-ids 1,14,27 --loss-vocab 8192 --anchors 256 --steps "$steps" --lr 1e-3 \
  --warmup 50 --eval-every 200 --eval-prompts 8 --eval-max-tokens 48 --save-every 25 \
  ${STOP_AFTER:+--stop-after "$STOP_AFTER"} "${resume[@]}"
