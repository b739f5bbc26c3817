"""Prompt lookup decoding: copy what followed the most recent earlier occurrence of the suffix.

Costs no model call. An index from every n-gram to the latest position it ended at is updated
incrementally as tokens are committed, so a step costs O(new tokens x n-gram sizes) however long
the prompt and conversation are.
"""

from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..sampling import SamplingConfig


class PromptLookupDrafter(Drafter):
    name = "lookup"
    default_num_draft = 8

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def begin(self, prompt, features=None):
        self._index.clear()
        self._indexed = 0

    def _extend_index(self, tokens: list[int]) -> None:
        # Index n-grams ending at positions that have a continuation (all but the last token);
        # later positions overwrite earlier ones, so a lookup finds the most recent match.
        for end in range(self._indexed, len(tokens) - 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end + 1 >= n:
                    self._index[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix n-gram
        found, or [] when no n-gram of the suffix appeared before."""
        self._extend_index(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < n:
                continue
            end = self._index.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        copied = self.continuation(tokens, k)
        return Draft(tokens=copied) if copied else EMPTY_DRAFT

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        pass
