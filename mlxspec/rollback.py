"""Putting an mlx-lm cache back to fewer positions, for the target (MLXTarget.trim) and for a draft
model (drafters/draft_model.py) alike.

An attention layer's cache (KVCache and kin) cuts its last positions off. A recurrent layer's cache
(mlx-lm's ArraysCache) holds one state that every pass replaces, so it cannot be cut: it is put
back to a snapshot taken where the cache held the positions to keep, or before them, and the kept
positions then run again (as a target's rollback does, re-running only the recurrent layers).
"""

from mlx_lm.models.cache import ArraysCache


def is_recurrent(cache) -> bool:
    """mlx-lm's ArraysCache: state arrays (a convolution window, a recurrent state) that each pass
    replaces rather than extends, as in the linear-attention layers of Qwen3-Next and Qwen3.5;
    it cannot be cut back, only restored from a snapshot."""
    return isinstance(cache, ArraysCache)


def recurrent_layers(cache: list) -> list:
    return [c for c in cache if is_recurrent(c)]


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
    recurrent ones)."""
    for c in cache:
        if not is_recurrent(c):
            c.trim(n)


def attention_trimmable(cache: list, n: int) -> bool:
    """Whether every per-position layer can be cut back by n positions now (a RotatingKVCache
    past its window cannot at all; a WindowKVCache can while the window stays held)."""
    return all(c.room() >= n if hasattr(c, "room") else c.is_trimmable()
               for c in cache if not is_recurrent(c))
