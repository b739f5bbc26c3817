"""P(draft i accepted | draft i-1 accepted) per draft position, learnt from verified steps.

A position learns only when it is drafted, so one the policy never drafts keeps its prior. A
flat prior (0.6 at every position) made a good drafter's untried positions look far worse
than the tried ones: on the Qwen2.5-Coder pair, greedy, positions 1-3 reached 0.93-0.98 while
4-8 stayed at 0.6, and the adaptive K stayed at 3-4 where a fixed K = 8 ran 1.3x faster. So a
position's prior is the estimate of the position before it (the first: 0.6), and it fades as
the position is tried: an untried position is expected to go on as the deepest tried one does,
until it is measured (the neighbour probe measures it).
"""

FIRST_PRIOR = 0.6  # a middling prior: a few drafts at first, more as soon as they are accepted


class AcceptanceCurve:
    """A discounted mean per position (`decay` per try of that position), each starting from
    the estimate of the position before it."""

    def __init__(self, max_k: int, decay: float):
        self.decay = decay
        self.learnt = [0.0] * max_k  # (1 - decay) x the discounted hits
        self.prior_share = [1.0] * max_k  # decay ** tries: what the prior still weighs

    @classmethod
    def fixed(cls, values, decay: float = 0.9) -> "AcceptanceCurve":
        """A curve already at `values` (as if each position had been tried many times)."""
        curve = cls(len(values), decay)
        curve.learnt, curve.prior_share = [float(v) for v in values], [0.0] * len(values)
        return curve

    def estimates(self) -> list[float]:
        out, prior = [], FIRST_PRIOR
        for learnt, share in zip(self.learnt, self.prior_share):
            prior = learnt + share * prior
            out.append(prior)
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and accepted `accepted`: position i counts only if
        every one before it was accepted."""
        for i in range(min(drafted, accepted + 1, len(self.learnt))):
            self.learnt[i] = self.decay * self.learnt[i] + (1 - self.decay) * (i < accepted)
            self.prior_share[i] *= self.decay
