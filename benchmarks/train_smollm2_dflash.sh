#!/usr/bin/env bash
# How the shipped DFlash drafter for SmolLM2-135M-Instruct was made (docs/dflash-training.md).
# Resumable: run it again after a stop and it continues (data, then training, from the last save).
# Usage: [STAGE=answers|conversations] [NUM_PROMPTS=N] [STOP_AFTER=S] [GAMMA=G] [LAYERS=L] \
#          bash benchmarks/train_smollm2_dflash.sh [STEPS]
# Stage "answers" (runs/dflash-smollm2): the target's own greedy answers to ShareGPT prompts, made
# in three resumed runs (STEPS is the cosine schedule's length; a resume with a longer one raises
# the learning rate again):
#   NUM_PROMPTS=656 STOP_AFTER=800 bash benchmarks/train_smollm2_dflash.sh 1150
#   NUM_PROMPTS=656 bash benchmarks/train_smollm2_dflash.sh 2200
#   NUM_PROMPTS=912 STOP_AFTER=2800 bash benchmarks/train_smollm2_dflash.sh 3400   (+256 answers)
# Stage "conversations" (runs/dflash-smollm2-conv): continues that drafter (--init) on ShareGPT's
# real answers, each slot labelled with the target's own greedy prediction (no generation):
#   STAGE=conversations NUM_PROMPTS=3000 bash benchmarks/train_smollm2_dflash.sh 1200
#   STAGE=conversations NUM_PROMPTS=3000 STOP_AFTER=S bash benchmarks/train_smollm2_dflash.sh STEPS2
# then (session 13) with the slot decay gamma 2 (it won a 150-step A/B against 7 from step 2,300),
# the cosine over 4,500 steps, and the store grown to 6,000 prompts (new answers join the epoch):
#   STAGE=conversations NUM_PROMPTS=3000 GAMMA=2 STOP_AFTER=2450 bash benchmarks/train_smollm2_dflash.sh 4500
#   STAGE=conversations NUM_PROMPTS=6000 bash benchmarks/train_smollm2_dflash.sh 4500
# then (session 14) resumed with the cosine over 6,000, stopped after the step-4,300 save (here by
# ending the process; STOP_AFTER=4300 does the same) for an A/B against a drafter grown to two
# layers (docs/dflash-training.md), then resumed with the cosine over 5,200 and stopped after the
# step-4,900 save (the session's time):
#   STAGE=conversations NUM_PROMPTS=6000 STOP_AFTER=4300 bash benchmarks/train_smollm2_dflash.sh 6000
#   STAGE=conversations NUM_PROMPTS=6000 STOP_AFTER=4900 bash benchmarks/train_smollm2_dflash.sh 5200
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"
stage="${STAGE:-answers}"
# Common: torch steps (3x MLX on this CPU), one drafter layer (LAYERS=2 with a resume grows it,
# as in session 15's experiments; the shipped drafter has one) conditioned on target layers 1, 14,
# 27; the loss over the 8192 most frequent response tokens; held-out tau on 8 ShareGPT prompts
# never trained on (the same 8 in both stages: the split depends only on the first 64 prompts).
common=(--prompts sharegpt --heldout 16 --max-new-tokens 256 --backend torch --layers "${LAYERS:-1}"
        --block-size 16 --target-layer-ids 1,14,27 --loss-vocab 8192 --anchors 256 --warmup 50
        --eval-every 200 --eval-prompts 8 --eval-max-tokens 48 --save-every 25)
case $stage in
  answers)
    # The target's greedy answers, batched in torch (2x MLX here); token ids committed in
    # data/dflash-smollm2/responses (all of the store is used).
    out=runs/dflash-smollm2
    stage_args=(--num-prompts "${NUM_PROMPTS:-912}" --data-dir data/dflash-smollm2/responses
                --generate-with torch --lr 1e-3)
    start=() ;;
  conversations)
    # ShareGPT's real answers (cut at 256 tokens; token ids in data/dflash-smollm2/conversations),
    # labels from the target's teacher-forced predictions; starts from the answers stage.
    out=runs/dflash-smollm2-conv
    stage_args=(--num-prompts "${NUM_PROMPTS:-3000}" --data-dir data/dflash-smollm2/conversations
                --responses conversation --labels target --lr 5e-4)
    start=(--init runs/dflash-smollm2) ;;
  *) echo "STAGE must be answers or conversations, got $stage" >&2; exit 2 ;;
esac
steps="${1:-1150}"
[[ -f $out/train_state/state.json ]] && start=(--resume)
.venv/bin/mlxspec train dflash "${common[@]}" "${stage_args[@]}" --out "$out" --steps "$steps" \
  ${STOP_AFTER:+--stop-after "$STOP_AFTER"} ${GAMMA:+--gamma "$GAMMA"} "${start[@]}"
