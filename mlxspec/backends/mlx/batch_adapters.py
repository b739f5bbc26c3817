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

A row starting its sequence in a batch of recurrent_gemma: its RG-LRU treats no state otherwise
than a state of zeros, which a batch holds for such a row; its blocks run row by row, that row
from no state (fresh_states; padded_rows says why).

Each row's chunks and attention temperature in llama4. mlx-lm's llama4 builds one chunk mask for
all rows from `cache[0].start_position` and `cache[0].offset` read as Python ints, and its NoPE
layers scale their queries by a temperature of `mx.arange(offset + 1, offset + L + 1)`. For one
call its chunked layers' caches are seen through views whose offset and start read 0 (the mask
built from them is not used), and their attentions get each row's own chunk mask from the cache
(ragged_cache.chunk_mask); its NoPE attentions run mlx-lm's code with their own temperature off
and their query projection scaled by each row's temperature instead: the same product, per row.

Each row's own n-gram context in longcat_flash_ngram, whose model keeps the last ids of each call
whatever each row's length: its n-gram embedding runs on each row's context and leaves each row's
after its own length (ngram_rows).

Each row's attention alone on its own cache in deepseek_v41, whose model code reads one position
and one window for all rows: its attentions run row by row on the batch's LayerRows (layer_rows).
"""

from contextlib import contextmanager

import mlx.core as mx

from .hidden_states import decoder_layers, instance_attributes, run_rows
from .layer_rows import row_attentions
from .ngram_rows import ngram_rows
from .ragged_cache import chunk_mask

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


class _ChunkView:
    """A chunked layer's cache as llama4's model code reads it for its one mask (position 0,
    nothing to trim); its attention (_ChunkedAttention) gets the cache itself."""

    offset = start_position = 0

    def __init__(self, cache):
        self.cache = cache

    def maybe_trim_front(self) -> None:
        """The batch's cache forgets what no chunk needs as it writes (its window)."""


class _ChunkedAttention:
    """A chunked-attention layer's attention, given each row's own chunk mask."""

    def __init__(self, attention, size: int):
        self.attention, self.size = attention, size

    def __call__(self, x, mask=None, cache=None):
        cache = cache.cache
        return self.attention(x, chunk_mask(cache, x.shape[1], self.size), cache)

    def __getattr__(self, name):
        return getattr(self.attention, name)


class _TemperedAttention:
    """A NoPE attention run as mlx-lm's code with its one-offset temperature off and its query
    projection times each row's own: log(floor(position / floor_scale) + 1) * attn_scale + 1,
    positions counted from 1, as mlx-lm computes it for one sequence."""

    attn_temperature_tuning = 0

    def __init__(self, attention):
        self.attention, self._cache = attention, None

    def __call__(self, x, mask=None, cache=None):
        self._cache = cache
        return type(self.attention).__call__(self, x, mask, cache)

    def q_proj(self, x):
        a = self.attention
        positions = mx.maximum(self._cache.offset[:, None], 0) + mx.arange(1, x.shape[1] + 1)
        scales = mx.log(mx.floor(positions / a.floor_scale) + 1.0) * a.attn_scale + 1.0
        queries = a.q_proj(x)
        return (queries * scales[..., None]).astype(queries.dtype)

    def __getattr__(self, name):
        return getattr(self.attention, name)


def _llama4_rows(model, cache: list) -> tuple[list, list]:
    """llama4's adapters and the cache list to give it (see the module's docstring); none and
    `cache` itself for other models, or one not in a batch."""
    if type(model).__module__ != "mlx_lm.models.llama4" or not cache or \
            not isinstance(getattr(cache[-1], "offset", None), mx.array):
        return [], cache
    inner = model.language_model.model
    adapters, seen = [], list(cache)
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        attention = layer.self_attn
        if (i + 1) % 4 != 0:  # mlx-lm's llama4: a chunked layer
            adapters.append((layer, "self_attn",
                             _ChunkedAttention(attention, inner.attention_chunk_size)))
            seen[i] = _ChunkView(c)
        elif attention.attn_temperature_tuning and not attention.use_rope:
            adapters.append((layer, "self_attn", _TemperedAttention(attention)))
    return adapters, seen


# mlx-lm modules whose recurrent blocks treat no state otherwise than zeros: (the decoder layer's
# attribute holding one, the block's class name).
_FRESH_STATES = {"mlx_lm.models.recurrent_gemma": ("temporal_block", "RecurrentBlock")}


class _FromNoState:
    """A recurrent block run row by row (to each row's length where the cache has them), the
    rows starting their sequence in this call from no state. It runs the block itself, not
    what wraps it for the call (a recorder: a rollback then runs the pass again, rerun_kept)."""

    def __init__(self, block, fresh: list[bool]):
        self.block, self.fresh = block, fresh

    def __call__(self, x, cache=None, mask=None):
        if cache is None:
            return self.block(x, cache=cache, mask=mask)
        lengths = getattr(cache, "lengths", None)
        lengths = [x.shape[1]] * x.shape[0] if lengths is None else lengths.tolist()
        return run_rows(self.block, x, cache, lengths, fresh=self.fresh)

    def __getattr__(self, name):
        return getattr(self.block, name)


def fresh_states(model, cache: list) -> list:
    """(layer, attribute, adapter) for one batched call of `model` on `cache`: its blocks that
    treat no state otherwise than zeros, where some row's attention caches hold no position."""
    where = _FRESH_STATES.get(type(model).__module__)
    offsets = next((c.offset for c in cache if isinstance(getattr(c, "offset", None), mx.array)),
                   None) if where and cache else None
    if offsets is None or offsets.ndim != 1:
        return []
    fresh = (offsets <= 0).tolist()  # a row whose attention holds no position
    if not any(fresh):
        return []
    name, kind = where
    layers = [getattr(layer, "layer", layer) for layer in decoder_layers(model)]  # captured
    blocks = [(layer, _unwrapped(getattr(layer, name, None), kind)) for layer in layers]
    return [(layer, name, _FromNoState(block, fresh)) for layer, block in blocks
            if block is not None]


def _unwrapped(module, kind: str):
    """The module of class `kind` under the wrappers a call set on it (hidden_states'), or
    None."""
    while module is not None and type(module).__name__ != kind:
        module = vars(module).get("module")
    return module


@contextmanager
def rows_at_their_positions(model, cache: list):
    """Yield the cache list to give `model` for one batched call: `cache` itself, unless the
    model reads one offset for all rows (which then gets each row's) or one chunk (llama4's,
    whose chunked layers' caches it sees through views), with the model's attentions seeing a
    batch's mask in the shape they need, an n-gram embedding each row's own context and
    deepseek_v41's attentions each row's own LayerCache."""
    adapters = _grouped_attentions(model) + _kv_reuse_ropes(model, cache) + \
        fresh_states(model, cache) + ngram_rows(model) + row_attentions(model, cache)
    chunked, cache = _llama4_rows(model, cache)
    adapters += chunked
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
