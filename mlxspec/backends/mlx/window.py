"""A drafter's window on its own context (`--drafter-window N`): each entry attends to the
entries at most N - 1 positions behind it, so a drafter's cost stops growing with a long
context. Shared by the drafters that keep a cache of their own: EAGLE-3 and MTP (entries are
pairs: pair i embeds token i+1 and sits at position i+1, as mlxspec.drafters.paired counts)
and a draft model (one entry per token)."""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache


def window_mask(cached: int, length: int, window: int, mask: mx.array | None,
                positions: mx.array | None) -> mx.array:
    """What `length` new entries see through a drafter window: entry e at position p_e sees
    the entries at positions in (p_e - window, p_e] that `mask` lets it see.

    A chain (positions None: the new entries next in order, causal): no visible entry lies
    before the last window - 1 cached ones, and only those columns are kept: the attention
    reads at most window - 1 + length keys, whatever the context. A tree's entries
    (`positions`, `mask` their ancestors) see the committed pairs within the window and all
    their ancestors (earlier depths' entries count as just behind them); the mask keeps every
    column, as a tree's entries are not in position order."""
    if positions is None:
        positions = mx.arange(cached + 1, cached + 1 + length)
        causal = mx.arange(cached + length)[None] <= mx.arange(cached, cached + length)[:, None]
        keys = mx.arange(1, cached + length + 1)
        visible = causal & (positions[:, None] - keys[None] < window)
        return visible[:, -min(cached + length, window - 1 + length) :]
    positions = positions.astype(mx.int32)
    behind = mx.minimum(mx.arange(1, cached + 1), positions.min() - 1)
    keys = mx.concatenate([behind, positions])
    return mask & (positions[:, None] - keys[None] < window)


class WindowView:
    """A KVCache seen through a window, for one forward call of mlx-lm layers: new entries
    are written to the cache as ever, but the attention gets only the keys the window lets
    any of them see (the last window - 1 cached ones and the new ones) and a mask, from
    `make_mask`, that keeps each entry to its own last `window`. Anything else (offset, trim,
    state) is the cache's own."""

    def __init__(self, cache: KVCache, window: int):
        self._cache, self._window = cache, window

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def _start(self, cached: int) -> int:
        """The first cached entry a call's new entries can see."""
        return max(cached - self._window + 1, 0)

    def update_and_fetch(self, keys, values):
        start = self._start(self._cache.offset)
        keys, values = self._cache.update_and_fetch(keys, values)
        return keys[..., start:, :], values[..., start:, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        cached = self._cache.offset
        if N == 1 and window_size is None:
            return None  # one entry sees every key it is given: at most `window`
        window = min(self._window, window_size or self._window)
        return create_causal_mask(N, cached - self._start(cached), window_size=window)


def windowed(caches: list, window: int | None) -> list:
    """`caches` with each plain KVCache seen through `window` (None: as they are); other
    layers' caches (a hybrid's recurrent states) are left alone."""
    if window is None:
        return caches
    return [WindowView(c, window) if type(c) is KVCache else c for c in caches]
