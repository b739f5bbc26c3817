"""AdaptiveDraftLength on simulated steps: throughput against a fixed K = 1 and plain decoding,
by first-draft acceptance p and the cost of a K = 1 step (in plain steps), with and without the
near-break-even margin (`probe_margin`). Later drafts are accepted 10% of the time, each costs
0.1 of a step more, and step times carry ±10% noise; 20,000 steps, mean of 3 seeds.

    python benchmarks/adaptive_k_simulation.py
"""

import random

from mlxspec.engine import AdaptiveDraftLength


def simulate(p: float, cost: float, margin: float, steps: int = 20000, seed: int = 0) -> float:
    """Tokens per plain-step time under the policy."""
    rng = random.Random(seed)
    policy = AdaptiveDraftLength(8)
    policy.probe_margin = margin
    tokens = time = 0.0
    for _ in range(steps):
        k = policy.next_k()
        accepted = 0
        while accepted < k and rng.random() < (p if accepted == 0 else 0.1):
            accepted += 1
        seconds = (1.0 if k == 0 else cost + 0.1 * (k - 1)) * rng.uniform(0.9, 1.1)
        tokens, time = tokens + 1 + accepted, time + seconds
        policy.update(k, accepted, seconds)
    return tokens / time


def main() -> None:
    print("| p | K = 1 step cost | fixed K = 1 / plain | adaptive, no margin | "
          "adaptive, margin 0.95 |")
    print("|---|---|---|---|---|")
    for p, cost in ((0.5, 1.2), (0.31, 1.24), (0.25, 1.2), (0.2, 1.24), (0.1, 1.2)):
        runs = [sum(simulate(p, cost, m, seed=s) for s in range(3)) / 3 for m in (1.0, 0.95)]
        print(f"| {p} | {cost} | {(1 + p) / cost:.3f} | {runs[0]:.3f} | {runs[1]:.3f} |")


if __name__ == "__main__":
    main()
