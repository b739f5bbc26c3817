"""Each row of a batch at its own position, for an mlx-lm model that reads its cache's offset as
one Python number.

A batch's caches hold one offset per row (an array). mlx-lm's gpt_bigcode builds its learned
position ids as `mx.array(np.arange(cache[0].offset, cache[0].offset + L))`, which only a
one-row batch can convert. For one call, the model is given its first cache through a view
whose offset reads 0 (so it builds 0..L-1), and its position embedding is seen through one that
adds each row's own offset to those ids, as mlx-lm's gpt2 builds them (`mx.arange(L) +
offset[..., None]`); both are set on the instances for that call only (instance_attributes),
so the model's code, modules and weights are left as they are.
"""

from contextlib import contextmanager

import mlx.core as mx

from .hidden_states import instance_attributes

# mlx-lm modules whose forward reads `cache[0].offset` as one number for its positions, and
# where their position embedding lives: (the model's attribute, the embedding's attribute).
_ONE_OFFSET = {"mlx_lm.models.gpt_bigcode": ("transformer", "wpe")}


class _FromZero:
    """A cache whose `offset` reads 0; all else (its writes, its mask) is the cache's own."""

    def __init__(self, cache):
        self._cache = cache

    offset = 0

    def __getattr__(self, name):
        return getattr(self._cache, name)


class _RowPositions:
    """A position embedding whose ids 0..L-1 become each row's own positions."""

    def __init__(self, embedding, offsets: mx.array):
        self.embedding, self.offsets = embedding, offsets

    def __call__(self, ids: mx.array) -> mx.array:
        # A left-padded row's pads sit before position 0: any row of the table does for them
        # (no real position attends to a pad).
        return self.embedding(mx.maximum(self.offsets[:, None] + ids, 0))  # (rows, L, hidden)


def reads_one_offset(model) -> bool:
    return type(model).__module__ in _ONE_OFFSET


@contextmanager
def rows_at_their_positions(model, cache: list):
    """Yield the cache list to give `model` for one batched call: `cache` itself, unless the
    model reads one offset for all rows, which then gets each row's."""
    where = _ONE_OFFSET.get(type(model).__module__)
    offsets = getattr(cache[0], "offset", None) if cache else None
    if where is None or not isinstance(offsets, mx.array):
        yield cache
        return
    owner = getattr(model, where[0])
    embedding = getattr(owner, where[1])
    with instance_attributes([(owner, where[1], _RowPositions(embedding, offsets))]):
        yield [_FromZero(cache[0])] + list(cache[1:])
