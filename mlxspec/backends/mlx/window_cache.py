"""A sliding-window attention layer's cache that a verify pass can roll back, at any context
length (issue #64).

mlx-lm's RotatingKVCache keeps exactly the window and writes each new position over the oldest
one, so once the context passes the window a rejected draft's position has overwritten a key
that the next token still needs: trimming cannot bring it back, and speculation had to stop.
WindowKVCache keeps its keys in position order instead and forgets old positions only before a
write, keeping the `window - 1` before it: whatever part of that write a rollback takes back,
the window of the next position is still held. A cache written one position at a time and cut
back over several writes (a draft model's) keeps `slack` more. A pass is handed only the keys
its queries can see (the window - 1 before it and its own), so a one-token decode step reads
`window` keys with no mask, as over mlx-lm's cache, and a verify pass a little more. Every
query attends to its own window only (the mask), so the layer computes what mlx-lm's rotating
cache computes.

Forgetting copies what is kept, so it waits until `spare` positions past the window have piled
up: a copy every `spare` steps, and at most `spare` masked-out keys in a pass.

In a batch, rows end at different positions; the same window rule lives in RaggedKVCache
(ragged_cache.py) with `window` set.
"""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import CacheList, RotatingKVCache, _BaseCache, make_prompt_cache


def default_spare(window: int) -> int:
    """Positions let pile up past the window between two copies: a quarter of it, 16 to 256."""
    return max(16, min(256, window // 4))


class WindowKVCache(_BaseCache):
    """Keys and values of positions [start, offset) of one sequence, in order, for a layer
    whose queries see their last `window` positions (themselves included)."""

    step = 256

    def __init__(self, window: int, spare: int | None = None, slack: int = 0):
        if window < 1:
            raise ValueError(f"a sliding window holds at least 1 position, not {window}")
        self.window, self.slack = window, slack
        self.spare = default_spare(window) if spare is None else spare
        self.keys = self.values = None
        self.offset = 0  # positions seen: the next one written is at this position
        self.start = 0  # the position of the buffers' first entry
        self._seen = 0  # the buffers' first entry the last write handed out

    @property
    def max_size(self) -> int:
        """The window, under mlx-lm's RotatingKVCache name for it."""
        return self.window

    @property
    def held(self) -> int:
        return self.offset - self.start

    def _start_before_write(self) -> int:
        """Where the buffers start once the next write has forgotten what it may: the
        `window - 1 + slack` positions before it stay, once `spare` more have piled up."""
        keep = self.window - 1 + self.slack
        if self.held > keep + self.spare:
            return self.offset - keep
        return self.start

    def update_and_fetch(self, keys, values):
        """Append n positions (B, heads, n, D); return every held position's keys and values,
        these included."""
        n = keys.shape[2]
        start = self._start_before_write()
        cut, kept = start - self.start, self.offset - start
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if self.keys is None or cut or kept + n > capacity:
            size = -(-(kept + n) // self.step) * self.step
            self.keys, self.values = (self._resized(old, new, cut, kept, size)
                                      for old, new in ((self.keys, keys), (self.values, values)))
            self.start = start
        self.keys[..., kept : kept + n, :] = keys
        self.values[..., kept : kept + n, :] = values
        self.offset += n
        self._seen = kept - self._visible(kept)
        return self.keys_and_values()

    def _visible(self, behind: int) -> int:
        """Of `behind` positions held before a write, those its queries can see."""
        return min(behind, self.window - 1)

    def keys_and_values(self):
        """The keys and values the last write handed out (the positions its queries can see,
        its own included): what a layer sharing this one's reads in the same pass."""
        return (self.keys[..., self._seen : self.held, :],
                self.values[..., self._seen : self.held, :])

    @staticmethod
    def _resized(old, like, cut: int, kept: int, size: int):
        """A buffer of `size` positions starting with old[cut : cut + kept]."""
        fresh = mx.zeros(like.shape[:2] + (size - kept,) + like.shape[3:], like.dtype)
        if old is None or not kept:
            return fresh
        return mx.concatenate([old[..., cut : cut + kept, :], fresh], axis=2)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """The mask of the next pass's N queries over the keys update_and_fetch will return:
        causal, and each query sees its last `window_size` positions (capped by the cache's
        own window, as mlx-lm's rotating cache holds no more)."""
        window = min(window_size or self.window, self.window)
        behind = self._visible(self.offset - self._start_before_write())  # keys before the new
        if N == 1:
            if behind < window and not return_array:
                return None
            return mx.arange(behind + 1) >= behind + 1 - window
        if behind + N > window or return_array:
            return create_causal_mask(N, behind, window_size=window)
        return "causal"

    def tree_mask(self, ancestors: mx.array, depth: mx.array,
                  window_size: int | None = None) -> mx.array:
        """A tree pass's mask ((N+1, seen + N+1) bool, over the keys its write hands out): node
        i, at position offset + depth[i], sees the held positions and its ancestors
        (`ancestors`, (N+1, N+1)) inside its window."""
        window = min(window_size or self.window, self.window)
        behind = self._visible(self.offset - self._start_before_write())
        held = mx.arange(behind)[None] + (self.offset - behind)  # (1, behind) positions
        sees = held > (self.offset + depth[:, None] - window)  # (N+1, behind)
        near = (depth[:, None] - depth[None]) < window  # (N+1, N+1)
        return mx.concatenate([sees, ancestors & near], axis=1)

    def is_trimmable(self) -> bool:
        """Whether any number of positions can be cut (nothing forgotten yet). Fewer can be cut
        exactly whenever the window stays held: see `room`."""
        return self.start == 0

    def room(self) -> int:
        """How many positions can be cut while the next position's window stays held."""
        if self.start == 0:
            return self.offset
        return max(0, self.held - (self.window - 1))

    def trim(self, n: int) -> int:
        n = min(self.held, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def state(self):
        """The held keys and values (None before the first write) and the four numbers."""
        keys = values = None
        if self.keys is not None:
            keys, values = self.keys[..., : self.held, :], self.values[..., : self.held, :]
        return keys, values, self.offset, self.start, self.window, self.spare, self.slack

    @state.setter
    def state(self, v):
        (self.keys, self.values, self.offset, self.start, self.window, self.spare,
         self.slack) = v
        self._seen = 0


def rollback_windows(cache: list, slack: int = 0) -> list:
    """`cache` (one entry per layer, as mlx-lm's make_prompt_cache gives) with every sliding
    window (an empty RotatingKVCache keeping no leading positions) held as a WindowKVCache, a
    CacheList's members too (baichuan_m1's state beside a window)."""
    out = []
    for c in cache:
        if type(c) is RotatingKVCache and c.keep == 0 and c.offset == 0:
            c = WindowKVCache(c.max_size, slack=slack)
        elif isinstance(c, CacheList):
            c.caches = rollback_windows(c.caches, slack)
        out.append(c)
    return out


def make_cache(model, slack: int = 0) -> list:
    """A model's cache: mlx-lm's, with its sliding windows able to roll back (`slack`: see
    WindowKVCache)."""
    return rollback_windows(make_prompt_cache(model), slack)
