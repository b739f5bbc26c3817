#!/usr/bin/env bash
# DFlash2 and DSpark drafters for SmolLM2-135M-Instruct, measured in docs/benchmarks.md
# ("DFlash2 and DSpark at equal training time"): trained on this project's 2-core CPU on the data
# and held-out protocol of the EAGLE-3 and Medusa runs (the target's own greedy answers to 896
# ShareGPT prompts, token ids in data/dflash-smollm2/responses, the same 16 held out; tau on 8 of
# them, 48 tokens, greedy, a fixed K), for a fixed time: one layer started from the target's last,
# 64 anchors a sequence, lr 1e-3 with 50 warmup steps and a cosine fitted to the time, target
# features in torch, the drafter's steps on MLX, the loss over the 8,192 most frequent answer tokens
# (as the EAGLE-3 and Medusa runs; both still draft over the full vocabulary).
# DFlash2: blocks of 16 as the DFlash it is compared with, z-lab's convolutions (2 taps, groups
# of 16) and selector (rank 256, top 16). DSpark: DeepSpec's recipe (blocks of 7, gamma 4,
# Markov rank 256, confidence head, losses 0.1 CE + 0.9 L1 + 1.0 BCE).
# INIT=DIR (DFlash2): start from a DFlash checkpoint instead (its config, e.g. the shipped one's
# block size; a fresh DFlash2 then drafts exactly as it), into runs/dflash2-init-smollm2.
# Resumable: run it again after a stop and it continues from the last save.
# Usage: [MINUTES=25] [INIT=DIR] bash benchmarks/train_smollm2_block.sh dflash2|dspark
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"
kind=${1:?usage: train_smollm2_block.sh dflash2|dspark}
out=runs/$kind-smollm2
start=()
if [[ -n "${INIT:-}" ]]; then
  out=runs/$kind-init-smollm2
  start=(--init "$INIT")
fi
[[ -f $out/train_state/state.json ]] && start=(--resume)
.venv/bin/mlxspec train "$kind" --prompts sharegpt --heldout 16 --max-new-tokens 256 \
  --num-prompts 912 --data-dir data/dflash-smollm2/responses --loss-vocab 8192 --features-with torch \
  --lr 1e-3 --warmup 50 --anchors 64 --minutes "${MINUTES:-25}" --eval-every 100 \
  --eval-prompts 8 --eval-max-tokens 48 --save-every 25 --out "$out" "${start[@]}"
