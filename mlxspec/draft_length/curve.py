"""Acceptance per draft position: P(draft i accepted | draft i-1 accepted), learnt from verified
steps, and the expected tokens of a step that follow from it.

Why each untried position starts from the estimate before it, and what a flat prior cost:
docs/draft-length.md ("Acceptance per position").
"""

FIRST_PRIOR = 0.6  # the first position's prior: a few drafts at first, more once they are accepted


class AcceptanceCurve:
    """A discounted mean of acceptance per position, each position's prior the estimate of the
    position before it (the first: FIRST_PRIOR).

    Args:
        max_k: positions kept (the most drafts a step may take).
        decay: each try of a position multiplies its older tries' weight by this.

    Kept: per position, `learnt` ((1 - decay) x the discounted hits) and `prior_share` (decay **
    tries: what the prior still weighs). A position learns only when it is drafted.
    """

    def __init__(self, max_k: int, decay: float):
        self.decay = decay
        self.learnt = [0.0] * max_k
        self.prior_share = [1.0] * max_k

    @classmethod
    def fixed(cls, values, decay: float = 0.9) -> "AcceptanceCurve":
        """A curve already at `values` (as if each position had been tried many times)."""
        curve = cls(len(values), decay)
        curve.learnt, curve.prior_share = [float(v) for v in values], [0.0] * len(values)
        return curve

    def estimates(self) -> list[float]:
        """P(draft i accepted | draft i-1 accepted) for each position i (0-based)."""
        out, prior = [], FIRST_PRIOR
        for learnt, share in zip(self.learnt, self.prior_share):
            prior = learnt + share * prior
            out.append(prior)
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and accepted the first `accepted`: position i counts
        only if every one before it was accepted."""
        for i in range(min(drafted, accepted + 1, len(self.learnt))):
            self.learnt[i] = self.decay * self.learnt[i] + (1 - self.decay) * (i < accepted)
            self.prior_share[i] *= self.decay


def expected_tokens(conditional: list[float], cap: int) -> list[float]:
    """Expected committed tokens of a step with 0..cap drafts (entry k: K = k), given
    P(draft i accepted | draft i-1 accepted) per position: 1 (the target's own token) + the
    chance of reaching each draft. Returns min(cap, len(conditional)) + 1 entries."""
    expected, reach, total = [1.0], 1.0, 1.0
    for rate in conditional[:cap]:
        reach *= rate
        total += reach
        expected.append(total)
    return expected


def conditional_from_reach(reach: list[float]) -> list[float]:
    """P(draft j accepted | draft j-1 accepted) from the chance of reaching each draft (a
    draft's own scores, `DraftLengthPolicy.draft_reach`)."""
    conditional, before = [], 1.0
    for r in reach:
        conditional.append(min(r / before, 1.0) if before > 0 else 0.0)
        before = r
    return conditional
