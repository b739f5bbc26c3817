"""K for copiers (prompt lookup, suffix decoding by match length), and for a drafter that
copies first and drafts with a model elsewhere (one policy per source).

A copier's draft is right as long as the text keeps repeating what it matched, and how long the
current match already is says how likely that is (a copy agreeing with its source for 20 tokens
tends to go on; a one-token match in fresh prose seldom does), so one acceptance curve per
match-length bucket replaces the single curve (measured: docs/draft-length.md).
"""

from .curve import AcceptanceCurve
from .adaptive import AdaptiveDraftLength

BUCKET_STARTS = (1, 2, 4, 8, 16)  # the shortest match length of each bucket
MAX_MATCH = 32  # a match is measured up to this many tokens (longer ones share the top bucket)


def bucket_of(length: int) -> int:
    """0 for no match, else 1.. by BUCKET_STARTS."""
    return sum(length >= start for start in BUCKET_STARTS)


class MatchLengthDraftLength(AdaptiveDraftLength):
    """AdaptiveDraftLength with one acceptance curve per bucket of `match_length()` (the
    copier's current match, read before each step: the latest tokens matter), and one step
    cost for all of them (a step's cost by K does not depend on where the drafts came from).

    Args:
        max_k: the most drafts a step may take.
        match_length: () -> the copier's current match length, in tokens.
        **options: AdaptiveDraftLength's.

    Kept: `curves` {bucket: AcceptanceCurve}; `curve` is the one chosen by the last next_k,
    which `update` teaches.
    """

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


def copier_policy(drafter, max_k: int, greedy: bool):
    """A copier's draft_policy: by match length for chains (kept on the drafter per (max_k,
    greedy), read through `drafter.match_length(drafter.latest_tokens)`); None for trees (the
    caller then uses the tree budget)."""
    if drafter.drafts_trees:
        return None
    policies = drafter.__dict__.setdefault("_draft_policies", {})
    key = (max_k, greedy)
    if key not in policies:
        policies[key] = MatchLengthDraftLength(
            max_k, lambda: drafter.match_length(drafter.latest_tokens))
    return policies[key]


class PerSourceDraftLength:
    """Two policies, one per source of a copy-first drafter (CopyFirstDrafter): `copies()` says
    which source drafts next, so each policy chooses K for, and learns from, its own steps only
    (their acceptance and step costs differ: a copy step drafts for nothing).

    Args:
        copies: () -> whether the copier drafts the next step.
        copier_policy, model_policy: each source's own DraftLengthPolicy (a tree's too).

    Kept: the two policies (`copier`, `model`) and which one chose the current step.
    """

    reads_tokens = True  # which source drafts next depends on the latest committed tokens
    shares_width = False  # its row drafts at its own K in a batch

    def __init__(self, copies, copier_policy, model_policy):
        self.copies = copies
        self.copier, self.model = copier_policy, model_policy
        self._current = self.model

    def next_k(self) -> int:
        self._current = self.copier if self.copies() else self.model
        return self._current.next_k()

    def keep(self, draft) -> int:
        return self._current.keep(draft)

    def draft_reach(self, draft) -> list[float] | None:
        return self._current.draft_reach(draft)

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        self._current.update(drafted, accepted, seconds)
