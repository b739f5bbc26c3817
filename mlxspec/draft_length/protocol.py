"""What the loop asks of a row's draft-length (K) policy, and what it tells it."""

from typing import Any, Protocol


class DraftLengthPolicy(Protocol):
    """A row's K policy, as `engine.Loop` drives it each step:

        k = policy.next_k()                 # before the row proposes (capped by the loop)
        n = policy.keep(draft)              # the row proposed: verify its first n drafts
        ... one pass verifies [pending, first n drafts] ...
        policy.update(drafted, accepted, seconds)

    In a batch of several rows, a row whose policy `shares_width` drafts to the batch's one
    width (VerifyBudget) instead of its next_k(); where its drafter's drafts are free
    (Drafter.free_drafts) the whole draft is proposed, weighed by `draft_reach` and cut to the
    width, without `keep`. `update` is told every step either way.

    A policy is kept across generations (`Drafter.draft_policy`), so what it learnt on one
    prompt is where the next starts.
    """

    # Whether next_k() reads the latest committed tokens (a copier's current match): then the
    # loop cannot ask it for the next K before the current pass is read (no plain pass queued
    # ahead).
    reads_tokens: bool
    # Whether, in a batch of several rows, the row drafts to the batch's shared width
    # (VerifyBudget, chosen for every such row together) rather than to its own next_k().
    shares_width: bool

    def next_k(self) -> int:
        """The drafts to propose this step, 0 for a plain step (the loop caps it by the row's
        most, its max_tokens, the context and what the cache can roll back)."""
        ...

    def keep(self, draft: Any) -> int:
        """How many of a proposed draft's drafts the step verifies, 0..len(draft) (len(draft):
        all of it; a chain is cut to its first ones, a tree is kept whole). `draft` is an
        `engine.Draft`: only its length and `parents` (None for a chain) are read."""
        ...

    def draft_reach(self, draft: Any) -> list[float] | None:
        """The chance of reaching each draft of a proposed chain, read from the draft itself
        (suffix decoding's path frequencies, DSpark's confidences), or None where the policy
        knows only its running estimates. A batch weighs a shared row's draft by it."""
        ...

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A step verified `drafted` drafts and accepted the first `accepted`, in `seconds` of
        wall time since the row's last step ended (None: not timed, e.g. a row's first step,
        which carries one-off work)."""
        ...
