"""Prompt caches kept across requests: a follow-up turn of a conversation prefills only its
new tokens.

A few kept caches (mlxspec.prompt_cache.KeptCache, the one `chat` keeps between turns), least
recently used evicted: a request takes the cache that shares the longest prefix with its prompt
(its conversation's), or a fresh one; a row of a batch starts from a copy of the longest
prefix any cache holds, and its own cache is kept when it ends. Memory is bounded by the number
of caches and by the tokens they hold together; over either, the least recently used go first.
"""

from typing import Callable, Sequence

from ..engine import common_prefix_length
from ..prompt_cache import KeptCache


class PromptCachePool:
    def __init__(self, make: Callable[[], KeptCache], *, slots: int = 4,
                 max_tokens: int = 65536):
        self.make, self.slots, self.max_tokens = make, slots, max_tokens
        self.caches: list[KeptCache] = []  # least recently used first

    def checkout(self, prompt: Sequence[int]) -> KeptCache:
        """The cache for `prompt`, now the most recently used."""
        best, shared = None, 0
        for cache in self.caches:
            n = common_prefix_length(cache.tokens, prompt[:-1])
            if n > shared:
                best, shared = cache, n
        if best is None:
            best = self.make()
        else:
            self.caches.remove(best)
        self.caches.append(best)
        self._bound()
        return best

    def longest(self, prompt: Sequence[int], layers: Sequence[int] = ()
                ) -> tuple[KeptCache | None, int]:
        """The cache that can start `prompt` with the most of its tokens (`layers`: and
        their target features at those layers), and how many, leaving every cache as it is (rows of a batch
        start from copies: see KeptCache.prefix); it becomes the most recently used."""
        best, shared = None, 0
        for cache in self.caches:
            n = cache.shared(prompt, layers)
            if n > shared:
                best, shared = cache, n
        if best is not None:
            self.caches.remove(best)
            self.caches.append(best)
        return best, shared

    def keep(self, cache: KeptCache) -> None:
        """A finished row's cache joins the pool as the most recently used; any it extends
        (the turn it continued, a prompt it repeated) goes, unless it kept features this one
        lacks."""
        self.caches = [c for c in self.caches
                       if common_prefix_length(c.tokens, cache.tokens) < len(c.tokens)
                       or (c.features is not None and not cache.has_features(c.feature_layers))]
        self.caches.append(cache)
        self._bound()

    def _bound(self) -> None:
        while len(self.caches) > self.slots or (
                len(self.caches) > 1 and sum(len(c.tokens) for c in self.caches) > self.max_tokens):
            self.caches.pop(0)

    def held_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.caches)
