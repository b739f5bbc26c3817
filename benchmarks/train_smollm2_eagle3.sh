#!/usr/bin/env bash
# The EAGLE-3 drafter for SmolLM2-135M-Instruct measured in docs/benchmarks.md ("EAGLE-3 against
# DFlash at equal training time"): trained on this project's 2-core CPU on the same data as the
# shipped DFlash drafter's first stage (the target's own greedy answers to 896 ShareGPT prompts,
# token ids committed in data/dflash-smollm2/responses; the same 16 held out), for a fixed time.
# Resumable: run it again after a stop and it continues from the last save (the schedule stays
# the one fitted to MINUTES at the start).
# Usage: [MINUTES=100] [TTT_STEPS=4] bash benchmarks/train_smollm2_eagle3.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"
out=runs/eagle3-smollm2
start=()
[[ -f $out/train_state/state.json ]] && start=(--resume)
# The DFlash run's data settings (benchmarks/train_smollm2_dflash.sh, stage "answers"), its
# learning rate, warmup and held-out tau protocol (8 prompts, 48 tokens, greedy); 8192 draft
# tokens (its loss vocabulary); 4 TTT steps (SpecForge uses 7: on this CPU fewer steps buy more
# sequences, and chains past 4 drafts are rarely accepted at this tau); the target's features
# computed in torch, the drafter's steps on MLX.
.venv/bin/mlxspec train eagle3 --prompts sharegpt --heldout 16 --max-new-tokens 256 \
  --num-prompts 912 --data-dir data/dflash-smollm2/responses --draft-vocab 8192 \
  --ttt-steps "${TTT_STEPS:-4}" --features-with torch --lr 1e-3 --warmup 50 \
  --minutes "${MINUTES:-100}" --eval-every 100 --eval-prompts 8 --eval-max-tokens 48 \
  --save-every 25 --out "$out" "${start[@]}"
