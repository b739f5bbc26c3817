"""Putting an mlx-lm cache back to fewer positions, for the target (MLXTarget.trim) and for a draft
model (drafters/draft_model.py) alike.

An attention layer's cache (KVCache and kin) cuts its last positions off. A recurrent layer's cache
(mlx-lm's ArraysCache) holds one state that every pass replaces, so it cannot be cut: it is put
back to a snapshot taken where the cache held the positions to keep, or before them, and the kept
positions then run again (as a target's rollback does, re-running only the recurrent layers).
A layer whose CacheList holds such a state beside keys and values (falcon_h1's Mamba state beside
its attention's) is both: its states are put back and its keys and values cut.
A cache that forgets as it writes but only ever rebinds its attributes (SNAPSHOT_CACHES: mlx-lm's
deepseek_v41 LayerCache) is put back to a copy of those attributes, and the kept positions run
again, as for a recurrent state.
"""

from mlx_lm.models.cache import ArraysCache, CacheList


# Cache kinds (module.class) that cannot be cut back but are put back exactly by a copy of the
# attributes named: every write rebinds one of them to a new array, none writes into an array in
# place, so the arrays a copy refers to never change. deepseek_v41's LayerCache evicts window rows
# and closes compressed groups as it writes (`_append`, `update_window`, Compressor.__call__ and
# Attention._compress all assign).
SNAPSHOT_CACHES = {
    "mlx_lm.models.deepseek_v41.LayerCache":
        ("offset", "window", "compress_kv", "index_k", "pending_kv", "pending_gate"),
}


def snapshot_fields(cache) -> tuple[str, ...]:
    """The attributes that put a cache of a SNAPSHOT_CACHES kind back; () for any other."""
    kind = type(cache)
    return SNAPSHOT_CACHES.get(f"{kind.__module__}.{kind.__qualname__}", ())


def snapshotted_layers(cache: list) -> list:
    """The caches among a model's that roll back by a copy of their attributes."""
    return [c for c in cache if snapshot_fields(c)]


def save_fields(layers: list) -> list[dict]:
    """What `snapshotted_layers` hold now: references, as a pass rebinds rather than writes."""
    return [{name: getattr(c, name) for name in snapshot_fields(c)} for c in layers]


def restore_fields(layers: list, saved: list[dict]) -> None:
    """Put back what `save_fields` took of the same layers."""
    for c, fields in zip(layers, saved, strict=True):
        for name, value in fields.items():
            setattr(c, name, value)


def is_recurrent(cache) -> bool:
    """A layer's cache holding a recurrent state, which cannot be cut back, only restored from a
    snapshot: mlx-lm's ArraysCache (state arrays, a convolution window and a recurrent state,
    that each pass replaces rather than extends, as in the linear-attention layers of Qwen3-Next
    and Qwen3.5), or a CacheList holding one beside caches of keys and values that any rollback
    can cut (falcon_h1's, baichuan_m1's full-attention layers'). A CacheList whose keys and
    values live in a window mlx-lm rotates is neither: nothing can roll it back."""
    if isinstance(cache, ArraysCache):
        return True
    if not isinstance(cache, CacheList):
        return False
    members = cache.caches
    return any(is_recurrent(m) for m in members) and all(
        is_recurrent(m) or _cuts_back(m) for m in members)


def leaves(cache) -> list:
    """A layer's caches: itself, or a CacheList's members, each in turn its leaves."""
    if isinstance(cache, CacheList):
        return [leaf for m in cache.caches for leaf in leaves(m)]
    return [cache]


def _cuts_back(cache) -> bool:
    """A per-position cache that a rollback of the last pass can cut: one with no window mlx-lm
    rotates (KVCache, QuantizedKVCache), or a WindowKVCache (it keeps what that needs)."""
    if hasattr(cache, "room"):
        return True
    return cache.is_trimmable() and getattr(cache, "max_size", None) is None


def _states(cache) -> list:
    """The ArraysCaches of a recurrent layer's cache (itself, or a CacheList's members)."""
    if isinstance(cache, CacheList):
        return [s for m in cache.caches if is_recurrent(m) for s in _states(m)]
    return [cache]


def recurrent_layers(cache: list) -> list:
    """The recurrent states among a model's caches, one ArraysCache each (a CacheList's
    members: see is_recurrent)."""
    return [s for c in cache if is_recurrent(c) for s in _states(c)]


def snapshot(recurrent: list) -> list[list]:
    """The states the recurrent layers hold now. A pass replaces a layer's arrays rather than
    writing into them, so keeping references is a snapshot (nothing is copied)."""
    return [list(c.cache) for c in recurrent]


def restore(recurrent: list, states: list[list]) -> None:
    """Put back the states `snapshot` took of the same layers."""
    for c, state in zip(recurrent, states):
        c.cache = list(state)


def trim_attention(cache: list, n: int) -> None:
    """Drop the last n positions of every layer that keeps one entry per position (all but the
    recurrent ones and those put back by their attributes, and of a recurrent layer's CacheList
    its keys and values)."""
    for c in cache:
        if isinstance(c, CacheList) and is_recurrent(c):
            trim_attention(c.caches, n)
        elif not is_recurrent(c) and not snapshot_fields(c):
            c.trim(n)


def attention_trimmable(cache: list, n: int) -> bool:
    """Whether every per-position layer can be cut back by n positions now (a RotatingKVCache
    past its window cannot at all; a WindowKVCache can while the window stays held)."""
    return all(attention_trimmable(c.caches, n) if isinstance(c, CacheList) and is_recurrent(c)
               else c.room() >= n if hasattr(c, "room") else c.is_trimmable()
               for c in cache if not isinstance(c, ArraysCache))
