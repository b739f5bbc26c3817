"""An attention cache for a batch whose rows end at different positions (issue #39).

After a batched verification pass each row keeps its own number of positions. mlx-lm's
BatchKVCache keeps every row ending at one shared index, so rolling rows back by different
amounts moves each row's keys right into its left padding: a gather of the whole cache, per
layer, every pass, which on a CPU costs about what a plain pass of 8 rows does (125 ms of a
~110 ms step on SmolLM2). Here each row has its own end instead: rolling back lowers the ends,
nothing moves, and the next pass writes each row's positions right after its own end (a
scatter of only the new positions). The positions past a row's end are masked out and
overwritten by its next pass.

While every row ends at the same index (plain decoding, or rows that accepted alike) the cache
is mlx-lm's own BatchKVCache, to the bit: the same writes and the same mask.
"""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache


class RaggedKVCache(BatchKVCache):
    """A BatchKVCache where row i holds positions [left_padding[i], ends[i]) of its buffer."""

    @classmethod
    def from_batch(cls, cache: BatchKVCache) -> "RaggedKVCache":
        """The same rows and arrays, each row ending where mlx-lm's cache ends them all."""
        ragged = cls.__new__(cls)
        ragged.keys, ragged.values = cache.keys, cache.values
        ragged.offset, ragged.left_padding = cache.offset, cache.left_padding
        ragged._idx, ragged._right_padding = cache._idx, None
        ragged.ends = [cache._idx] * cache.offset.shape[0]
        return ragged

    @property
    def aligned(self) -> bool:
        return len(set(self.ends)) <= 1

    def update_and_fetch(self, keys, values):
        if self.aligned:
            self._idx = self.ends[0] if self.ends else 0
            fetched = super().update_and_fetch(keys, values)
            self.ends = [self._idx] * len(self.ends)
            return fetched
        n = keys.shape[2]
        self._reserve(max(self.ends) + n)
        at = (mx.array(self.ends)[:, None] + mx.arange(n))[:, None, :, None]  # (B, 1, n, 1)
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values,
                                        axis=2)
        self.ends = [e + n for e in self.ends]
        self.offset = self.offset + n
        self._idx = max(self.ends)
        return self.keys_and_values()

    def _reserve(self, length: int) -> None:
        """Room in the buffer for `length` positions (mlx-lm's growth: whole steps)."""
        if length <= self.keys.shape[2]:
            return
        grow = -(-(length - self.keys.shape[2]) // self.step) * self.step
        self.keys, self.values = (
            mx.concatenate([a, mx.zeros(a.shape[:2] + (grow,) + a.shape[3:], a.dtype)], axis=2)
            for a in (self.keys, self.values))

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        """Row i's query j (at position ends[i] + j) sees its own keys up to itself."""
        if self.aligned:
            return create_causal_mask(N, offset=self.ends[0] if self.ends else 0,
                                      left_padding=self.left_padding, **kwargs)
        if kwargs.get("window_size") is not None:
            raise ValueError("a sliding window cannot be cut back per row")
        keys = mx.arange(max(self.ends) + N)
        last = mx.array(self.ends)[:, None, None] + mx.arange(N)[:, None]  # (B, N, 1)
        mask = (keys <= last) & (keys >= self.left_padding[:, None, None])
        return mask[:, None]  # (B, 1, N, keys)

    def drop(self, counts: list[int]) -> None:
        """Row i forgets its last counts[i] positions: its end moves back, nothing is copied."""
        if any(not 0 <= c <= e for c, e in zip(counts, self.ends)):
            raise ValueError(f"cannot drop {counts} positions from rows ending at {self.ends}")
        self.ends = [e - c for e, c in zip(self.ends, counts)]
        self.offset = self.offset - mx.array(counts, dtype=self.offset.dtype)
        self._idx = max(self.ends, default=0)

    def trim(self, n: int) -> int:
        n = min([n] + [e - p for e, p in zip(self.ends, self.left_padding.tolist())])
        self.drop([n] * len(self.ends))
        return n

    def filter(self, batch_indices):
        """Keep these rows, in this order; the left padding they all carry is cut off."""
        rows = batch_indices.tolist() if isinstance(batch_indices, mx.array) \
            else list(batch_indices)
        index = mx.array(rows, dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values = self.keys[index], self.values[index]
        self.offset, self.left_padding = self.offset[index], self.left_padding[index]
        self.ends = [self.ends[i] for i in rows]
        cut = min(self.left_padding.tolist(), default=0)
        if cut > 0:
            if self.keys is not None:
                self.keys, self.values = self.keys[..., cut:, :], self.values[..., cut:, :]
            self.left_padding = self.left_padding - cut
            self.ends = [e - cut for e in self.ends]
        self._idx = max(self.ends, default=0)

    def extend(self, other) -> None:
        """Append `other`'s rows (a RaggedKVCache or mlx-lm's BatchKVCache): each keeps its
        positions in the buffer, so nothing is realigned."""
        if not isinstance(other, RaggedKVCache):
            other = RaggedKVCache.from_batch(other)
        parts = [c for c in (self, other) if c.keys is not None]
        if parts:
            length = max(c.keys.shape[2] for c in parts)
            like = parts[0]
            keys, values = [], []
            for c in (self, other):
                for out, a, ref in ((keys, c.keys, like.keys), (values, c.values, like.values)):
                    rows = c.offset.shape[0]
                    if a is None:
                        a = mx.zeros((rows,) + ref.shape[1:2] + (length,) + ref.shape[3:],
                                     ref.dtype)
                    elif a.shape[2] < length:
                        a = mx.pad(a, [(0, 0), (0, 0), (0, length - a.shape[2]), (0, 0)])
                    out.append(a)
            self.keys, self.values = mx.concatenate(keys), mx.concatenate(values)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
        self.ends = self.ends + other.ends
        self._idx = max(self.ends, default=0)

    def extract(self, idx: int) -> KVCache:
        """Row `idx` as one sequence's cache."""
        cache = KVCache()
        start, end = self.left_padding.tolist()[idx], self.ends[idx]
        if self.keys is not None and end > start:
            cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, start:end])
            cache.values = mx.contiguous(self.values[idx : idx + 1, :, start:end])
            cache.offset = end - start
        return cache
