"""Adaptive K for copiers (prompt lookup, suffix decoding): acceptance by match length.

A copier's draft is right as long as the text keeps repeating what it matched, and how long the
current match already is says how likely that is: a copy that has agreed with its source for 20
tokens (an edit repeating a file) tends to go on; a one-token match in fresh prose seldom does.
One acceptance-by-position curve over all steps, AdaptiveDraftLength's, averages the two and
drafts too little in long copies and too much elsewhere (measured: adaptive lookup ran 0.85x of
K = 15 on the copy suite). So the policy keeps one curve per match-length bucket (1, 2-3, 4-7,
8-15, 16+ tokens), chooses K from the bucket of the match the copier has now, and shares the
time model (a step's cost by K does not depend on where the drafts came from).
"""

from ..acceptance import AcceptanceCurve
from ..engine import EMPTY_DRAFT, AdaptiveDraftLength

BUCKET_STARTS = (1, 2, 4, 8, 16)  # the shortest match length of each bucket
MAX_MATCH = 32  # a match is measured up to this many tokens (longer ones share the top bucket)


def bucket_of(length: int) -> int:
    """0 for no match, else 1.. by BUCKET_STARTS."""
    return sum(length >= start for start in BUCKET_STARTS)


class MatchLengthDraftLength(AdaptiveDraftLength):
    """AdaptiveDraftLength with one acceptance curve per bucket of `match_length()` (the
    copier's current match, read before each step: the latest tokens matter)."""

    reads_tokens = True

    def __init__(self, max_k: int, match_length, **options):
        super().__init__(max_k, **options)
        self.match_length = match_length
        self.curves: dict[int, AcceptanceCurve] = {}

    def next_k(self) -> int:
        bucket = bucket_of(self.match_length())
        # update() and expected_accepted() then read the curve chosen here
        self.curve = self.curves.setdefault(bucket, AcceptanceCurve(self.max_k, self.decay))
        return super().next_k()


class ScoredDraftLength(AdaptiveDraftLength):
    """For a drafter that scores its own draft (suffix decoding: each draft's path frequency,
    the chance it and all before it are right): the drafter drafts what its own rules allow
    (its match length x spec factor, paths above min_prob) and the step keeps the prefix that
    maximises expected tokens per second: (1 + sum of path frequencies) / time(K), time(K) the
    measured step times' line, as AdaptiveDraftLength's. Frequencies counted from history are
    optimistic where the text is new, so they are scaled by the accepted tokens over the
    predicted ones (discounted sums, so a step's ratio is weighed by its size; at most 1)."""

    def __init__(self, max_k: int, path_probs, **options):
        super().__init__(max_k, **options)
        self.path_probs = path_probs  # the last draft's path frequencies
        self.accepted_sum = self.predicted_sum = 1.0  # a prior of one step as predicted
        self._probs: list[float] = []  # the path frequencies of the draft being verified

    @property
    def calibration(self) -> float:
        return min(self.accepted_sum / self.predicted_sum, 1.0)

    def next_k(self) -> int:
        self.last_k = self.max_k
        return self.max_k

    def cut(self, draft):
        if not len(draft) or draft.parents is not None:
            return draft
        plain, intercept, slope = self._time_model()
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
        return draft.prefix(best_k) if best_k else EMPTY_DRAFT

    def draft_reach(self, draft):
        """The calibrated path frequencies (a batch cuts the whole draft to its width). It
        also records them, uncalibrated, for `update` to weigh the step's accepted tokens by."""
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
    anyway, so after one the next `probe_every` steps draft nothing (no pass), then the head
    is asked again on fresh context. Without the rest, on a CPU where DSpark's pass costs 0.7
    of a decode step, the head's K ran at 0.6x of the adaptive K's speed (docs/benchmarks.md)."""

    def __init__(self, max_k: int, path_probs, **options):
        super().__init__(max_k, path_probs, **options)
        self.resting = 0  # steps left that draft nothing

    def next_k(self) -> int:
        if self.resting:
            self.resting -= 1
            self.last_k = 0
            return 0
        return super().next_k()

    def cut(self, draft):
        kept = super().cut(draft)
        if len(draft) and not len(kept):
            self.resting = self.probe_every
        return kept


def copier_policy(drafter, max_k: int, greedy: bool):
    """A copier's draft_policy: by match length for chains, the tree budget for trees."""
    if drafter.drafts_trees:
        return None
    policies = drafter.__dict__.setdefault("_draft_policies", {})
    key = (max_k, greedy)
    if key not in policies:
        policies[key] = MatchLengthDraftLength(
            max_k, lambda: drafter.match_length(drafter.latest_tokens))
    return policies[key]
