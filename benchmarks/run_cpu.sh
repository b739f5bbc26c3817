#!/usr/bin/env bash
# The benchmark runs behind docs/benchmarks.md, on this project's 2-core Linux CPU.
# Usage: bash benchmarks/run_cpu.sh [qwen|dflash|bar|speed]   (qwen: also the Qwen2.5-Coder
# 1.5B/0.5B pair; needs QWEN15 and QWEN05 set to their converted directories, see
# docs/benchmarks.md; dflash: only the shipped DFlash drafter against prompt lookup, on more
# prompts, for docs/dflash-training.md; bar: their tau alone, full blocks, on 40 prompts a suite,
# with intervals, for the bar in the same doc (DFLASH_MODEL, BAR_NAME, BAR_LIMIT: another drafter,
# its results' name, prompts a suite); speed: their wall clock with the adaptive K against
# plain decoding on 20 prompts a suite, with intervals, for the same doc)
set -euo pipefail
cd "$(dirname "$0")/.."
export MLXSPEC_CACHE="${MLXSPEC_CACHE:-$PWD/.cache}"
out=docs/results
mkdir -p "$out"
mlxspec=.venv/bin/mlxspec

if [[ "${1:-}" == "dflash" ]]; then
  # The drafter's bar (docs/dflash-training.md): its tau against prompt lookup's on the same
  # prompts, both at full blocks (name@15) and with the adaptive K, greedy and T=1, and the
  # drafter drafting from its draft vocabulary vs the full one, and dflash+lookup; ours only
  # (one interleaved run).
  .venv/bin/python benchmarks/bench_dflash.py $out/smollm2-dflash-vs-lookup
  exit 0
fi

if [[ "${1:-}" == "bar" ]]; then
  # tau does not depend on the machine's speed, so this needs no plain decoding to compare with;
  # what it needs is prompts: 40 a suite (the first 10 are the runs above), paired intervals.
  # DFLASH_MODEL=DIR judges another drafter (e.g. one from scripts/gpu_train_dflash.sh) the same
  # way, into $out/$BAR_NAME.* (default: the shipped drafter, smollm2-dflash-bar).
  $mlxspec bench --drafters lookup@15,dflash@15,dflash+lookup@15 --suite humaneval,mtbench \
    --temp 0,1 --limit "${BAR_LIMIT:-40}" --max-tokens 64 --no-mlx-lm --no-llama-cpp \
    ${DFLASH_MODEL:+--dflash-model "$DFLASH_MODEL"} \
    --compare dflash@15/lookup@15 --compare dflash+lookup@15/lookup@15 \
    --compare dflash+lookup@15/dflash@15 \
    --out "$out/${BAR_NAME:-smollm2-dflash-bar}.json" \
    --markdown "$out/${BAR_NAME:-smollm2-dflash-bar}.md"
  exit 0
fi

if [[ "${1:-}" == "speed" ]]; then
  # Speed ratios need an idle machine and plain decoding in the same interleaved run.
  $mlxspec bench --drafters none,lookup,dflash,dflash+lookup --suite humaneval,mtbench \
    --temp 0,1 --limit 20 --max-tokens 64 --no-mlx-lm --no-llama-cpp \
    --compare dflash+lookup/lookup --compare dflash/lookup \
    --out $out/smollm2-dflash-speed.json --markdown $out/smollm2-dflash-speed.md \
    --plot $out/smollm2-dflash-speed.png
  exit 0
fi

# Default target, OpenBLAS: plain vs prompt lookup vs the shipped DFlash drafter vs mlx-lm and
# llama.cpp (plain and its prompt lookup, on the same GGUF; needs llama-cpp-python), three suites,
# greedy and T=1; name@15 runs a drafter at a fixed 15 drafts (its full tau) beside the adaptive K.
$mlxspec bench --drafters none,lookup,dflash,lookup@15,dflash@15 --suite humaneval,mtbench,copy \
  --temp 0,1 --limit 3 --max-tokens 64 --out $out/smollm2-cpu-openblas.json \
  --markdown $out/smollm2-cpu-openblas.md --plot $out/smollm2-cpu-openblas.png

# The same with MLX's bundled reference BLAS (shorter: it is far slower).
MLXSPEC_BLAS=reference $mlxspec bench --drafters none,lookup --suite copy --temp 0 --limit 2 --no-llama-cpp \
  --max-tokens 32 --out $out/smollm2-cpu-reference-blas.json \
  --markdown $out/smollm2-cpu-reference-blas.md

if [[ "${1:-}" == "qwen" ]]; then
  # A real target / draft pair with one tokenizer: ours vs mlx-lm's --draft-model (and llama.cpp
  # plain / prompt lookup on the 1.5B GGUF when QWEN15_GGUF names it).
  $mlxspec bench --model "$QWEN15" --draft-model "$QWEN05" --drafters none,draft,draft@4 --suite humaneval \
    ${QWEN15_GGUF:+--llama-cpp-gguf "$QWEN15_GGUF"} \
    --temp 0,1 --limit 2 --max-tokens 48 --mlx-lm-num-draft 4 \
    --out $out/qwen-coder-pair-cpu-openblas.json --markdown $out/qwen-coder-pair-cpu-openblas.md \
    --plot $out/qwen-coder-pair-cpu-openblas.png
fi
