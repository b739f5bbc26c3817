"""Prompt lookup decoding: copy what followed the most recent earlier occurrence of the suffix.

Costs no model call. An index from every n-gram to the latest positions it ended at is updated
incrementally as tokens are committed, so a step costs O(new tokens x n-gram sizes) however long
the prompt and conversation are. With `branches` > 1 the continuations of several earlier matches
are proposed together as a tree (shared prefixes merged), verified in one pass. A `reference`
(token ids of a text the output is expected to repeat: OpenAI's predicted outputs, a file being
edited) is searched too, after the sequence itself.
"""

from ..draft_length import MAX_MATCH, copier_policy
from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..sampling import SamplingConfig


class PromptLookupDrafter(Drafter):
    name = "lookup"
    default_num_draft = 8
    max_draft = 64  # a copied run costs nothing to draft, but each draft is verified
    free_drafts = True  # host work only, and a shorter K copies a prefix of the same run
    drafts_from_tokens = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1,
                 reference: list[int] | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
            raise ValueError(f"lookup branches must be a positive integer, got {branches!r}")
        self.max_ngram, self.min_ngram, self.branches = max_ngram, min_ngram, branches
        self.drafts_trees = branches > 1
        self._index: dict[tuple[int, ...], list[int]] = {}  # latest `branches` ends, oldest first
        self._indexed = 0  # n-grams ending before this position are in the index
        self.reference = list(reference or [])
        self._reference_index: dict[tuple[int, ...], list[int]] = {}
        if self.reference:
            self._extend_index(self.reference, self._reference_index, 0)

    def fork(self) -> "PromptLookupDrafter":
        twin = super().fork()
        twin._index = {}  # begin() clears the index in place
        return twin

    def begin(self, prompt, features=None):
        self._index.clear()
        self._indexed = 0
        self.latest_tokens = prompt

    latest_tokens: list[int] = []  # the committed tokens (pending last), for the K policy

    def _extend_index(self, tokens: list[int], index: dict, start: int) -> int:
        """Index n-grams ending at positions `start`.. that have a continuation (all but the
        last token); later positions overwrite earlier ones, so a lookup finds the most recent
        match. Returns the next position to index."""
        for end in range(start, len(tokens) - 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end + 1 >= n:
                    ends = index.setdefault(tuple(tokens[end + 1 - n : end + 1]), [])
                    ends.append(end)
                    del ends[: -self.branches]
        return max(start, len(tokens) - 1)

    def continuations(self, tokens: list[int], k: int) -> list[list[int]]:
        """Up to `branches` different runs of up to k tokens that followed earlier matches of the
        suffix: the longest n-gram's latest match first, then older ones, then the reference's,
        then shorter n-grams'."""
        found = []
        for source, end, _ in self._matches(tokens):
            copied = source[end + 1 : end + 1 + k]
            if copied and copied not in found:
                found.append(copied)
            if len(found) == self.branches:
                return found
        return found

    def _matches(self, tokens: list[int]):
        """(source, end, n) of each earlier match of the suffix's last n tokens, ending at `end`
        of `source` (the sequence or the reference), in the order continuations drafts them."""
        self._indexed = self._extend_index(tokens, self._index, self._indexed)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < n:
                continue
            suffix = tuple(tokens[-n:])
            for source, index in ((tokens, self._index), (self.reference, self._reference_index)):
                for end in reversed(index.get(suffix, [])):
                    yield source, end, n

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix n-gram
        found, or [] when no n-gram of the suffix appeared before."""
        found = self.continuations(tokens, k)
        return found[0] if found else []

    def copies(self, tokens: list[int], worth: float = 0.0) -> bool:
        """Whether it drafts the step after `tokens` (a copier in front of a model drafter);
        a match drafts whatever `worth` the model's drafts have (it has no weight to compare:
        measured, a match beats the model drafters we have)."""
        return bool(self.continuation(tokens, 1))

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        found = self.continuations(tokens, k)
        if len(found) > 1:
            return merged_tree(found, k)
        return Draft(tokens=found[0]) if found else EMPTY_DRAFT

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self.latest_tokens = tokens

    def match_length(self, tokens: list[int]) -> int:
        """How many tokens, up to MAX_MATCH, the text ending at the pending token agrees with
        the place the next draft copies from (the longest n-gram's latest match, extended
        backwards); 0 where nothing matches."""
        for source, end, m in self._matches(tokens):  # the first: the one copied from
            while m < min(MAX_MATCH, len(tokens)) and end - m >= 0 and \
                    source[end - m] == tokens[-1 - m]:
                m += 1
            return m
        return 0

    def draft_policy(self, max_k: int, greedy: bool):
        """Acceptance by match length (drafters/match_length.py); trees by their budget."""
        return copier_policy(self, max_k, greedy) or super().draft_policy(max_k, greedy)


def merged_tree(runs: list[list[int]], budget: int) -> Draft:
    """The runs as one tree of at most `budget` nodes, shared prefixes merged: filled depth by
    depth, the earlier run first at each depth, so the first run is the tree's first chain and
    every run gets its first tokens before any gets its last."""
    tokens, parents, node_of = [], [], {}
    for depth in range(max(len(run) for run in runs)):
        for run in runs:
            if depth >= len(run) or len(tokens) == budget:
                continue
            prefix = tuple(run[:depth])
            if prefix and prefix not in node_of:
                continue  # its prefix did not fit
            if prefix + (run[depth],) not in node_of:
                tokens.append(run[depth])
                parents.append(node_of.get(prefix, 0))
                node_of[prefix + (run[depth],)] = len(tokens)
    return Draft(tokens=tokens, parents=tuple(parents))
