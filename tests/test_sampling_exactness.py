"""Sampled speculative decoding reproduces the target's distribution exactly (chi-squared).

A tiny target whose distribution over all 3-token continuations can be enumerated; thousands of
seeded speculative samples are compared with it. The same test run with a deliberately wrong rule
(resampling from q instead of the residual after a rejection) must fail, so the test has power.
"""

import itertools
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as scipy_stats
from tiny_models import tiny_llama

import mlxspec.backends.mlx.acceptance as mlx_acceptance
from mlxspec.backends.mlx.acceptance import accept_sampled
from mlxspec.drafters import DraftModelDrafter, LookupFirstDrafter, PromptLookupDrafter
from mlxspec.engine import Draft, Drafter, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig
from mlxspec.backends.mlx.sampling import processed_logprobs

VOCAB, LENGTH, PROMPT = 5, 3, [0, 1]
SAMPLES = 2500
SAMPLING = SamplingConfig(temp=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, seed=11, sharpness=2.5)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=12, sharpness=2.5)


class FixedDrafter(Drafter):
    """Deterministic (one-hot p) drafts that the target often disagrees with."""

    def propose(self, tokens, k, sampling):
        return Draft(tokens=[(tokens[-1] + 1 + i) % VOCAB for i in range(k)])


def exact_distribution(model, sampling):
    """P(x1..xL | prompt) for every continuation, from full forward passes of the target."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        tokens = mx.array(PROMPT + list(seq))[None]
        logq = processed_logprobs(model(tokens)[0], sampling)  # (P+L, V)
        steps = [logq[len(PROMPT) - 1 + i, seq[i]].item() for i in range(LENGTH)]
        probs[seq] = float(np.exp(sum(steps)))
    return probs


def sample_counts(model, drafter, sampling, num_draft=2):
    mx.random.seed(1234)
    counts = Counter()
    for _ in range(SAMPLES):
        target = MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True)
        out = speculative_tokens(
            target, drafter, PROMPT, sampling=sampling, max_tokens=LENGTH, num_draft=num_draft,
            stats=SpecStats(),
        )
        counts[tuple(t for t, _ in out)] += 1
    return counts


def chi_squared_pvalue(counts, probs):
    """Pearson chi-squared; cells with expected count < 5 are pooled into one."""
    expected = {seq: p * SAMPLES for seq, p in probs.items()}
    big = [s for s, e in expected.items() if e >= 5]
    small = [s for s in expected if s not in big]
    observed = [counts.get(s, 0) for s in big] + [sum(counts.get(s, 0) for s in small)]
    wanted = [expected[s] for s in big] + [sum(expected[s] for s in small)]
    assert sum(observed) == SAMPLES
    return scipy_stats.chisquare(observed, np.array(wanted) * SAMPLES / sum(wanted)).pvalue


@pytest.fixture(scope="module")
def exact(target):
    probs = exact_distribution(target, SAMPLING)
    assert abs(sum(probs.values()) - 1) < 1e-4
    assert max(probs.values()) < 0.5  # a real distribution, not nearly deterministic
    return probs


class CountingLookup(PromptLookupDrafter):
    drafted = 0

    def propose(self, tokens, k, sampling):
        draft = super().propose(tokens, k, sampling)
        self.drafted += bool(len(draft))
        return draft


class CountingDraftModel(DraftModelDrafter):
    drafted = 0

    def propose(self, tokens, k, sampling):
        self.drafted += 1
        return super().propose(tokens, k, sampling)


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("drafter_kind", ["plain", "fixed_one_hot", "draft_model",
                                          "draft_model+lookup"])
def test_spec_sampling_matches_target_distribution(target, draft_model, exact, drafter_kind):
    """draft_model+lookup: steps drafted one-hot (lookup) and from p (the draft model) mixed."""
    lookup, model = CountingLookup(), CountingDraftModel(draft_model)
    drafter = {"plain": Drafter(), "fixed_one_hot": FixedDrafter(),
               "draft_model": DraftModelDrafter(draft_model),
               "draft_model+lookup": LookupFirstDrafter(model, lookup)}[drafter_kind]
    pvalue = chi_squared_pvalue(sample_counts(target, drafter, SAMPLING), exact)
    assert pvalue > 0.001, f"{drafter_kind}: p = {pvalue:.2g}"
    if drafter_kind == "draft_model+lookup":
        assert lookup.drafted > SAMPLES / 20 and model.drafted > SAMPLES / 4  # both drafted


def wrong_rule(logits, drafts, draft_probs, sampling):
    """Accepts by the right test but resamples from q instead of the residual: biased."""
    accepted, _ = accept_sampled(logits, drafts, draft_probs, sampling)
    logq = processed_logprobs(logits, sampling)
    return accepted, mx.random.categorical(logq[accepted])


@pytest.mark.slow  # χ²: thousands of sampled generations
@pytest.mark.parametrize("drafter_kind", ["fixed_one_hot", "draft_model"])
def test_wrong_rule_is_caught(target, draft_model, exact, monkeypatch, drafter_kind):
    drafter = FixedDrafter() if drafter_kind == "fixed_one_hot" else DraftModelDrafter(draft_model)
    monkeypatch.setattr(mlx_acceptance, "accept_sampled", wrong_rule)
    pvalue = chi_squared_pvalue(sample_counts(target, drafter, SAMPLING), exact)
    assert pvalue < 1e-6, f"the test failed to catch a biased rule (p = {pvalue:.2g})"


def test_seeded_runs_are_reproducible(target, draft_model):
    def once():
        mx.random.seed(7)
        out = speculative_tokens(
            MLXTarget(target, speculative=True), DraftModelDrafter(draft_model), PROMPT,
            sampling=SAMPLING, max_tokens=20, num_draft=3, stats=SpecStats(),
        )
        return [t for t, _ in out]

    assert once() == once()


def test_processed_distribution_matches_numpy_top_p():
    """q's truncation agrees with a plain numpy nucleus filter (then temperature)."""
    logits = mx.random.normal((4, 50), key=mx.random.key(3)) * 3
    config = SamplingConfig(temp=0.7, top_p=0.8)
    ours = np.exp(np.array(processed_logprobs(logits, config)))
    for row, got in zip(np.array(logits), ours):
        p = np.exp(row - row.max())
        p /= p.sum()
        order = np.argsort(-p)
        keep = order[: np.searchsorted(np.cumsum(p[order]), 0.8) + 1]
        want = np.zeros_like(p)
        want[keep] = np.exp(row[keep] / 0.7 - (row[keep] / 0.7).max())
        np.testing.assert_allclose(got, want / want.sum(), atol=1e-5)


@pytest.mark.slow  # χ²: thousands of sampled generations
def test_spec_sampling_on_a_hybrid_target_matches_its_distribution():
    """A Qwen3-Next target (Gated DeltaNet + attention): one-hot drafts it often rejects, each
    rejection undone by restoring its recurrent states; the samples follow q exactly."""
    from tiny_models import tiny_qwen3_next

    hybrid = tiny_qwen3_next(vocab=VOCAB, seed=13)
    hybrid.lm_head.weight = hybrid.lm_head.weight * 2  # far from uniform, as the llama's
    probs = exact_distribution(hybrid, SAMPLING)
    assert abs(sum(probs.values()) - 1) < 1e-4 and max(probs.values()) < 0.5
    pvalue = chi_squared_pvalue(sample_counts(hybrid, FixedDrafter(), SAMPLING), probs)
    assert pvalue > 0.001, f"p = {pvalue:.2g}"
