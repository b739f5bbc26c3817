"""The batch's shared pass width (VerifyBudget) and how the loop feeds it, from recorded costs
and acceptances: no timing, every decision worked out by hand from the cost model
a + b·positions + d·drafting rows (draft_length.StepCost; a prior and a floor on b are shares of
a one-position step, a + b)."""

import pytest

from mlxspec.draft_length import VerifyBudget
from mlxspec.engine import Draft


def measured(a: float, b: float, d: float, steps) -> VerifyBudget:
    """A budget that has seen `steps` (rows, width, drafting rows) cost exactly a + b·P + d·D."""
    budget = VerifyBudget(8)
    for rows, width, drafting in steps:
        budget.record(rows * width, a + b * rows * width + d * drafting, drafting)
    return budget


PLAIN_AND_TWO_WIDTHS = [(8, 1, 0), (8, 2, 8), (8, 3, 8)]


def test_the_cost_separates_drafting_rows_from_verified_positions():
    """Plain steps and two drafted widths tell apart the pass's fixed part, each position and
    each drafting row's drafter pass (DFlash's), which the width does not change."""
    budget = measured(0.010, 0.001, 0.004, PLAIN_AND_TWO_WIDTHS)
    assert budget.cost() == pytest.approx((0.010, 0.001, 0.004))
    assert budget.step_seconds(8, 0, 0) == pytest.approx(0.018)
    assert budget.step_seconds(8, 2, 8) == pytest.approx(0.010 + 0.024 + 0.032)


def test_before_plain_and_drafted_steps_are_both_measured_the_cost_is_a_line():
    """Drafted steps only: a line through positions (no drafting term); one step size: that
    point and the prior slope (a position costs 10% of a one-position step, a + b); nothing:
    the prior, a one-position step of 1 second."""
    drafted_only = measured(0.010, 0.001, 0.004, [(4, 2, 4), (4, 3, 4)])
    a, b, d = drafted_only.cost()
    assert (a, b, d) == pytest.approx((0.026, 0.001, 0.0))
    one_point = VerifyBudget(8)
    one_point.record(10, 0.020)
    one = 0.020 / (1 + 0.1 * 9)  # a + 10 b = 0.020 with b = 0.1 (a + b)
    assert one_point.cost() == pytest.approx((0.9 * one, 0.1 * one, 0.0))
    assert VerifyBudget(8).cost() == pytest.approx((0.9, 0.1, 0.0))


def test_one_plain_and_one_drafted_size_charge_the_difference_to_drafting():
    """Plain steps of 8 rows (18 ms) and width-2 steps with every row drafting (58 ms): a and
    b from the plain step and the prior slope (a position 10% of a one-position step, a + b),
    d the rest per drafting row, so the modelled width-2 step is the one measured."""
    budget = measured(0.010, 0.001, 0.004, [(8, 1, 0), (8, 2, 8)])
    a, b, d = budget.cost()
    one = 0.018 / 1.7  # a + 8 b = 18 ms with b = 0.1 (a + b)
    assert (a, b) == pytest.approx((0.9 * one, 0.1 * one))
    assert d == pytest.approx((0.058 - a - 16 * b) / 8)
    assert budget.step_seconds(8, 1, 8) == pytest.approx(0.058)


def test_timing_noise_never_makes_verifying_free():
    """A fitted slope of 0 (noise) still charges each position 3% of a one-position step (the
    line turns about it: a + b stays what was fitted, 10 ms)."""
    budget = VerifyBudget(8)
    for tokens in (8, 16, 24):
        budget.record(tokens, 0.010, 8 if tokens > 8 else 0)
    a, b, d = budget.cost()
    assert a + b == pytest.approx(0.010) and b == pytest.approx(0.03 * (a + b))
    assert d == pytest.approx(0.0, abs=1e-12)


def test_good_drafts_on_cheap_positions_give_wide_passes_within_each_rows_cap():
    budget = measured(0.010, 0.001, 0.0, PLAIN_AND_TWO_WIDTHS)
    assert budget.best([[0.95] * 8] * 4, [8] * 4) >= 4
    assert budget.best([[0.95] * 8] * 4, [2] * 4) == 2
    assert budget.best([[0.95] * 8] * 4, [0] * 4) == 0


def test_a_drafter_pass_per_row_pays_for_one_row_but_not_for_eight():
    """Acceptance 0.5 per position, a pass 10 ms + 0.5 ms a position + 4 ms a drafting row:
    one row drafts (3 drafts: 1.875 tokens in 16 ms against 1 in 10.5), eight rows do not
    (12 tokens in 50 ms at best against 8 in 14)."""
    budget = measured(0.010, 0.0005, 0.004, PLAIN_AND_TWO_WIDTHS)
    assert budget.best([[0.5] * 8], [8]) >= 2
    assert budget.best([[0.5] * 8] * 8, [8] * 8) == 0


def test_rows_whose_free_drafter_found_nothing_count_as_plain_rows():
    """Caps are what each row found (prompt lookup): two long matches among eight rows do not
    pay for padding the other six; eight do."""
    budget = measured(0.010, 0.001, 0.0, PLAIN_AND_TWO_WIDTHS)
    good = [[0.95] * 8] * 8
    assert budget.best(good, [8, 8, 0, 0, 0, 0, 0, 0]) == 0
    assert budget.best(good, [8] * 8) >= 4


def test_a_batch_starts_with_a_plain_step_before_its_prior_drafts():
    """Nothing measured: the first step is plain (the baseline every width is weighed
    against), then the prior (acceptance 0.6, a position 10% of a one-position step) drafts."""
    budget = VerifyBudget(8)
    assert not budget.plain_ahead([[0.6] * 8] * 8, [8] * 8)
    assert budget.width([[0.6] * 8] * 8, [8] * 8) == 0
    assert budget.width([[0.6] * 8] * 8, [8] * 8) == 1


def test_useless_drafts_decode_plain_with_probes_spaced_by_what_they_lose():
    """Acceptance 0: plain decoding, and a width-2 probe once the plain steps since the last
    outnumber the probe's loss 50 times over (probe_share 2%), never before 8 steps: a probe
    that loses 29% of a plain step comes every 15 steps, one that loses 11% every 8."""
    dear = measured(0.010, 0.001, 0.0, [(4, 1, 0), (4, 3, 4), (4, 9, 4)])
    widths = [dear.width([[0.0] * 8] * 4, [8] * 4) for _ in range(30)]
    # loss = (10 + 8) / (10 + 4) - 1 = 0.286 plain steps: a probe at the 15th idle step
    assert [i for i, w in enumerate(widths) if w] == [14, 29]
    cheap = measured(0.100, 0.003, 0.0, [(4, 1, 0), (4, 3, 4), (4, 9, 4)])
    widths = [cheap.width([[0.0] * 8] * 4, [8] * 4) for _ in range(16)]
    assert [i for i, w in enumerate(widths) if w] == [7, 15]


def test_a_step_is_queued_plain_ahead_only_when_no_probe_is_due():
    """plain_ahead: before the rows' free drafts are known, a step plain whatever they find
    (and no probe due) may be queued ahead, and counts as a plain step."""
    budget = measured(0.010, 0.001, 0.0, [(4, 1, 0), (4, 3, 4), (4, 9, 4)])
    useless = [[0.0] * 8] * 4
    assert [budget.plain_ahead(useless, [8] * 4) for _ in range(15)] == [True] * 14 + [False]
    assert budget.width(useless, [8] * 4) == 1  # the probe the queued step left for it
    assert not budget.plain_ahead([[0.95] * 8] * 4, [8] * 4)


def test_a_rows_acceptance_leans_on_its_drafters_until_it_has_tries_of_its_own():
    """Six rows' rejected first drafts in one step bring a new row's first-position estimate
    from the prior 0.6 near its drafter's (about 0.15); a row whose own drafts were accepted
    twice stands above the rest; an unreached position inherits the one before it (not the
    prior 0.6); drafters stay apart."""
    class Key:  # a row: any object that can be weakly referenced
        pass

    budget = VerifyBudget(4)
    rows = [Key() for _ in range(7)]
    assert budget.acceptance(rows[0], "lookup") == pytest.approx([0.6] * 4)
    for row in rows[:6]:
        budget.observe(row, "lookup", 3, 0)
    budget.observe(rows[6], "lookup", 0, 0)  # found nothing: no position reached
    tries = sum(0.7 ** i for i in range(6))
    pooled = 0.6 / (tries + 1)
    assert budget.acceptance(rows[6], "lookup") == pytest.approx([pooled] * 4)
    lucky = Key()
    budget.observe(lucky, "lookup", 2, 2)
    budget.observe(lucky, "lookup", 2, 2)
    first = budget.acceptance(lucky, "lookup")[0]
    assert first > 0.5 > budget.acceptance(rows[0], "lookup")[0]
    assert budget.acceptance(Key(), "dflash") == pytest.approx([0.6] * 4)


# ------------------------------------------------------------------ what the loop records


def test_plain_passes_queued_ahead_are_timed_as_one_chain():
    """A read whose interval held the next pass's launch (queued ahead) waits for the chain to
    end: its passes share the chain's seconds, so one pass timed twice and one timed as nothing
    record their mean."""
    budget = VerifyBudget(4)
    budget.time_step(4, [0, 0, 0, 0], 0.40, chained=True)
    budget.time_step(4, [0, 0, 0, 0], 0.20, chained=True)
    assert budget.step_cost.seconds == {}
    budget.time_step(4, [0, 0, 0, 0], 0.00, chained=False)
    assert budget.step_cost.seconds == {(4, 0): pytest.approx(0.20)}
    # drafted: read alone, two rows drafting, width 4
    budget.time_step(4, [3, 0, 1, 0], 0.50, chained=False)
    assert budget.step_cost.seconds[(16, 2)] == pytest.approx(0.50)


def test_draft_prefix_keeps_the_first_drafts_and_their_probabilities():
    import mlx.core as mx

    draft = Draft(tokens=[5, 6, 7], probs=mx.eye(4)[:3])
    short = draft.prefix(2)
    assert short.tokens == [5, 6] and short.probs.shape == (2, 4)
    assert draft.prefix(3) is draft and draft.prefix(9) is draft
    assert len(Draft(tokens=mx.array([1, 2, 3])).prefix(1)) == 1
