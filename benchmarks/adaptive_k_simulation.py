"""AdaptiveDraftLength on simulated steps, three scenarios.

1. Near break-even (`probe_margin`): throughput against a fixed K = 1 and plain decoding, by
   first-draft acceptance p and the cost of a K = 1 step (in plain steps). Later drafts are
   accepted 10% of the time, each costs 0.1 of a step more, and step times carry ±10% noise;
   20,000 steps, mean of 3 seeds.
2. Finding the best K (the step cost's weights, `StepCost.weight_cap`, and the neighbour probe,
   `neighbour_margin`): adaptive over the best fixed K of 0..14, by per-position acceptance p
   and the cost of one more draft (in plain steps; a drafting step costs 0.15 more than a plain
   one), with lognormal step-time noise; 300 steps (a short answer) and 2,000, mean of 20 seeds.

3. Probes while drafting nothing (`probe_share`): adaptive over the better of plain decoding
   and a fixed K = 1, by p and the K = 1 step's cost, against probing every 8th plain step
   whatever a probe costs (the rule before); 3,000 steps, mean of 10 seeds.

    python benchmarks/adaptive_k_simulation.py
"""

import random

from mlxspec.draft_length import AdaptiveDraftLength


def run(policy: AdaptiveDraftLength, steps: int, seed: int, accept, seconds,
        fixed: int | None = None) -> float:
    """Tokens per plain-step time under the policy (or a fixed K): draft i is accepted with
    probability accept(i) if every one before it was; a step at K takes seconds(K, rng)."""
    rng = random.Random(seed)
    tokens = time = 0.0
    for _ in range(steps):
        k = fixed if fixed is not None else policy.next_k()
        accepted = 0
        while accepted < k and rng.random() < accept(accepted):
            accepted += 1
        step = seconds(k, rng)
        tokens, time = tokens + 1 + accepted, time + step
        policy.update(k, accepted, step)
    return tokens / time


def simulate(p: float, cost: float, margin: float, steps: int = 20000, seed: int = 0) -> float:
    """Scenario 1: first draft accepted with p, later ones 10%; a K = 1 step costs `cost`."""
    policy = AdaptiveDraftLength(8)
    policy.probe_margin = margin
    return run(policy, steps, seed, lambda i: p if i == 0 else 0.1,
               lambda k, rng: (1.0 if k == 0 else cost + 0.1 * (k - 1)) * rng.uniform(0.9, 1.1))


def simulate_long(p: float, slope: float, noise: float, steps: int, seed: int,
                  fixed: int | None = None, weight_cap: int = 8,
                  neighbour: float = 0.9) -> float:
    """Scenario 2: every position accepted with probability p, a step costing
    (1 + 0.15 [K > 0] + slope K) x lognormal(0, noise)."""
    policy = AdaptiveDraftLength(15)
    policy.step_cost.weight_cap, policy.neighbour_margin = weight_cap, neighbour
    return run(policy, steps, seed, lambda i: p,
               lambda k, rng: (1.0 + 0.15 * (k > 0) + slope * k) * rng.lognormvariate(0.0, noise),
               fixed=fixed)


def margin_table() -> None:
    print("| p | K = 1 step cost | fixed K = 1 / plain | adaptive, no margin | "
          "adaptive, margin 0.95 |")
    print("|---|---|---|---|---|")
    for p, cost in ((0.5, 1.2), (0.31, 1.24), (0.25, 1.2), (0.2, 1.24), (0.1, 1.2)):
        runs = [sum(simulate(p, cost, m, seed=s) for s in range(3)) / 3 for m in (1.0, 0.95)]
        print(f"| {p} | {cost} | {(1 + p) / cost:.3f} | {runs[0]:.3f} | {runs[1]:.3f} |")


def best_k_table(seeds: int = 20) -> None:
    print("| noise | steps | p | cost per draft | best fixed K | equal weights, no probe | "
          "weighted fit | weighted fit + neighbour probe |")
    print("|---|---|---|---|---|---|---|---|")
    for noise in (0.1, 0.3):
        for steps in (300, 2000):
            for p, slope in ((0.95, 0.05), (0.9, 0.35), (0.8, 0.35), (0.8, 0.1), (0.7, 0.35),
                             (0.6, 0.02), (0.5, 0.35)):
                def mean(**options):
                    return sum(simulate_long(p, slope, noise, steps, s, **options)
                               for s in range(seeds)) / seeds
                fixed = {k: mean(fixed=k) for k in range(15)}
                best = max(fixed, key=fixed.get)
                runs = [mean(weight_cap=1, neighbour=float("inf")),
                        mean(neighbour=float("inf")), mean()]
                print(f"| {noise} | {steps} | {p} | {slope} | {best} | "
                      + " | ".join(f"{r / fixed[best]:.3f}" for r in runs) + " |")


class EveryEighthProbe(AdaptiveDraftLength):
    """The rule before probe_share: drafting nothing, a probe every 8th step, whatever it
    costs."""

    def _probe_due(self, loss: float) -> bool:
        return self.idle_steps >= 8


def probe_table(seeds: int = 10) -> None:
    print("| p | K = 1 step cost | fixed K = 1 / plain | probe every 8th step | probe_share 0.02 |")
    print("|---|---|---|---|---|")
    for p, cost in ((0.31, 1.24), (0.31, 1.34), (0.2, 1.24), (0.1, 1.2), (0.05, 1.5),
                    (0.02, 2.0)):
        best = max(1.0, (1 + p) / cost)

        def mean(policy_class):
            return sum(run(policy_class(8), 3000, s, lambda i: p if i == 0 else 0.1,
                           lambda k, rng: (1.0 if k == 0 else cost + 0.1 * (k - 1))
                           * rng.uniform(0.9, 1.1)) for s in range(seeds)) / seeds
        print(f"| {p} | {cost} | {(1 + p) / cost:.3f} | {mean(EveryEighthProbe) / best:.3f} | "
              f"{mean(AdaptiveDraftLength) / best:.3f} |")


def main() -> None:
    margin_table()
    print()
    best_k_table()
    print()
    probe_table()


if __name__ == "__main__":
    main()
