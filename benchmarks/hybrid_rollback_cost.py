"""What rolling back a hybrid target costs, against the verify pass it undoes, per mechanism.

A random mlx-lm qwen3_5 target shaped like a small real one (hidden 1024, 16 layers, 3 of 4
Gated DeltaNet), 257 tokens of context. For each K and number of rejected drafts: the verify pass
(launch + read), then the rollback (MLXTarget.trim, evaluated), by each of mlxspec's mechanisms:

  tape     the pass keeps each Gated DeltaNet layer's state after every position and its
           convolution input; the rollback selects them at the last kept position (the default
           where the recurrence runs position by position, as on the CPU)
  re-run   the rollback restores the states from before the pass and runs the recurrent layers'
           state updates again on the kept positions' recorded inputs (the default under a fused
           Metal kernel, and for Mamba-2 and short-convolution layers)
  whole    the kept tokens through the whole model (the fallback for unknown state modules)

A step is verify + rollback; peak memory is mx.get_peak_memory() over the step, weights
included. Medians of 5 after one warm-up.

    .venv/bin/python benchmarks/hybrid_rollback_cost.py
"""

import statistics
import time

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm.models import qwen3_5

from mlxspec.engine import Draft
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

CONFIG = dict(model_type="qwen3_5", vocab_size=32000, hidden_size=1024, num_hidden_layers=16,
              intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
              linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              max_position_embeddings=4096, full_attention_interval=4)
MECHANISMS = ("tape", "re-run", "whole")


def target_with(model, mechanism: str) -> MLXTarget:
    target = MLXTarget(model, speculative=True)
    if mechanism != "tape":
        target._taped = []
    if mechanism == "whole":
        target._mixers = []
    return target


def measure(model, k: int, rejected: int, mechanism: str, repeats: int = 5):
    target = target_with(model, mechanism)
    target.prefill(list(range(1, 258)))
    verify, rollback, peaks = [], [], []
    for _ in range(repeats + 1):
        mx.reset_peak_memory()
        start = time.perf_counter()
        target.launch(7, Draft(tokens=list(range(9, 9 + k))), SamplingConfig()).verdict()
        read = time.perf_counter()
        target.trim(rejected)
        mx.eval([c.state for c in target.cache])
        verify.append(read - start)
        rollback.append(time.perf_counter() - read)
        peaks.append(mx.get_peak_memory())
    return statistics.median(verify[1:]), statistics.median(rollback[1:]), max(peaks)


def main():
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    print(f"BLAS: {mlxspec.blas_in_use()}")
    print("| K | rejected | " + " | ".join(
        f"{m}: verify ms, rollback ms (share), peak MB" for m in MECHANISMS) + " |")
    print("|---|---|" + "---|" * len(MECHANISMS))
    for k in (1, 4, 8, 16):
        for rejected in sorted({k, max(1, k // 2)}):
            cells = []
            for mechanism in MECHANISMS:
                v, r, peak = measure(model, k, rejected, mechanism)
                cells.append(f"{v * 1e3:.1f}, {r * 1e3:.1f} ({r / v:.0%}), {peak / 2**20:.0f}")
            print(f"| {k} | {rejected} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
