"""What verifying a tree costs against a chain of as many drafts, on the default model.

SmolLM2-135M (dense fp32, OpenBLAS), 256 tokens of context; for N = 4, 8, 16, 32 draft nodes a
pass over [pending, N nodes] as a chain (mlx-lm's causal fast path) and as a tree (the ancestor
mask and per-node RoPE positions of mlxspec.backends.mlx.tree_pass: a binary tree, and the best-first shape
DDTree grows from a peaked distribution), then the cache kept for a 3-node branch of it. Medians
of 7 after one warm-up; the plain decode step (N = 0) is the unit.

    .venv/bin/python benchmarks/tree_verify_cost.py
"""

import statistics
import time

import mlxspec
import mlx.core as mx

from mlxspec.engine import Draft, Verdict
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig
from mlxspec.tree import TreeShape, best_first_tree


def binary(n: int) -> TreeShape:
    return TreeShape(tuple((i - 1) // 2 if i > 1 else 0 for i in range(1, n + 1)))


def ddtree(n: int) -> TreeShape:
    logprobs = [[-0.2, -1.8, -2.5, -3.0] for _ in range(15)]
    return best_first_tree(logprobs, n)[1]


def timed(model, parents, n: int, repeats: int = 7) -> tuple[float, float]:
    target = MLXTarget(model, speculative=True)
    target.prefill(list(range(100, 357)))
    verify, settle = [], []
    for _ in range(repeats + 1):
        draft = Draft(tokens=list(range(1000, 1000 + n)), parents=parents)
        start = time.perf_counter()
        result = target.launch(7, draft, SamplingConfig())
        result.verdict()
        middle = time.perf_counter()
        if parents is None:
            target.trim(n)
        else:
            branch = TreeShape(parents).first_chain()[:3]
            target.settle(Verdict(draft_tokens=draft.tokens, accepted=len(branch),
                                  next_token=1, branch=branch))
            target.trim(len(branch))
        mx.eval([c.state for c in target.cache])
        verify.append(middle - start)
        settle.append(time.perf_counter() - middle)
    return statistics.median(verify[1:]), statistics.median(settle[1:])


def main():
    model, _ = mlxspec.load(None)
    print(f"BLAS: {mlxspec.blas_in_use()}")
    plain, _ = timed(model, None, 0)
    print(f"plain decode step: {plain * 1e3:.1f} ms")
    print("| N | chain ms (x plain) | binary tree ms (x chain) | DDTree-shaped ms (x chain) "
          "| keeping a branch ms |")
    print("|---|---|---|---|---|")
    for n in (4, 8, 16, 32):
        chain, _ = timed(model, None, n)
        tree, keep = timed(model, binary(n).parents, n)
        dd, _ = timed(model, ddtree(n).parents, n)
        print(f"| {n} | {chain * 1e3:.1f} ({chain / plain:.2f}x) | {tree * 1e3:.1f} "
              f"({tree / chain:.2f}x) | {dd * 1e3:.1f} ({dd / chain:.2f}x) | {keep * 1e3:.2f} |")


if __name__ == "__main__":
    main()
