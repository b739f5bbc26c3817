"""What rolling back a hybrid target costs, against the verify pass it undoes.

A random mlx-lm qwen3_5 target shaped like a small real one (hidden 1024, 16 layers, 3 of 4
Gated DeltaNet), 257 tokens of context. For each K and number of rejected drafts: the verify pass
(launch + read), then the rollback (MLXTarget.trim, evaluated): the recurrent layers' state
updates run again on the kept positions' recorded inputs, or (--whole) the kept tokens through
the whole model. Medians of 5 after one warm-up.

    .venv/bin/python benchmarks/hybrid_rollback_cost.py
"""

import statistics
import time

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm.models import qwen3_5

from mlxspec.engine import Draft
from mlxspec.mlx_backend import MLXTarget
from mlxspec.sampling import SamplingConfig

CONFIG = dict(model_type="qwen3_5", vocab_size=32000, hidden_size=1024, num_hidden_layers=16,
              intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
              linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=64,
              linear_value_head_dim=64, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              max_position_embeddings=4096, full_attention_interval=4)


def measure(model, k: int, rejected: int, *, layers_only: bool, repeats: int = 5):
    target = MLXTarget(model, speculative=True)
    if not layers_only:
        target._mixers = []  # the fallback: the kept tokens through the whole model
    target.prefill(list(range(1, 258)))
    verify, rollback = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.launch(7, Draft(tokens=list(range(9, 9 + k))), SamplingConfig()).verdict()
        read = time.perf_counter()
        target.trim(rejected)
        mx.eval([c.state for c in target.cache])
        verify.append(read - start)
        rollback.append(time.perf_counter() - read)
    return statistics.median(verify[1:]), statistics.median(rollback[1:])


def main():
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    print(f"BLAS: {mlxspec.blas_in_use()}")
    print("| K | rejected | verify ms | layers' re-run ms (share) | whole re-run ms (share) |")
    print("|---|---|---|---|---|")
    for k in (1, 4, 8, 16):
        for rejected in sorted({k, max(1, k // 2)}):
            v1, r1 = measure(model, k, rejected, layers_only=True)
            v0, r0 = measure(model, k, rejected, layers_only=False)
            print(f"| {k} | {rejected} | {v1 * 1e3:.1f} | {r1 * 1e3:.1f} ({r1 / v1:.0%}) | "
                  f"{r0 * 1e3:.1f} ({r0 / v0:.0%}) |")


if __name__ == "__main__":
    main()
