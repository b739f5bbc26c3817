"""The shared loop on tiny models: identity, stats accounting, cache rollback, bad input."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from tiny_models import tiny_llama

from mlxspec.drafters import DraftModelDrafter, LookupFirstDrafter, PromptLookupDrafter, load_drafter
from mlxspec.draft_length import AdaptiveDraftLength, PerSourceDraftLength
from mlxspec.engine import Draft, Drafter, SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.sampling import SamplingConfig

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=40, seed=1, sharpness=8.0)


@pytest.fixture(scope="module")
def small_draft():
    return tiny_llama(vocab=40, hidden=16, layers=1, seed=2, sharpness=8.0)


class ScriptedDrafter(Drafter):
    """Proposes a fixed token pattern: accept/reject patterns the test can predict."""

    name = "scripted"

    def __init__(self, pattern):
        self.pattern = pattern

    def propose(self, tokens, k, sampling):
        return Draft(tokens=[self.pattern[(len(tokens) + i) % len(self.pattern)] for i in range(k)])


def run(model, drafter, prompt, max_tokens=40, k=4, sampling=GREEDY):
    stats = SpecStats()
    target = MLXTarget(model, speculative=True)
    out = list(
        speculative_tokens(
            target, drafter, prompt, sampling=sampling, max_tokens=max_tokens, num_draft=k,
            stats=stats,
        )
    )
    return [t for t, _ in out], [d for _, d in out], stats, target


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7], [5, 9, 11, 13, 5, 9, 11, 13, 5, 9], [3]]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_identity_every_drafter(target, small_draft, prompt, k):
    plain, _, plain_stats, _ = run(target, Drafter(), prompt, k=k)
    assert plain_stats.tau == 1.0 and plain_stats.target_passes == 40
    for drafter in (
        PromptLookupDrafter(),
        DraftModelDrafter(small_draft),
        ScriptedDrafter([1, 2, 3, 5, 8]),
        LookupFirstDrafter(DraftModelDrafter(small_draft)),
        LookupFirstDrafter(ScriptedDrafter([1, 2, 3, 5, 8])),
    ):
        out, _, stats, _ = run(target, drafter, prompt, k=k)
        assert out == plain, drafter.name
        assert stats.generated == 40
        assert stats.accepted + stats.target_passes == 40  # every pass adds exactly one own token


def test_draft_equal_to_target_accepts_everything(target):
    k = 4
    out, from_draft, stats, _ = run(target, DraftModelDrafter(target), [1, 2, 3], max_tokens=20, k=k)
    assert stats.acceptance_per_position == [1.0] * k
    assert stats.tau == 5.0
    # Each pass: k drafted tokens then the target's own one.
    assert from_draft == ([True] * k + [False]) * 4


def test_stats_per_position_accounting(target):
    _, _, stats, _ = run(target, ScriptedDrafter([1, 2, 3, 5, 8]), [1, 2, 3], k=3)
    assert stats.drafted == sum(stats.drafted_per_position)
    assert stats.accepted == sum(stats.accepted_per_position)
    rates = stats.acceptance_per_position
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # acceptance only stops, never resumes


def cache_arrays(cache, length):
    return [(c.keys[..., :length, :], c.values[..., :length, :]) for c in cache]


@pytest.mark.parametrize("drafter_kind", ["scripted", "self", "small"])
def test_cache_rollback_equals_fresh_cache(target, small_draft, drafter_kind):
    drafter = {
        "scripted": ScriptedDrafter([4, 4, 9, 1]),
        "self": DraftModelDrafter(target),
        "small": DraftModelDrafter(small_draft),
    }[drafter_kind]
    prompt = [1, 2, 3, 4, 5]
    out, _, stats, spec_target = run(target, drafter, prompt, max_tokens=25, k=5)
    committed = prompt + out
    assert spec_target.offset == len(committed) - 1  # everything but the pending token

    fresh = make_prompt_cache(target)
    target(mx.array(committed[:-1])[None], cache=fresh)
    for (k1, v1), (k2, v2) in zip(cache_arrays(spec_target.cache, len(committed) - 1),
                                  cache_arrays(fresh, len(committed) - 1)):
        assert mx.allclose(k1, k2, atol=1e-4).item() and mx.allclose(v1, v2, atol=1e-4).item()


def test_draft_model_cache_reuses_valid_prefix(target, small_draft):
    drafter = DraftModelDrafter(small_draft)
    run(target, drafter, [1, 2, 3, 4], max_tokens=30, k=4)
    # The draft cache holds exactly the tokens it believes it has seen.
    assert drafter.cache[0].offset == len(drafter._seen)


def test_lookup_proposes_most_recent_match():
    lookup = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    tokens = [5, 6, 1, 5, 6, 2, 3, 5, 6]
    assert lookup.propose(tokens, 3, GREEDY).tokens == [2, 3, 5]
    assert lookup.propose(tokens + [2], 2, GREEDY).tokens == [3, 5]  # index grows incrementally
    assert len(lookup.propose([1, 2, 3, 4], 3, GREEDY)) == 0


class RecordingDrafter(ScriptedDrafter):
    """A scripted model drafter that records when it is asked and told."""

    def __init__(self, pattern):
        super().__init__(pattern)
        self.proposed, self.committed = [], []

    def propose(self, tokens, k, sampling):
        self.proposed.append(len(tokens))
        return super().propose(tokens, k, sampling)

    def commit(self, tokens, verdict):
        self.committed.append(len(tokens))


def test_lookup_first_drafts_by_lookup_where_it_matches_else_by_the_model(target):
    model = RecordingDrafter([9])
    hybrid = LookupFirstDrafter(model)
    assert hybrid.name == "scripted+lookup"
    hybrid.begin([5, 6, 7])
    assert not hybrid.copies([5, 6, 7])
    assert hybrid.propose([5, 6, 7], 3, GREEDY).tokens == [9, 9, 9] and model.proposed == [3]
    assert hybrid.copies([5, 6, 7, 5])
    assert hybrid.propose([5, 6, 7, 5], 3, GREEDY).tokens == [6, 7, 5] and model.proposed == [3]
    # In the loop: lossless, and the model drafter is told every verdict, drafting or not.
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    plain, _, _, _ = run(target, Drafter(), prompt, k=4)
    model = RecordingDrafter([1, 2, 3, 5, 8])
    out, _, stats, _ = run(target, LookupFirstDrafter(model), prompt, k=4)
    assert out == plain
    assert len(model.committed) == stats.target_passes
    assert 0 < len(model.proposed) < stats.target_passes  # both sources drafted


def test_lookup_first_keeps_one_adaptive_policy_per_source():
    copying = [True]
    policy = PerSourceDraftLength(lambda: copying[0], AdaptiveDraftLength(8),
                                  AdaptiveDraftLength(8))
    for _ in range(60):  # lookup's drafts all accepted, the model's never (ten-step memory)
        for copies, accepted in ((True, 8), (False, 0)):
            copying[0] = copies
            k = policy.next_k()
            policy.update(k, min(accepted, k), 1.0 + 0.05 * k)
    assert min(policy.copier.conditional) > 0.9 and policy.model.conditional[0] < 0.3
    copying[0] = True
    assert policy.next_k() == 8
    copying[0] = False
    assert policy.next_k() <= 1
    hybrid = LookupFirstDrafter(Drafter())
    assert hybrid.draft_policy(8, True) is hybrid.draft_policy(8, True)
    assert hybrid.draft_policy(8, False) is not hybrid.draft_policy(8, True)


def test_bad_input(target):
    with pytest.raises(ValueError, match="num_draft"):
        run(target, PromptLookupDrafter(), [1, 2], k=0)
    with pytest.raises(ValueError, match="unknown drafter"):
        load_drafter("hydra", model=target, tokenizer=None)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_max_tokens_and_context_window_respected(target):
    out, _, stats, _ = run(target, DraftModelDrafter(target), [1, 2, 3], max_tokens=7, k=4)
    assert len(out) == 7 and stats.generated == 7
    # Near the end of the context window drafts shrink instead of overflowing.
    prompt = list(range(1, 40)) * 6 + [1] * 10  # 244 tokens, window 256
    out, _, _, spec_target = run(target, DraftModelDrafter(target), prompt, max_tokens=12, k=8)
    assert len(out) == 12 and spec_target.offset <= 256


class CpuLikeCosts(AdaptiveDraftLength):
    """Step time as on a CPU (each verified draft costs 20% of a step), not the wall clock, so
    the test is deterministic."""

    def update(self, drafted, accepted, seconds=None):
        super().update(drafted, accepted, 1.0 + 0.2 * drafted)


def run_adaptive(model, drafter, prompt, max_tokens=60, k=6):
    stats = SpecStats()
    out = speculative_tokens(
        MLXTarget(model, speculative=True), drafter, prompt, sampling=GREEDY,
        max_tokens=max_tokens, num_draft=k, stats=stats, adaptive=CpuLikeCosts(k),
    )
    return [t for t, _ in out], stats


def test_adaptive_draft_length_is_lossless_and_backs_off(target, small_draft):
    prompt = [1, 2, 3, 4, 5]
    plain, _, _, _ = run(target, Drafter(), prompt, max_tokens=60)
    full = prompt + plain

    class AlwaysWrong(Drafter):  # proposes a token the target will not produce there
        def propose(self, tokens, k, sampling):
            return Draft(tokens=[(full[len(tokens)] + 1) % 40] * k)

    wrong = AlwaysWrong()
    out, stats = run_adaptive(target, wrong, prompt)
    assert out == plain
    _, _, fixed_stats, _ = run(target, wrong, prompt, max_tokens=60, k=6)
    assert stats.accepted == 0 and stats.drafted < fixed_stats.drafted / 4
    # A perfect drafter keeps drafting the full K.
    out, stats = run_adaptive(target, DraftModelDrafter(target), prompt)
    assert out == plain and stats.tau > 4


def timed(policy, seconds: dict, steps: int = 1) -> None:
    """`policy` timed `steps` steps at each K of `seconds` (K -> a step's seconds)."""
    for k, step in seconds.items():
        for _ in range(steps):
            policy.step_cost.record(k + 1, step, int(k > 0))


def test_adaptive_choice_follows_measured_costs():
    policy = AdaptiveDraftLength(8)
    for _ in range(60):  # every draft accepted, verifying is cheap: draft the most
        policy.update(8, 8, 1.0 + 0.01 * 8)
        policy.update(0, 0, 1.0)
    assert policy.next_k() == 8
    policy = AdaptiveDraftLength(8)
    for _ in range(60):  # half the first drafts accepted, each verified draft costs 60%
        policy.update(2, 1, 1.0 + 0.6 * 2)
        policy.update(1, 0, 1.0 + 0.6)
        policy.update(0, 0, 1.0)
    assert policy.next_k() == 0


def test_adaptive_k_keeps_drafting_near_break_even():
    """A K = 1 step costing 1.24 plain steps breaks even at a first-draft acceptance of 0.24.
    Estimated at 0.22, drafting is within 5% of not drafting: it drafts one (cheap, and it keeps
    the estimate up to date, where drafting nothing would leave it stale until the next probe).
    (Drafting, every 8th step it measures K = 2, expected within 10% of K = 1.)"""
    policy = AdaptiveDraftLength(4)
    timed(policy, {0: 1.0, 1: 1.24, 2: 1.34})
    policy.conditional = [0.22, 0.0, 0.0, 0.0]
    assert [policy.next_k() for _ in range(16)] == ([1] * 7 + [2]) * 2


@pytest.mark.parametrize("cost, every", [(1.24, 10), (2.0, 48)])
def test_adaptive_k_probes_as_often_as_a_probe_is_cheap(cost, every):
    """Drafting nothing, it probes K = 1 once the plain steps since the last probe outnumber
    what a probe is expected to lose (in plain steps' tokens) 1 / probe_share times over:
    estimated at 0.05, a K = 1 step costing 1.24 plain steps loses 0.19 of a step (a probe
    every 10 steps), one costing 2 loses 0.95 (every 48), so probes cost at most 2% either way."""
    policy = AdaptiveDraftLength(4)
    timed(policy, {0: 1.0, 1: cost})
    policy.conditional = [0.05, 0.0, 0.0, 0.0]
    ks = [policy.next_k() for _ in range(2 * every)]
    assert ks == ([0] * (every - 1) + [1]) * 2


def test_adaptive_time_line_weighs_each_k_by_its_samples():
    """K = 3 and 4 timed 40 times each (0.1 plain steps a draft), K = 6 once and slowly (a
    noisy probe): the line follows the many samples and a long draft stays the choice; at equal
    weights the one slow sample tilts the line and a shorter K wins. (Before the one time model
    the tilted line put a drafting step's intercept below the plain step's, a drafted step
    modelled cheaper than a plain one, and K = 1 won; StepCost keeps d >= 0.)"""
    def fitted(cap):
        policy = AdaptiveDraftLength(8)
        policy.step_cost.weight_cap, policy.neighbour_margin = cap, float("inf")
        policy.conditional = [0.8] * 8
        for _ in range(40):
            policy.update(3, 3, 1.4)
            policy.update(4, 4, 1.5)
            policy.update(0, 0, 1.0)
        policy.update(6, 0, 2.5)
        return policy.next_k(), policy.time_line()[2]
    (k_weighted, slope_weighted), (k_equal, slope_equal) = fitted(8), fitted(1)
    assert slope_weighted < slope_equal and k_weighted > k_equal >= 3


def test_adaptive_k_expects_an_untried_position_to_do_as_the_one_before():
    """A drafter accepted in full at K = 3 for 40 steps: positions 4-8, never drafted, are
    expected near position 3's estimate (a flat prior of 0.6 held them there and kept K at 3-4
    where a fixed K = 8 ran 1.3x faster), so with drafts costing a tenth of a step K grows."""
    policy = AdaptiveDraftLength(8)
    policy.neighbour_margin = float("inf")
    for _ in range(40):
        policy.update(3, 3, 1.3)
        policy.update(0, 0, 1.0)
    estimates = policy.conditional
    assert min(estimates[:3]) > 0.95
    assert estimates[3:] == pytest.approx([estimates[2]] * 5)
    assert policy.next_k() == 8
    policy.update(8, 3, 1.8)  # position 4 rejected once: it and the untried ones after it drop
    assert policy.conditional[3] < estimates[3] and policy.conditional[4:] == pytest.approx(
        [policy.conditional[3]] * 4)


def test_adaptive_k_measures_its_neighbour():
    """Where K + 1 is expected nearly as fast as the chosen K, every probe_every drafting
    steps K + 1 is run instead, so the line is measured there and not only extrapolated."""
    policy = AdaptiveDraftLength(8)
    timed(policy, {0: 1.0, 2: 1.5, 3: 1.8}, steps=9)
    policy.conditional = [0.7] * 8
    chosen = [policy.next_k() for _ in range(16)]
    best = chosen[0]
    assert chosen == ([best] * 7 + [best + 1]) * 2
    policy.neighbour_margin = float("inf")
    assert {policy.next_k() for _ in range(16)} == {best}


def test_a_rows_first_step_is_not_timed(target):
    """The first step after a prompt carries one-off work (a draft model prefilling the prompt):
    timed, it made the K in use look several times slower, and the policy, kept from prompt to
    prompt, drafted short (the Qwen2.5-Coder pair at T = 1: 0.79x of a fixed K = 4). Every later
    step is timed."""
    class Recording(AdaptiveDraftLength):
        def update(self, drafted, accepted, seconds=None):
            self.seconds.append(seconds)
            super().update(drafted, accepted, seconds)

    policy = Recording(4)
    policy.seconds = []
    for prompt in ([1, 2, 3, 4, 5], [7, 8, 9]):
        start = len(policy.seconds)
        list(speculative_tokens(MLXTarget(target, speculative=True), DraftModelDrafter(target),
                                prompt, sampling=GREEDY, max_tokens=20, num_draft=4,
                                stats=SpecStats(), adaptive=policy))
        timed = policy.seconds[start:]
        assert len(timed) > 2 and timed[0] is None
        assert all(s is not None and s > 0 for s in timed[1:])


def test_adaptive_policy_carries_over_between_generations(target):
    """The drafter keeps its adaptive-K policy across calls (greedy and sampled apart): what one
    prompt taught about acceptance is where the next starts."""
    from mlxspec.drafters import PromptLookupDrafter

    drafter = PromptLookupDrafter()
    policy = drafter.draft_policy(6, True)
    assert drafter.draft_policy(6, True) is policy and drafter.draft_policy(6, False) is not policy
    before = list(policy.conditional)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    list(speculative_tokens(MLXTarget(target, speculative=True), drafter, prompt,
                            sampling=GREEDY, max_tokens=20, num_draft=6, stats=SpecStats(),
                            adaptive=True))
    assert drafter.draft_policy(6, True) is policy and policy.conditional != before


# ---- Stop tokens and caches that cannot roll back ---------------------------------------------


def test_stats_count_what_was_emitted_when_a_stop_token_ends_a_block(target):
    """A block accepted past a stop token emits up to the stop token only, and so do the stats
    (they used to count the whole block: tau 7.5 reported for a true 6.5)."""
    prompt = [1, 2, 3]
    plain, _, _, _ = run(target, Drafter(), prompt, max_tokens=30)
    stop = 9  # the stop token falls inside the second block of the perfect drafter's drafts
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(
        MLXTarget(target, speculative=True), DraftModelDrafter(target), prompt, sampling=GREEDY,
        max_tokens=30, num_draft=6, stats=stats, stop_tokens={plain[stop]})]
    first = plain.index(plain[stop])  # the stop token's first occurrence ends the generation
    assert out == plain[: first + 1]
    passes, drafted, accepted = perfect_drafter_stats(len(out), 6)
    assert (stats.target_passes, stats.drafted, stats.accepted, stats.generated) == (
        passes, drafted, accepted, len(out))
    assert stats.accepted == sum(stats.accepted_per_position)
    assert stats.drafted == sum(stats.drafted_per_position)


def perfect_drafter_stats(emitted: int, k: int) -> tuple[int, int, int]:
    """(passes, drafted, accepted) of a drafter always right at K = k whose generation a stop
    token ended after `emitted` tokens: each pass commits k + 1, and a last pass that stopped
    inside its drafts counts as the draft cut at the stop token."""
    passes, last = -(-emitted // (k + 1)), (emitted - 1) % (k + 1) + 1
    drafts = k * (passes - 1) + min(last, k)
    return passes, drafts, drafts


def test_stream_stats_exact_when_eos_comes_inside_an_accepted_block(target, smollm_dir):
    """Through the API: the final response's tau and accepted count cover the emitted tokens
    (EOS included, as one committed token), not the tokens the block held after it."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.utils import load_tokenizer

    import mlxspec

    prompt = [4, 5, 6]
    plain, _, _, _ = run(target, Drafter(), prompt, max_tokens=30)
    eos = plain[9]
    tokenizer = TokenizerWrapper(load_tokenizer(smollm_dir)._tokenizer, eos_token_ids={eos})
    last = list(mlxspec.stream_generate(target, tokenizer, prompt, 30,
                                        drafter=DraftModelDrafter(target), num_draft=6,
                                        adaptive=False))[-1]
    emitted = next(i for i, t in enumerate(plain) if t in tokenizer.eos_token_ids) + 1
    assert emitted > 7  # past the first block
    assert last.finish_reason == "stop" and last.generation_tokens == emitted - 1
    passes, drafted, accepted = perfect_drafter_stats(emitted, 6)
    assert (last.target_passes, last.drafted, last.accepted) == (passes, drafted, accepted)
    assert last.tau == pytest.approx(emitted / passes)


def rotating_cache(model, window):
    return [RotatingKVCache(max_size=window) for _ in model.layers]


def test_sliding_window_cache_is_lossless_and_drafts_stop_at_its_edge(target, small_draft):
    """A RotatingKVCache rolls back only while a pass stays inside its window: a pass that
    crossed it (drafts, then a rejection) corrupted the cache and changed the output. Past the
    window, steps run plain, decided before the drafter is asked: a draft model fed drafts
    that were then thrown away kept a cache out of step with its own record (87 vs 76)."""
    prompt, n, window = [1, 2, 3, 4, 5], 30, 12
    reference = []
    cache = rotating_cache(target, window)
    logits = target(mx.array(prompt)[None], cache=cache)
    for _ in range(n):  # plain decoding, one token at a time, outside the loop
        reference.append(int(mx.argmax(logits[0, -1]).item()))
        logits = target(mx.array([[reference[-1]]]), cache=cache)
    for k in (1, 3, 6):
        drafter, stats = DraftModelDrafter(small_draft), SpecStats()
        spec_target = MLXTarget(target, speculative=True, cache=rotating_cache(target, window))
        out = [t for t, _ in speculative_tokens(spec_target, drafter, prompt, sampling=GREEDY,
                                                max_tokens=n, num_draft=k, stats=stats)]
        assert out == reference, k
        assert stats.plain_fallback_steps > 0 and stats.drafted > 0
        assert drafter.cache[0].offset == len(drafter._seen)
