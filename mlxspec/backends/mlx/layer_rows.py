"""Rows of a batch of mlx-lm's deepseek_v41, each with its own LayerCache.

deepseek_v41's model code reads one int position for all rows (`cache[0].offset`, its start_pos)
and one window width, and its LayerCache (window rows, closed compressed groups, the open
group's rows) keeps no position per row: rows of different lengths cannot share one. A batch
holds a layer's caches as LayerRows, one LayerCache per row, and for one call (a per-call
adapter, RowAttention) each layer's attention runs row by row, each row on its own cache at its
own position and length with its own shared state (compressed keys, index keys) across layers;
the rest of the layer (its hyper-connections, its experts) runs on all rows at once.

A LayerCache cannot be cut back (it evicts and closes groups as it writes) but every write
rebinds its attributes (mlxspec.rollback.SNAPSHOT_CACHES): a pass with drafts keeps a copy of
each row's fields, and a rollback puts them back and runs the pass again to each row's kept
length (MLXBatchTarget's rollback), as a lone sequence of it does.
"""

import copy

import mlx.core as mx

from ...rollback import restore_fields, save_fields

# mlx-lm modules whose layers' caches a batch holds as LayerRows.
ROW_CACHES = {"mlx_lm.models.deepseek_v41"}


class LayerRows:
    """A layer's caches in a batch: one LayerCache per row, and per row the length of the call
    being prepared (None: every row the call's width)."""

    offset = 0  # what deepseek_v41's model code reads of its first cache; RowAttention ignores
    window = None  # the indices it builds from them

    def __init__(self, rows: list):
        self.rows = list(rows)
        self.lengths = None

    @classmethod
    def merge(cls, caches: list) -> "LayerRows":
        return cls([row for c in caches for row in c.rows])

    @property
    def state(self) -> list:
        return [row.state for row in self.rows]

    def prepare(self, lengths=None, **kwargs) -> None:
        self.lengths = None if lengths is None else [int(n) for n in lengths]

    def finalize(self) -> None:
        self.lengths = None

    def filter(self, index: mx.array) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]

    def extend(self, other: "LayerRows") -> None:
        self.rows = self.rows + other.rows

    def extract(self, i: int):
        """Row i's LayerCache, which later writes to the batch leave as it is."""
        return copy.copy(self.rows[i])

    def drop(self, counts: list[int]) -> None:
        """Nothing to cut: a rollback puts the rows' fields back and runs the pass again."""

    def fields(self) -> list[dict]:
        return save_fields(self.rows)

    def restore(self, fields: list[dict]) -> None:
        restore_fields(self.rows, fields)


def joining_rows(cache) -> LayerRows:
    """One sequence's LayerCache as a batch of one row, copied: a kept prompt cache's own is
    left as it is."""
    return LayerRows([copy.copy(cache)])


def holds_rows(model) -> bool:
    return type(model).__module__ in ROW_CACHES


class RowAttention:
    """A deepseek_v41 attention run row by row: each row's first lengths[i] inputs on its own
    LayerCache, at its own position and window, with its own shared state; the outputs padded
    back to the call's width (a row of length 0 runs nothing)."""

    def __init__(self, attention, shared: list[dict]):
        self.attention, self.shared = attention, shared

    def __call__(self, x, *, start_pos, window_idx, cache, shared):
        from mlx_lm.models.deepseek_v41 import _window_indices  # only where the model is

        width = x.shape[1]
        lengths = cache.lengths or [width] * x.shape[0]
        outs = []
        for i, (row, n) in enumerate(zip(cache.rows, lengths)):
            if n == 0:  # a row with nothing left to prefill in this chunk
                outs.append(mx.zeros_like(x[i : i + 1]))
                continue
            held = 0 if row.window is None else row.window.shape[1]
            indices = _window_indices(previous=held, length=n, window=row.window_size)[None]
            out = self.attention(x[i : i + 1, :n], start_pos=row.offset, window_idx=indices,
                                 cache=row, shared=self.shared[i])
            outs.append(mx.pad(out, [(0, 0), (0, width - n), (0, 0)]))
        return mx.concatenate(outs, axis=0)

    def __getattr__(self, name):
        return getattr(self.attention, name)


def row_attentions(model, cache: list) -> list:
    """(layer, attribute, adapter) for one batched call of `model` on LayerRows: every layer's
    attention run row by row, the rows' shared states kept across the call's layers."""
    if not holds_rows(model) or not cache or not isinstance(cache[0], LayerRows):
        return []
    shared = [{} for _ in cache[0].rows]
    return [(layer, "self_attn", RowAttention(layer.self_attn, shared))
            for layer in model.layers]
