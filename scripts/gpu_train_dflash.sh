#!/usr/bin/env bash
# Train deeper DFlash drafters for the default SmolLM2 target on a lent NVIDIA GPU, in one device
# call of under 10 minutes (docs/dflash-training.md, "On a lent GPU"):
#   1. set up (scripts/gpu_setup.sh), from the carried bundle of scripts/gpu_bundle.py;
#   2. one `mlxspec train dflash --backend torch --device cuda` run per depth in GPU_LAYERS, side
#      by side on the one GPU (each is launch-bound, so they overlap), from the target's layers,
#      on ShareGPT's real answers with the target's own predictions as labels, the schedule
#      fitted to GPU_MINUTES of training (--minutes without --steps);
#   3. each run packaged as a bf16 checkpoint, tarred with its training log and split into files
#      that come back from the device (at most 16 MiB each): rebuild with
#        cat dflash-L3.tar.part-* | tar -x      (a directory dflash-L3/, loadable as it is)
#   4. a short greedy bench on the GPU (torch, bf16: a preview; the bar is measured on the CPU
#      with benchmarks/run_cpu.sh bar and --dflash-model).
# Results in $OUT when set (else $MLXSPEC_CACHE/gpu-train-out): the parts and train.log (this
# output, the bench tables included): 6 files for the default depths, within the 8 that come back.
#
# Environment (defaults for an H200): GPU_TRAIN_DEVICE (cuda; cpu for a dry run), GPU_LAYERS ("3 5"),
# GPU_MINUTES (5), GPU_BATCH (8 sequences a step), GPU_ANCHORS (256 a sequence), GPU_LR (1e-3),
# GPU_LOSS_VOCAB (32768), GPU_NUM_PROMPTS (14677: all of ShareGPT's usable first exchanges),
# GPU_BENCH_LIMIT (10 prompts a suite; 0 skips the bench), PYTHON (python3), GPU_CHECK_VENV.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE="${GPU_TRAIN_DEVICE:-cuda}"
LAYERS="${GPU_LAYERS:-3 5}" MINUTES="${GPU_MINUTES:-5}" BENCH_LIMIT="${GPU_BENCH_LIMIT:-10}"
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$ROOT/.cache}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PYTHON="${PYTHON:-python3}"
RESULTS="${OUT:-$MLXSPEC_CACHE/gpu-train-out}"
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/train.log") 2>&1
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "setup"
# shellcheck source=scripts/gpu_setup.sh
source scripts/gpu_setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
PROMPTS="${SHAREGPT_JSONL:-sharegpt}"
"$PY" -c "from mlxspec.loading import resolve_model_dir; print('target:', resolve_model_dir(None))" \
  || exit 1  # converts the GGUF once, before the runs start side by side

step "train: layers $LAYERS, $MINUTES min each, side by side on $DEVICE"
runs="$MLXSPEC_CACHE/gpu-runs"
mkdir -p "$runs"
pids=()
for layers in $LAYERS; do
  run="$runs/dflash-L$layers"
  rm -rf "$run"
  # Each run tokenises the data into its own store (~35 s, on cores of its own): two runs filling
  # one store at once would race.
  OMP_NUM_THREADS=4 "$VENV/bin/mlxspec" train dflash --prompts "$PROMPTS" \
    --num-prompts "${GPU_NUM_PROMPTS:-14677}" --heldout 16 --responses conversation \
    --labels target --data-dir "$run-data" --max-new-tokens 256 --backend torch \
    --device "$DEVICE" --layers "$layers" --block-size 16 --target-layer-ids 1,14,27 \
    --loss-vocab "${GPU_LOSS_VOCAB:-32768}" --anchors "${GPU_ANCHORS:-256}" \
    --batch-size "${GPU_BATCH:-8}" --lr "${GPU_LR:-1e-3}" --warmup 100 --gamma 7 \
    --eval-every 0 --save-every 200 --minutes "$MINUTES" --out "$run" \
    > "$run.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for layers in $LAYERS; do  # the progress bar's last state, and any error
  echo "--- L$layers:"; tail -c 1500 "$runs/dflash-L$layers.log" | tr '\r' '\n' | tail -n 8
done

step "package: bf16 checkpoints, tarred with their logs, in parts of 15 MiB"
"$PY" - "$runs" "$RESULTS" <<'EOF' || status=1
import json, subprocess, sys
from pathlib import Path
import mlxspec
from mlxspec.training.dflash_trainer import package_drafter

runs, results = Path(sys.argv[1]), Path(sys.argv[2])
target, _ = mlxspec.load(None)
for run in sorted(p for p in runs.iterdir() if (p / "train_state" / "state.json").is_file()):
    state = json.loads((run / "train_state" / "state.json").read_text())
    log = state["log"]
    block_size = json.loads((run / "config.json").read_text())["block_size"]
    blocks = log[-1]["trained_blocks"] if log else 0
    notes = {"trained": f"scripts/gpu_train_dflash.sh: {state['step']} of {state['steps']} steps, "
                        f"{blocks * block_size} block tokens, batch {state['batch_size']}, "
                        f"lr {state['lr']}, loss vocabulary {state['loss_vocab']}"}
    dest = package_drafter(run, runs / "packaged" / run.name, target, notes=notes)
    (dest / "train_log.json").write_text(json.dumps(log))
    print(run.name, notes["trained"], "final loss", log[-1]["loss"] if log else None)
    subprocess.run(f"tar -cf - -C {dest.parent} {run.name} | split -b 15m - "
                   f"{results}/{run.name}.tar.part-", shell=True, check=True)
EOF
ls -l "$RESULTS"

if [[ "$BENCH_LIMIT" -gt 0 ]]; then
  step "bench (a preview: torch on $DEVICE, greedy, full blocks)"
  for packaged in "$runs"/packaged/dflash-L*; do
    [[ -d "$packaged" ]] || continue
    timeout 150 "$VENV/bin/mlxspec" bench --backend torch --device "$DEVICE" \
      --drafters lookup@15,dflash@15 --dflash-model "$packaged" --suite humaneval,mtbench \
      --temp 0 --limit "$BENCH_LIMIT" --max-tokens 64 --no-llama-cpp \
      --compare dflash@15/lookup@15 || status=1  # its table goes to train.log
  done
fi
step "done: status $status"
exit $status
