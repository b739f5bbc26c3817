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

With `window` set, it is a sliding-window layer's cache (issue #64): each query sees its last
`window` positions, and the columns no row's window reaches any more are forgotten before a write
once `spare` of them have piled up; every row keeps the `window - 1` positions before the write,
so rolling any row back over that write leaves its window held (WindowKVCache's rule, per row).

ChunkedRows holds a chunked-attention layer's rows (llama4's ChunkedKVCache, one sequence's):
a window of the chunk's size keeps what each row's current chunk and a rollback need, and
`chunk_mask` lets each query see only its own chunk, found from its row's own position.

RaggedQuantizedKVCache keeps the same rows quantized (`--kv-bits` in a batch), as mlx-lm's
QuantizedKVCache keeps one sequence's: each position quantized as it is written, attention
through mlx-lm's quantized path. Both move their buffers (keys and values, or each part of
their quantized forms) through the same few steps: `_arrays` and `_set_arrays`.
"""

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, ChunkedKVCache, KVCache, QuantizedKVCache

from .window_cache import WindowKVCache, default_spare


class RaggedKVCache(BatchKVCache):
    """A BatchKVCache where row i holds positions [left_padding[i], ends[i]) of its buffer;
    `offset` is each row's position (what RoPE reads), whatever columns were forgotten."""

    window = None  # a sliding window's size; None: full attention
    spare = 0

    @classmethod
    def from_batch(cls, cache: BatchKVCache, window: int | None = None) -> "RaggedKVCache":
        """The same rows and arrays, each row ending where mlx-lm's cache ends them all."""
        ragged = cls.__new__(cls)
        ragged.keys, ragged.values = cache.keys, cache.values
        ragged.offset, ragged.left_padding = cache.offset, cache.left_padding
        ragged._idx, ragged._right_padding = cache._idx, None
        ragged.ends = [cache._idx] * cache.offset.shape[0]
        ragged._set_window(window)
        return ragged

    @classmethod
    def from_window(cls, cache: WindowKVCache) -> "RaggedKVCache":
        """One sequence's sliding-window cache as a batch of that one row."""
        ragged = cls.__new__(cls)
        held = cache.held
        ragged.keys = ragged.values = None
        if cache.keys is not None and held:
            ragged.keys, ragged.values = (a[..., :held, :] for a in (cache.keys, cache.values))
        ragged.offset, ragged.left_padding = mx.array([cache.offset]), mx.array([0])
        ragged._idx, ragged._right_padding, ragged.ends = held, None, [held]
        ragged._set_window(cache.window)
        return ragged

    def _set_window(self, window: int | None) -> None:
        self.window = window
        self.spare = 0 if window is None else default_spare(window)

    def _cut_before_write(self) -> int:
        """Leading columns the next write forgets: those before every row's last window - 1
        positions, once more than `spare` of them have piled up (none without a window)."""
        if self.window is None or not self.ends:
            return 0
        cut = min(self.ends) - (self.window - 1)
        return cut if cut > self.spare else 0

    def _forget(self) -> None:
        cut = self._cut_before_write()
        if not cut:
            return
        if self._arrays() is not None:
            self._set_arrays([a[..., cut:, :] for a in self._arrays()])
        self.left_padding = mx.maximum(self.left_padding - cut, 0)
        self.ends = [e - cut for e in self.ends]
        self._idx -= cut

    @property
    def aligned(self) -> bool:
        return len(set(self.ends)) <= 1

    def update_and_fetch(self, keys, values):
        self._forget()
        if self.aligned:
            self._idx = self.ends[0] if self.ends else 0
            fetched = super().update_and_fetch(keys, values)
            self.ends = [self._idx] * len(self.ends)
            return fetched
        self._scatter(self._encode(keys, values))
        return self.keys_and_values()

    # ---- the buffers, whatever they hold ----

    def _arrays(self) -> list | None:
        """The buffers, each (B, heads, positions, columns): keys and values here."""
        return None if self.keys is None else [self.keys, self.values]

    def _set_arrays(self, arrays: list) -> None:
        self.keys, self.values = arrays

    def _encode(self, keys, values) -> list:
        """New positions' keys and values (B, heads, n, D) as the buffers hold them."""
        return [keys, values]

    def _scatter(self, new: list) -> None:
        """Write each row's n new positions right after its own end."""
        n = new[0].shape[2]
        self._reserve(max(self.ends) + n, new)
        at = (mx.array(self.ends)[:, None] + mx.arange(n))[:, None, :, None]  # (B, 1, n, 1)
        self._set_arrays([mx.put_along_axis(a, mx.broadcast_to(at, x.shape), x, axis=2)
                          for a, x in zip(self._arrays(), new)])
        self.ends = [e + n for e in self.ends]
        self.offset = self.offset + n
        self._idx = max(self.ends)

    def _reserve(self, length: int, like: list) -> None:
        """Room in the buffers for `length` positions (mlx-lm's growth: whole steps); `like`:
        arrays shaped as the buffers' rows, for buffers not made yet."""
        arrays = self._arrays()
        if arrays is None:
            size = -(-length // self.step) * self.step
            self._set_arrays([mx.zeros(x.shape[:2] + (size,) + x.shape[3:], x.dtype)
                              for x in like])
            return
        if length <= arrays[0].shape[2]:
            return
        grow = -(-(length - arrays[0].shape[2]) // self.step) * self.step
        self._set_arrays([
            mx.concatenate([a, mx.zeros(a.shape[:2] + (grow,) + a.shape[3:], a.dtype)], axis=2)
            for a in arrays])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Row i's query j (at position ends[i] + j) sees its own keys up to itself, and with a
        window only its last `window_size` (capped by the cache's own window), over the
        columns the write it precedes leaves."""
        if self.window is not None:
            window_size = min(window_size or self.window, self.window)
        cut = self._cut_before_write()
        ends = [e - cut for e in self.ends]
        left = mx.maximum(self.left_padding - cut, 0) if cut else self.left_padding
        if self.aligned:
            return create_causal_mask(N, offset=ends[0] if ends else 0, left_padding=left,
                                      window_size=window_size)
        keys = mx.arange(max(ends) + N)
        last = mx.array(ends)[:, None, None] + mx.arange(N)[:, None]  # (B, N, 1)
        mask = (keys <= last) & (keys >= left[:, None, None])
        if window_size is not None:
            mask = mask & (keys > last - window_size)
        return mask[:, None]  # (B, 1, N, keys)

    def drop(self, counts: list[int]) -> None:
        """Row i forgets its last counts[i] positions: its end moves back, nothing is copied. A
        layer's cache no pass writes (nemotron-nas's linear attention) holds none to forget."""
        if self._arrays() is None and not any(self.ends):
            return
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
        arrays = self._arrays()
        if arrays is not None:
            self._set_arrays([a[index] for a in arrays])
        self.offset, self.left_padding = self.offset[index], self.left_padding[index]
        self.ends = [self.ends[i] for i in rows]
        cut = min(self.left_padding.tolist(), default=0)
        if cut > 0:
            if arrays is not None:
                self._set_arrays([a[..., cut:, :] for a in self._arrays()])
            self.left_padding = self.left_padding - cut
            self.ends = [e - cut for e in self.ends]
        self._idx = max(self.ends, default=0)

    def extend(self, other) -> None:
        """Append `other`'s rows (of this class, or mlx-lm's BatchKVCache, made one): each
        keeps its positions in the buffer, so nothing is realigned."""
        if type(other) is not type(self):
            other = self.like(other)
        parts = [c._arrays() for c in (self, other) if c._arrays() is not None]
        if parts:
            length = max(p[0].shape[2] for p in parts)
            joined = []
            for i, ref in enumerate(parts[0]):
                column = []
                for c in (self, other):
                    a = c._arrays()[i] if c._arrays() is not None else None
                    if a is None:
                        a = mx.zeros((c.offset.shape[0],) + ref.shape[1:2] + (length,)
                                     + ref.shape[3:], ref.dtype)
                    elif a.shape[2] < length:
                        a = mx.pad(a, [(0, 0), (0, 0), (0, length - a.shape[2]), (0, 0)])
                    column.append(a)
                joined.append(mx.concatenate(column))
            self._set_arrays(joined)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
        self.ends = self.ends + other.ends
        self._idx = max(self.ends, default=0)

    def like(self, cache: BatchKVCache) -> "RaggedKVCache":
        """mlx-lm's batch cache as one of this kind."""
        return RaggedKVCache.from_batch(cache)

    def _row(self, idx: int) -> list | None:
        """Row `idx`'s held positions of each buffer, (1, heads, n, columns), or None."""
        start, end = self.left_padding.tolist()[idx], self.ends[idx]
        if self._arrays() is None or end <= start:
            return None
        return [mx.contiguous(a[idx : idx + 1, :, start:end]) for a in self._arrays()]

    def extract(self, idx: int) -> "KVCache | WindowKVCache":
        """Row `idx` as one sequence's cache."""
        row = self._row(idx)
        if self.window is not None:
            cache = WindowKVCache(self.window)
            cache.offset = cache.start = int(self.offset[idx].item())
            if row is not None:
                cache.keys, cache.values = row
                cache.start = cache.offset - row[0].shape[2]
            return cache
        cache = KVCache()
        if row is not None:
            cache.keys, cache.values = row
            cache.offset = row[0].shape[2]
        return cache


class RaggedQuantizedKVCache(RaggedKVCache):
    """RaggedKVCache's rows with their keys and values quantized (mlx.core.quantize along each
    position's head dimension: `group_size`, `bits`), as mlx-lm's QuantizedKVCache holds one
    sequence's, so a row's positions quantize as a single sequence's do, and rolling back
    quantizes nothing again. Its `bits` sends attention through mlx-lm's quantized path."""

    def __init__(self, group_size: int, bits: int):
        self.group_size, self.bits = group_size, bits

    @classmethod
    def from_batch(cls, cache: BatchKVCache, group_size: int = 64,
                   bits: int = 8) -> "RaggedQuantizedKVCache":
        """mlx-lm's batch cache (a prompt prefilled at full precision) quantized, as a single
        sequence's prompt is once in its cache (quantized_kv_start 0)."""
        ragged = cls(group_size, bits)
        plain = RaggedKVCache.from_batch(cache)
        ragged.keys = ragged.values = None
        if plain.keys is not None:
            held = [a[..., : plain._idx, :] for a in (plain.keys, plain.values)]
            ragged.keys, ragged.values = (
                tuple(mx.quantize(a, group_size=group_size, bits=bits)) for a in held)
        ragged.offset, ragged.left_padding = plain.offset, plain.left_padding
        ragged._idx, ragged._right_padding, ragged.ends = plain._idx, None, plain.ends
        return ragged

    @classmethod
    def from_single(cls, cache: QuantizedKVCache) -> "RaggedQuantizedKVCache":
        """One sequence's quantized cache as a batch of that one row, its parts as they are."""
        ragged = cls(cache.group_size, cache.bits)
        ragged.keys = ragged.values = None
        if cache.keys is not None:
            ragged.keys, ragged.values = (tuple(a[..., : cache.offset, :] for a in part)
                                          for part in (cache.keys, cache.values))
        ragged.offset, ragged.left_padding = mx.array([cache.offset]), mx.array([0])
        ragged._idx, ragged._right_padding, ragged.ends = cache.offset, None, [cache.offset]
        return ragged

    def like(self, cache: BatchKVCache) -> "RaggedQuantizedKVCache":
        return RaggedQuantizedKVCache.from_batch(cache, self.group_size, self.bits)

    def update_and_fetch(self, keys, values):
        new = self._encode(keys, values)
        if not self.aligned:
            self._scatter(new)
            return self.keys_and_values()
        start, n = (self.ends[0] if self.ends else 0), keys.shape[2]
        self._reserve(start + n, new)
        for a, x in zip(self._arrays(), new):  # the buffers in place, as mlx-lm writes them
            a[..., start : start + n, :] = x
        self.ends = [start + n] * len(self.ends)
        self.offset, self._idx = self.offset + n, start + n
        return self.keys_and_values()

    def _arrays(self) -> list | None:
        return None if self.keys is None else [*self.keys, *self.values]

    def _set_arrays(self, arrays: list) -> None:
        self.keys, self.values = tuple(arrays[:3]), tuple(arrays[3:])

    def _encode(self, keys, values) -> list:
        return [*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                *mx.quantize(values, group_size=self.group_size, bits=self.bits)]

    def keys_and_values(self):
        return tuple(tuple(a[..., : self._idx, :] for a in part)
                     for part in (self.keys, self.values))

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row `idx` as one sequence's quantized cache."""
        cache, row = QuantizedKVCache(self.group_size, self.bits), self._row(idx)
        if row is not None:
            cache.keys, cache.values = tuple(row[:3]), tuple(row[3:])
            cache.offset = row[0].shape[2]
        return cache


class ChunkedRows(RaggedKVCache):
    """A chunked-attention layer's rows: a RaggedKVCache whose window is the chunk's size (no
    query sees further back than its chunk's start), each query masked to its own chunk."""

    @classmethod
    def from_chunked(cls, cache: ChunkedKVCache) -> "ChunkedRows":
        """One sequence's chunked cache as a batch of that one row."""
        rows = cls.__new__(cls)
        held = cache.offset - cache.start_position
        rows.keys = rows.values = None
        if cache.keys is not None and held:
            rows.keys, rows.values = (a[..., :held, :] for a in (cache.keys, cache.values))
        rows.offset, rows.left_padding = mx.array([cache.offset]), mx.array([0])
        rows._idx, rows._right_padding, rows.ends = held, None, [held]
        rows._set_window(cache.chunk_size)
        return rows

    def like(self, cache: BatchKVCache) -> "ChunkedRows":
        return ChunkedRows.from_batch(cache, self.window)

    def extract(self, idx: int) -> ChunkedKVCache:
        """Row `idx` as one sequence's chunked cache."""
        cache, row = ChunkedKVCache(self.window), self._row(idx)
        cache.offset = cache.start_position = int(self.offset[idx].item())
        if row is not None:
            cache.keys, cache.values = row
            cache.start_position = cache.offset - row[0].shape[2]
        return cache


def chunk_mask(cache, n: int, size: int) -> mx.array:
    """(rows, 1, n, keys): row i's query j, at position offset[i] + j, sees its row's keys from
    the start of its chunk of `size` positions up to itself, over the columns the next write
    leaves; `cache` a ChunkedRows or a joining row's mlx-lm BatchKVCache (rows ending alike)."""
    if isinstance(cache, RaggedKVCache):
        cut = cache._cut_before_write()
        ends, left = mx.array(cache.ends) - cut, mx.maximum(cache.left_padding - cut, 0)
        width = max(cache.ends) - cut + n
    else:
        ends, left = mx.full(cache.offset.shape, cache._idx), cache.left_padding
        width = cache._idx + n
    shift = (cache.offset - ends)[:, None]  # a row's position of a column, less the column
    query = ends[:, None] + mx.arange(n)  # (rows, n): each query's own column
    start = (query + shift) // size * size - shift  # the column its chunk starts at
    keys = mx.arange(width)
    mask = (keys <= query[..., None]) & (keys >= start[..., None]) & \
        (keys >= left[:, None, None])
    return mask[:, None]
