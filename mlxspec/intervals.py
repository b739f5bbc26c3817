"""Confidence intervals for tau over a benchmark's prompts, and for one drafter against another.

A suite's tau is a ratio of sums over prompts (tokens per target pass), and prompts differ far more
than repeated runs of one prompt do: whether a drafter beats another on 10 prompts says little
until the spread over prompts is known. A percentile bootstrap over prompts gives that without
assuming a distribution; comparing two drafters resamples the same prompts for both (paired), so
what the prompts share (a long repetitive answer helps every drafter) cancels out.
"""

import random
from typing import Sequence

RESAMPLES = 2000
LEVEL = 0.95


def tau(passes: Sequence[int], accepted: Sequence[int]) -> float:
    """Tokens per target pass: every pass yields the target's own token plus its accepted drafts."""
    total = sum(passes)
    return (total + sum(accepted)) / total


def _percentiles(values: list[float], level: float) -> list[float]:
    values = sorted(values)
    low = int((1 - level) / 2 * len(values))
    return [values[low], values[len(values) - 1 - low]]


def _resampled_indices(n: int, seed: int, resamples: int):
    rng = random.Random(seed)  # fixed: the same report gives the same interval
    for _ in range(resamples):
        yield [rng.randrange(n) for _ in range(n)]


def tau_interval(passes: Sequence[int], accepted: Sequence[int], *, level: float = LEVEL,
                 resamples: int = RESAMPLES, seed: int = 0) -> list[float] | None:
    """Bootstrap interval of tau over prompts (one entry per prompt); None under two prompts."""
    if len(passes) != len(accepted):
        raise ValueError(f"{len(passes)} prompts' passes but {len(accepted)} prompts' accepted")
    if len(passes) < 2:
        return None
    taus = [tau([passes[i] for i in idx], [accepted[i] for i in idx])
            for idx in _resampled_indices(len(passes), seed, resamples)]
    return _percentiles(taus, level)


def paired_tau_ratio(a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]],
                     *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """tau(a) / tau(b) on the same prompts, (passes, accepted) per prompt each, with a paired
    bootstrap interval and how many prompts each side won (a prompt's own tau)."""
    (a_passes, a_accepted), (b_passes, b_accepted) = a, b
    n = len(a_passes)
    if not (len(a_accepted) == len(b_passes) == len(b_accepted) == n):
        raise ValueError("a paired comparison needs the same prompts on both sides")
    per_prompt = [(tau([a_passes[i]], [a_accepted[i]]), tau([b_passes[i]], [b_accepted[i]]))
                  for i in range(n) if a_passes[i] and b_passes[i]]
    result = {
        "ratio": tau(a_passes, a_accepted) / tau(b_passes, b_accepted),
        "interval": None,
        "prompts": n,
        "a_higher": sum(x > y for x, y in per_prompt),
        "b_higher": sum(y > x for x, y in per_prompt),
    }
    if n >= 2:
        ratios = []
        for idx in _resampled_indices(n, seed, resamples):
            a_tau = tau([a_passes[i] for i in idx], [a_accepted[i] for i in idx])
            ratios.append(a_tau / tau([b_passes[i] for i in idx], [b_accepted[i] for i in idx]))
        result["interval"] = _percentiles(ratios, level)
    return result
