"""Each row's own n-gram context in a batch of a model that keeps one beside its layers.

mlx-lm's longcat_flash_ngram embeds each token with the n - 1 token ids before it, and keeps the
last n - 1 ids of each call (its context) in an ArraysCache that its model updates outside any
layer, taking the call's last columns whatever each row's length: a right-padded row would keep
its pads, a verify pass its rejected drafts. A context held n - 1 wide with zeros before a short
one is the same context: mlx-lm's code shifts zeros in where it holds none.

For one batched call the n-gram embedding (NgramRows, a per-call adapter) gets each row's context
before the call and leaves each row's after its own length (the cache's `lengths` where a
prefill chunk or a rerun set them, else the call's width). A verify pass's rollback sets row i's
context to the one after its keeps[i] first inputs, from its context before the pass and the
pass's inputs (context_after): nothing runs again. A lone sequence (MLXTarget) rolls its context
back so too, rather than running its kept tokens through the whole model again.
"""

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

# mlx-lm modules keeping an n-gram context in the first cache of their list, and where the n-gram
# embedding reading it lives: (the model's attribute, the embedding's attribute).
_NGRAM_CONTEXT = {"mlx_lm.models.longcat_flash_ngram": ("model", "ngram_embeddings")}


def context_caches(model, cache: list | None) -> list:
    """The caches of `model`'s list that hold an n-gram context (none for other models)."""
    if type(model).__module__ not in _NGRAM_CONTEXT or not cache:
        return []
    return cache[:1]


def _embedding(model):
    owner, name = _NGRAM_CONTEXT[type(model).__module__]
    return getattr(getattr(model, owner), name)


def held_context(context: mx.array | None, rows: int, width: int) -> mx.array:
    """A context as (rows, width) int64 ids, zeros before a shorter one (none: all zeros)."""
    if context is None:
        return mx.zeros((rows, width), dtype=mx.int64)
    context = context.astype(mx.int64)
    missing = width - context.shape[1]
    if missing <= 0:
        return context[:, context.shape[1] - width :]
    return mx.concatenate([mx.zeros((rows, missing), dtype=mx.int64), context], axis=1)


def context_after(before: mx.array, inputs: mx.array, lengths: mx.array) -> mx.array:
    """Row i's last `width` ids after its first lengths[i] inputs, `before` (rows, width) its
    context before them and inputs (rows, S) the call's."""
    width = before.shape[1]
    joined = mx.concatenate([before, inputs.astype(mx.int64)], axis=1)
    at = lengths.astype(mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)
    return mx.take_along_axis(joined, at, axis=1)


class NgramRows:
    """An n-gram embedding run as mlx-lm's on each row's own context, leaving each row's
    context after its own length."""

    def __init__(self, embedding):
        self.embedding = embedding

    def __call__(self, input_ids: mx.array, cache=None) -> mx.array:
        if cache is None:
            return self.embedding(input_ids, cache=None)
        rows, width = input_ids.shape
        before = held_context(cache[0], rows, self.embedding.n - 1)
        out = self.embedding(input_ids, cache=[before])  # a scratch list: mlx-lm writes it
        lengths = getattr(cache, "lengths", None)
        if lengths is None:
            lengths = mx.full((rows,), width, dtype=mx.int32)
        cache[0] = context_after(before, input_ids, lengths)
        return out

    def __getattr__(self, name):
        return getattr(self.embedding, name)


def ngram_rows(model) -> list:
    """(owner, attribute, adapter) for one batched call of `model`: its n-gram embedding, if
    it keeps a context."""
    where = _NGRAM_CONTEXT.get(type(model).__module__)
    if where is None:
        return []
    owner = getattr(model, where[0])
    return [(owner, where[1], NgramRows(getattr(owner, where[1])))]


def widened(model, caches: list) -> list:
    """A row's caches with its n-gram context held n - 1 wide (a lone run keeps a shorter one
    early on), so that rows' contexts merge into one batch array; the others as they are."""
    held = context_caches(model, caches)
    if not held or held[0][0] is None:
        return caches
    context = ArraysCache(1)
    context[0] = held_context(held[0][0], 1, _embedding(model).n - 1)
    return [context] + list(caches[1:])


def roll_back_contexts(contexts: list, before: list, inputs: mx.array, keeps: list[int]) -> None:
    """Each n-gram context after row i's first keeps[i] inputs of the pass `inputs`, from the
    contexts `before` it (None: no row held one yet)."""
    lengths = mx.array(keeps, dtype=mx.int32)
    for cache, context in zip(contexts, before):  # the pass left every context n - 1 wide
        held = held_context(context, len(keeps), cache[0].shape[1])
        cache[0] = context_after(held, inputs, lengths)
