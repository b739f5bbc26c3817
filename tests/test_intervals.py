"""Bootstrap intervals for tau over prompts, and the paired comparison of two drafters."""

import pytest

from mlxspec.intervals import paired_ratio, paired_tau_ratio, ratio_interval, tau, tau_interval


def test_tau_is_tokens_per_target_pass():
    assert tau([10, 30], [5, 15]) == pytest.approx(1.5)


def test_identical_prompts_leave_no_spread():
    assert tau_interval([10] * 5, [4] * 5) == pytest.approx([1.4, 1.4])


def test_interval_brackets_tau_is_reproducible_and_shrinks_with_more_prompts():
    passes = [40, 20, 35, 50, 25, 45, 30, 38]
    accepted = [10, 25, 5, 40, 2, 30, 12, 8]
    few = tau_interval(passes, accepted)
    assert few[0] < tau(passes, accepted) < few[1]
    assert tau_interval(passes, accepted) == few  # a fixed seed: the same report, the same bounds
    many = tau_interval(passes * 9, accepted * 9)
    assert many[1] - many[0] < 0.5 * (few[1] - few[0])  # ~1/3 the width for 9x the prompts
    assert tau_interval([10], [3]) is None


def test_pairing_cancels_what_the_prompts_share():
    """Drafter a gets 10% more accepted drafts than b on every prompt, while prompts range from
    nothing to copy to long copies: paired over prompts the ratio's interval stays above 1, where
    two independent resamplings of the same numbers would straddle it."""
    passes = [40, 40, 40, 40, 40, 40, 40, 40, 40, 40]
    b_accepted = [0, 60, 4, 50, 2, 40, 10, 70, 6, 30]
    a_accepted = [round(x * 1.1) + 1 for x in b_accepted]
    result = paired_tau_ratio((passes, a_accepted), (passes, b_accepted))
    assert result["ratio"] == pytest.approx(tau(passes, a_accepted) / tau(passes, b_accepted))
    assert 1 < result["interval"][0] < result["ratio"] < result["interval"][1]
    assert (result["a_higher"], result["b_higher"], result["prompts"]) == (10, 0, 10)
    a_alone, b_alone = tau_interval(passes, a_accepted), tau_interval(passes, b_accepted)
    assert a_alone[0] / b_alone[1] < 1  # unpaired bounds overlap


def test_mismatched_prompt_counts_are_refused():
    with pytest.raises(ValueError, match="passes"):
        tau_interval([1, 2], [1])
    with pytest.raises(ValueError, match="same prompts"):
        paired_tau_ratio(([1, 2], [0, 0]), ([1], [0]))


def test_speed_is_compared_paired_and_prompts_that_timed_nothing_are_skipped():
    """tok/s as a ratio of sums (tokens, seconds per prompt); a prompt with no timed tokens (a
    one-token answer) has no rate of its own and counts for neither side."""
    a = ([60, 60, 0, 60], [3.0, 2.0, 0.0, 4.0])
    b = ([60, 60, 0, 60], [4.0, 2.5, 0.0, 5.0])
    result = paired_ratio(a, b)
    assert result["ratio"] == pytest.approx((180 / 9.0) / (180 / 11.5))
    assert (result["a_higher"], result["b_higher"]) == (3, 0)
    low, high = result["interval"]
    assert 1 < low <= result["ratio"] <= high
    assert ratio_interval([0, 0], [0.0, 0.0]) is None  # nothing timed at all: no interval
