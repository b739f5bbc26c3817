"""A sliding-window layer's cache that a verify pass can roll back at any context length: the
torch twin of mlxspec.backends.mlx.window_cache.WindowKVCache.

transformers' DynamicSlidingWindowLayer keeps only the last `window - 1` positions after each
write, so once the context passes the window, cropping a rejected draft leaves the next token
short of keys it needs. WindowLayer forgets old positions only before a write, keeping the
`window - 1 + slack` before it: whatever part of that write a crop takes back, the window of the
next position is still held (`slack` more for a cache cut back over several writes, a draft
model's). A write hands attention the same keys as transformers' layer (the `window - 1` before
it and its own) and `get_mask_sizes` says so, so the model's own sliding-window mask applies
unchanged and the outputs are the model's.
"""

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer


class WindowLayer(DynamicSlidingWindowLayer):
    """Keys and values of positions [start, seen) in order, for a layer whose queries see their
    last `sliding_window` positions; `cumulative_length` counts the positions seen."""

    def __init__(self, sliding_window: int, slack: int = 0, **kwargs):
        super().__init__(sliding_window=sliding_window)
        self.slack = slack

    @property
    def held(self) -> int:
        """Positions the buffers hold (a fresh layer's buffers are 1-D and empty)."""
        if not self.is_initialized or self.keys is None or self.keys.dim() < 2:
            return 0
        return self.keys.shape[-2]

    @property
    def start(self) -> int:
        """The position of the buffers' first entry: 0 until a write forgot some."""
        return self.cumulative_length - self.held

    def _kept_before_write(self) -> int:
        """Positions the next write keeps before its own."""
        return min(self.held, self.sliding_window - 1 + self.slack)

    def _visible_before_write(self) -> int:
        """Of those, the ones its queries can see (transformers' layer hands out the same)."""
        return min(self._kept_before_write(), self.sliding_window - 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new positions, forgetting what no crop of this write can need; return
        the keys and values its queries can see, theirs included."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kept, visible = self._kept_before_write(), self._visible_before_write()
        forgotten = self.held - kept
        self.keys = _appended(self.keys, key_states, forgotten)
        self.values = _appended(self.values, value_states, forgotten)
        self.cumulative_length += key_states.shape[-2]
        return self.keys[..., kept - visible :, :], self.values[..., kept - visible :, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the next write of `query_length` positions hands
        out: the visible positions before it, then its own."""
        visible = self._visible_before_write()
        return visible + query_length, self.cumulative_length - visible

    def crops_anything(self) -> bool:
        """Whether any number of positions can be cropped exactly (nothing forgotten yet)."""
        return self.start == 0

    def room(self) -> int:
        """How many positions can be cropped while the next position's window stays held."""
        if self.start == 0:
            return self.held
        return max(0, self.held - (self.sliding_window - 1))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` positions (transformers 5's sign); more than `room()`
        would leave the next position short of its window, so it is refused."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not "
                             f"{tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.room():
            raise RuntimeError(f"cannot crop {n} positions of a sliding window that keeps "
                               f"{self.room()} to spare: the window before them is gone")
        keep = self.held - n
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.cumulative_length -= n


def _appended(old: torch.Tensor, new: torch.Tensor, forgotten: int) -> torch.Tensor:
    """old[forgotten:] then new, along the positions (an empty old is 1-D: new alone)."""
    if old.dim() < 2 or old.shape[-2] == forgotten:
        return new
    return torch.cat([old[..., forgotten:, :], new], dim=-2)


def rollback_windows(cache, slack: int = 0):
    """`cache` (a DynamicCache built from a config) with each fresh sliding-window layer
    (transformers' DynamicSlidingWindowLayer, sliding or chunked) a WindowLayer."""
    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if type(layer) is DynamicSlidingWindowLayer and not layer.is_initialized:
            layers[i] = WindowLayer(layer.sliding_window, slack=slack)
    return cache


def room(cache) -> int | None:
    """How many positions every WindowLayer of `cache` can crop exactly (None: it has none)."""
    rooms = [layer.room() for layer in getattr(cache, "layers", None) or []
             if isinstance(layer, WindowLayer)]
    return min(rooms) if rooms else None
