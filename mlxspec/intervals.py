"""Confidence intervals over a benchmark's prompts: for tau, for speed, and for one configuration
against another.

A suite's tau (tokens per target pass) and its speed (tokens per second) are ratios of sums over
prompts, and prompts differ far more than repeated runs of one prompt do: whether a drafter beats
another on 10 prompts says little until the spread over prompts is known. A percentile bootstrap
over prompts gives that without assuming a distribution; comparing two configurations resamples
the same prompts for both (paired), so what the prompts share (a long repetitive answer helps
every drafter) cancels out.
"""

import math
import random
from typing import Sequence

RESAMPLES = 2000
LEVEL = 0.95

Sums = tuple[Sequence[float], Sequence[float]]  # (numerator, denominator) per prompt


def ratio_of_sums(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    total = sum(denominators)
    return sum(numerators) / total if total else math.nan  # e.g. resampled prompts that timed nothing


def tau_sums(passes: Sequence[int], accepted: Sequence[int]) -> Sums:
    """tau as a ratio of sums: every pass yields the target's own token plus its accepted drafts,
    so (tokens, passes) per prompt."""
    if len(passes) != len(accepted):
        raise ValueError(f"{len(passes)} prompts' passes but {len(accepted)} prompts' accepted")
    return [p + a for p, a in zip(passes, accepted)], passes


def tau(passes: Sequence[int], accepted: Sequence[int]) -> float:
    """Tokens per target pass."""
    return ratio_of_sums(*tau_sums(passes, accepted))


def _percentiles(values: list[float], level: float) -> list[float] | None:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return None
    low = int((1 - level) / 2 * len(values))
    return [values[low], values[len(values) - 1 - low]]


def _resamples(n: int, seed: int, resamples: int):
    rng = random.Random(seed)  # fixed: the same report gives the same interval
    for _ in range(resamples):
        yield [rng.randrange(n) for _ in range(n)]


def _pick(values: Sequence[float], indices: list[int]) -> list[float]:
    return [values[i] for i in indices]


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float], *,
                   level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> list[float] | None:
    """Bootstrap interval of sum(numerators) / sum(denominators) over prompts (one entry each);
    None under two prompts."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} prompts' numerators but {len(denominators)} "
                         "prompts' denominators")
    if len(numerators) < 2:
        return None
    return _percentiles([ratio_of_sums(_pick(numerators, idx), _pick(denominators, idx))
                         for idx in _resamples(len(numerators), seed, resamples)], level)


def tau_interval(passes: Sequence[int], accepted: Sequence[int], **options) -> list[float] | None:
    """Bootstrap interval of tau over prompts (passes and accepted drafts per prompt)."""
    return ratio_interval(*tau_sums(passes, accepted), **options)


def paired_ratio(a: Sums, b: Sums, *, level: float = LEVEL, resamples: int = RESAMPLES,
                 seed: int = 0) -> dict:
    """(sum a_num / sum a_den) / (sum b_num / sum b_den) on the same prompts, with a paired
    bootstrap interval, and on how many prompts each side's own ratio was higher."""
    (a_num, a_den), (b_num, b_den) = a, b
    n = len(a_num)
    if not (len(a_den) == len(b_num) == len(b_den) == n):
        raise ValueError("a paired comparison needs the same prompts on both sides")
    per_prompt = [(a_num[i] / a_den[i], b_num[i] / b_den[i])
                  for i in range(n) if a_den[i] and b_den[i]]
    result = {
        "ratio": ratio_of_sums(a_num, a_den) / ratio_of_sums(b_num, b_den),
        "interval": None,
        "prompts": n,
        "a_higher": sum(x > y for x, y in per_prompt),
        "b_higher": sum(y > x for x, y in per_prompt),
    }
    if n >= 2:
        result["interval"] = _percentiles(
            [ratio_of_sums(_pick(a_num, idx), _pick(a_den, idx))
             / ratio_of_sums(_pick(b_num, idx), _pick(b_den, idx))
             for idx in _resamples(n, seed, resamples)], level)
    return result


def paired_tau_ratio(a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]],
                     **options) -> dict:
    """tau(a) / tau(b) on the same prompts, each side given as (passes, accepted) per prompt."""
    return paired_ratio(tau_sums(*a), tau_sums(*b), **options)
