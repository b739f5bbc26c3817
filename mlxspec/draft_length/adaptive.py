"""The adaptive K of one row: the K with the most expected tokens per second, from live
measurements of acceptance per position and of step times."""

from .curve import AcceptanceCurve, expected_tokens
from .step_cost import StepCost


class AdaptiveDraftLength:
    """Choose K each step to maximise expected tokens per second (a DraftLengthPolicy).

    K = argmax over k of expected_tokens(k) / seconds(k): expected tokens from the acceptance per
    position (`curve`, an AcceptanceCurve), seconds from the step times (`step_cost`, the
    StepCost the batch's width reads too; `time_line` gives it as one row's line). Three rules
    keep it from settling on a wrong K, each measured in docs/draft-length.md:

    - `probe_margin`: where K = 1 is expected within this share of K = 0, it drafts one
      (drafting nothing would stop the first position's estimate from learning);
    - `probe_share`: drafting nothing, it still probes K = 1 once the plain steps since the last
      probe outnumber what the probe is expected to lose (in plain steps' tokens) 1 /
      probe_share times over (`_probe_due`);
    - `neighbour_margin`: every `probe_every` drafting steps it runs K + 1 instead where that is
      expected within this share of the chosen K, so the time line is measured past the K in
      use, not only extrapolated.

    Args:
        max_k: the most drafts a step may take.
        decay: the acceptance curve's decay per try of a position (0.9: about the last ten).
        probe_every: drafting steps between neighbour probes, and the fewest idle steps between
            probes of K = 1 (ScoredDraftLength's).
        prior_token_cost, min_token_cost: the StepCost's prior and floor of a draft's verify
            time, x a plain step.

    Kept (across the generations a drafter keeps it for): the acceptance curve, the step
    times, and the counts of idle and drafting steps that space the probes; `last_k`, the K
    last chosen.
    """

    reads_tokens = False  # next_k() needs only this object's state, not the latest tokens
    shares_width = True  # in a batch its row drafts to the batch's shared width
    probe_margin = 0.95
    probe_share = 0.02
    neighbour_margin = 0.9

    def __init__(self, max_k: int, decay: float = 0.9, probe_every: int = 8,
                 prior_token_cost: float = 0.1, min_token_cost: float = 0.03):
        self.max_k, self.decay, self.probe_every = max_k, decay, probe_every
        self.curve = AcceptanceCurve(max_k, decay)
        self.step_cost = StepCost(prior_token_cost, min_token_cost)
        self.idle_steps = self.drafting_steps = 0

    @property
    def conditional(self) -> list[float]:
        """The estimated P(draft i accepted | draft i-1 accepted) per position."""
        return self.curve.estimates()

    @conditional.setter
    def conditional(self, values) -> None:
        self.curve = AcceptanceCurve.fixed(values, self.decay)

    def time_line(self) -> tuple[float, float, float]:
        """One row's step time from the StepCost fit (a, b, d): (plain step seconds, a drafting
        step's intercept, seconds per draft) = (a + b, a + b + d, b); a drafting step at K > 0
        is modelled as intercept + slope·K."""
        a, b, d = self.step_cost.fit()
        return a + b, a + b + d, b

    def next_k(self) -> int:
        plain, intercept, slope = self.time_line()
        expected = expected_tokens(self.conditional, self.max_k)  # at K = 0, 1, ...
        speeds = [1.0 / plain] + [expected[k] / (intercept + slope * k)
                                  for k in range(1, len(expected))]
        best_k = max(range(len(speeds)), key=speeds.__getitem__)
        if best_k == 0 and len(speeds) > 1 and speeds[1] >= self.probe_margin * speeds[0]:
            best_k = 1  # within the margin of break-even: drafting costs little, and teaches
        if best_k == 0:
            self.idle_steps += 1
            if self._probe_due(expected[1] * (speeds[0] / speeds[1] - 1.0)):
                self.idle_steps, best_k = 0, 1
        elif best_k < self.max_k:
            self.drafting_steps += 1
            if self.drafting_steps % self.probe_every == 0 and \
                    speeds[best_k + 1] >= self.neighbour_margin * speeds[best_k]:
                best_k += 1  # the neighbour nearly as good: measure it, not only extrapolate
        self.last_k = best_k
        return best_k

    last_k = 1  # the K last chosen

    def _probe_due(self, loss: float) -> bool:
        """Whether to probe K = 1 now, drafting nothing: `loss` is what the probe is expected
        to lose, in plain steps' tokens, and the plain steps since the last one must outnumber
        it 1 / probe_share times over."""
        return loss <= self.probe_share * self.idle_steps

    def keep(self, draft) -> int:
        """All of it: its K was chosen before (a policy reading a draft's own scores keeps a
        prefix: ScoredDraftLength)."""
        return len(draft)

    def draft_reach(self, draft) -> list[float] | None:
        """None: this policy knows only its running estimate (see DraftLengthPolicy)."""
        return None

    def expected_accepted(self) -> float:
        """Drafts a step at the last chosen K is expected to have accepted (what a copier's
        draft is weighed against in front of a model drafter: CopyFirstDrafter)."""
        expected, reach = 0.0, 1.0
        for rate in self.conditional[: self.last_k]:
            reach *= rate
            expected += reach
        return expected

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """The step's acceptance teaches the curve; its seconds (if timed) the step cost, at
        positions drafted + 1 and one drafting row if it drafted."""
        self.curve.observe(drafted, accepted)
        self.step_cost.record(drafted + 1, seconds, int(drafted > 0))
