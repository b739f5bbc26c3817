#!/usr/bin/env bash
# The Medusa heads for SmolLM2-135M-Instruct measured in docs/benchmarks.md ("Medusa"): trained
# on this project's 2-core CPU on the data and held-out protocol of the EAGLE-3 run it is
# compared with (benchmarks/train_smollm2_eagle3.sh: the target's own greedy answers to 896
# ShareGPT prompts, token ids committed in data/dflash-smollm2/responses, the same 16 held out;
# tau on 8 of them, 48 tokens, greedy), for a fixed time.
# Resumable: run it again after a stop and it continues from the last save (the schedule stays
# the one fitted to MINUTES at the start).
# Usage: [MINUTES=50] bash benchmarks/train_smollm2_medusa.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"
out=runs/medusa-smollm2
start=()
[[ -f $out/train_state/state.json ]] && start=(--resume)
# 3 heads of one block sharing the target's frozen head (a 2.6 MB checkpoint), trained against
# the 8192 most frequent answer tokens (EAGLE-3's draft vocabulary size), batches of 4 (a
# step is cheap: the target's pass, in torch, is most of it), the paper's learning rate 1e-3.
.venv/bin/mlxspec train medusa --prompts sharegpt --heldout 16 --max-new-tokens 256 \
  --num-prompts 912 --data-dir data/dflash-smollm2/responses --loss-vocab 8192 \
  --features-with torch --lr 1e-3 --warmup 50 --batch-size 4 \
  --minutes "${MINUTES:-50}" --eval-every 100 --eval-prompts 8 --eval-max-tokens 48 \
  --save-every 25 --out "$out" "${start[@]}"
