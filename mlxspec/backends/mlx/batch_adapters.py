"""Batched calls of mlx-lm models whose code assumes one row or one position, adapted for one
call at a time (instance_attributes: set on the instances for that call only, so the model's
code, modules and weights are left as they are).

Each row at its own position, for a model that reads its cache's offset as one Python number.
A batch's caches hold one offset per row (an array). mlx-lm's gpt_bigcode builds its learned
position ids as `mx.array(np.arange(cache[0].offset, cache[0].offset + L))`, which only a
one-row batch can convert. For one call, the model is given its first cache through a view
whose offset reads 0 (so it builds 0..L-1), and its position embedding is seen through one that
adds each row's own offset to those ids, as mlx-lm's gpt2 builds them (`mx.arange(L) +
offset[..., None]`).

A per-row mask for an attention that groups query heads in a 5-d product. mlx-lm's gemma2
reshapes its queries to (rows, kv heads, repeats, L, D) and applies the mask to those scores: a
batch's mask (rows, 1, L, keys) cannot broadcast against them (mlx-lm's own batch_generate fails
the same way), so its attentions get the mask as (rows, 1, 1, L, keys).

Each row's queries at its own position in an attention that reuses another layer's keys.
mlx-lm's afm7 rotates a KV-reuse layer's queries at `S - L`, S the width of the shared key
buffer, which counts a row's left padding and, in a RaggedKVCache, every column up to the
longest row's end, while the keys were rotated at each row's own offset: its RoPE is given the
shared cache's offset per row (after the pass's write, less the queries).
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


# mlx-lm modules whose attentions group query heads as (rows, kv heads, repeats, L, D) before
# applying the mask: the name of the attention on each decoder layer.
_GROUPED_SCORES = {"mlx_lm.models.gemma2": "self_attn"}


class _GroupedMask:
    """An attention whose 4-d batch mask gains the repeats axis its scores have."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, x, mask=None, cache=None):
        if isinstance(mask, mx.array) and mask.ndim == 4:
            mask = mask[:, :, None]  # (rows, 1, 1, L, keys)
        return self.attention(x, mask, cache)

    def __getattr__(self, name):
        return getattr(self.attention, name)


def _grouped_attentions(model) -> list:
    name = _GROUPED_SCORES.get(type(model).__module__)
    if name is None:
        return []
    from .hidden_states import decoder_layers

    return [(layer, name, _GroupedMask(getattr(layer, name))) for layer in decoder_layers(model)
            if getattr(getattr(layer, name), "repeats", 1) > 1]


class _SharedKeyPositions:
    """afm7's KV-reuse RoPE, rotating each row's queries at its own position: the shared
    cache's offset (its keys are written) less the queries."""

    def __init__(self, rope, cache):
        self.rope, self.cache = rope, cache

    def __call__(self, x, offset=0):
        return self.rope(x, offset=self.cache.offset - x.shape[2])

    def __getattr__(self, name):
        return getattr(self.rope, name)


def _kv_reuse_ropes(model, cache: list) -> list:
    if type(model).__module__ != "mlx_lm.models.afm7" or not cache or \
            not isinstance(getattr(cache[-1], "offset", None), mx.array):
        return []
    return [(layer.self_attn, "rope", _SharedKeyPositions(layer.self_attn.rope, cache[-1]))
            for layer in model.model.kv_reuse_layers]


@contextmanager
def rows_at_their_positions(model, cache: list):
    """Yield the cache list to give `model` for one batched call: `cache` itself, unless the
    model reads one offset for all rows (which then gets each row's), with the model's
    attentions seeing a batch's mask in the shape they need."""
    adapters = _grouped_attentions(model) + _kv_reuse_ropes(model, cache)
    where = _ONE_OFFSET.get(type(model).__module__)
    offsets = getattr(cache[0], "offset", None) if cache else None
    if where is None or not isinstance(offsets, mx.array):
        with instance_attributes(adapters):
            yield cache
        return
    owner = getattr(model, where[0])
    embedding = getattr(owner, where[1])
    adapters.append((owner, where[1], _RowPositions(embedding, offsets)))
    with instance_attributes(adapters):
        yield [_FromZero(cache[0])] + list(cache[1:])
