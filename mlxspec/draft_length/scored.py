"""K from a draft's own scores: for a drafter whose draft says how far it expects to be right
(suffix decoding's path frequencies, DSpark's confidence head)."""

from .adaptive import AdaptiveDraftLength


class ScoredDraftLength(AdaptiveDraftLength):
    """The drafter drafts what its own rules allow (next_k is the most), and `keep` keeps the
    prefix with the most expected tokens per second: (1 + calibration x the sum of its reach
    scores) / seconds(K), seconds(K) the StepCost's line (AdaptiveDraftLength.time_line).

    Scores counted from history are optimistic where the text is new, so they are scaled by
    `calibration`: the accepted tokens over the predicted ones (discounted sums, so a step's
    ratio weighs by its size; at most 1). Where no prefix pays, one draft is still kept every
    `probe_every` such steps, so a low calibration can recover.

    Args:
        max_k: the most drafts a step may take.
        path_probs: () -> the last proposed draft's reach per draft (the chance it and all
            before it are right), read in `keep` and `draft_reach`.
        **options: AdaptiveDraftLength's.

    Kept: AdaptiveDraftLength's state, the calibration's discounted sums (`accepted_sum`,
    `predicted_sum`, a prior of one step as predicted) and the scores of the draft being
    verified, until `update`.
    """

    def __init__(self, max_k: int, path_probs, **options):
        super().__init__(max_k, **options)
        self.path_probs = path_probs
        self.accepted_sum = self.predicted_sum = 1.0
        self._probs: list[float] = []

    @property
    def calibration(self) -> float:
        return min(self.accepted_sum / self.predicted_sum, 1.0)

    def next_k(self) -> int:
        self.last_k = self.max_k
        return self.max_k

    def keep(self, draft) -> int:
        if not len(draft) or draft.parents is not None:
            return len(draft)  # a tree's budget is TreeBudget's
        plain, intercept, slope = self.time_line()
        probs, scale = self.path_probs()[: len(draft)], self.calibration
        best_k, best_speed, expected = 0, 1.0 / plain, 1.0
        for k, p in enumerate(probs, start=1):
            expected += scale * p
            if expected / (intercept + slope * k) > best_speed:
                best_k, best_speed = k, expected / (intercept + slope * k)
        if best_k == 0:  # now and then one draft, so a low calibration can recover
            self.idle_steps += 1
            if self.idle_steps >= self.probe_every:
                self.idle_steps, best_k = 0, 1
        self._probs = probs
        return best_k

    def draft_reach(self, draft) -> list[float] | None:
        """The calibrated scores (a batch cuts the whole draft to its width). It also records
        them, uncalibrated, for `update` to weigh the step's accepted tokens by."""
        if not len(draft) or draft.parents is not None:
            return None
        self._probs = self.path_probs()[: len(draft)]
        return [self.calibration * p for p in self._probs]

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        super().update(drafted, accepted, seconds)
        predicted = sum(self._probs[:drafted])  # in tokens as drafted, before the calibration
        if drafted and predicted > 0:
            self.accepted_sum = self.decay * self.accepted_sum + accepted
            self.predicted_sum = self.decay * self.predicted_sum + predicted
        self._probs = []


class ConfidenceDraftLength(ScoredDraftLength):
    """ScoredDraftLength for a drafter whose scores cost its whole pass (DSpark's confidence
    head reads the block the pass drafts): a step the scores cut to nothing paid for that pass
    anyway, so the next `probe_every` steps draft nothing (no pass), then the head is asked
    again on fresh context (why: docs/draft-length.md).

    Kept: ScoredDraftLength's, and `resting`, the plain steps left before the head is asked.
    """

    def __init__(self, max_k: int, path_probs, **options):
        super().__init__(max_k, path_probs, **options)
        self.resting = 0

    def next_k(self) -> int:
        if self.resting:
            self.resting -= 1
            self.last_k = 0
            return 0
        return super().next_k()

    def keep(self, draft) -> int:
        kept = super().keep(draft)
        if len(draft) and not kept:
            self.resting = self.probe_every
        return kept
