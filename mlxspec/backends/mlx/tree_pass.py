"""One target pass over a tree of drafts through mlx-lm's own model classes, and the cache kept
for the committed branch afterwards.

A tree's nodes go through the model as one sequence [pending, node 1, ..., node N]; two things
make it a tree rather than a chain, both swapped in for the one call and restored after it:
- each attention cache is seen through a view whose `make_mask` gives every node its ancestors
  (and the cached context) only, where mlx-lm's models ask their cache for the mask;
- each attention's `rope` rotates node i at position offset + depth(i), not offset + i: the
  nodes are laid out as a batch of one-position sequences, for which mx.fast.rope takes one
  offset per sequence.
Afterwards the cache holds every node's keys and values; `keep_branch` moves the committed
branch's to the positions after the pending token (where their rotation already put them).
"""

from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ...tree import TreeShape
from .hidden_states import instance_attributes
from .window_cache import WindowKVCache


def holds_trees(cache: list) -> bool:
    """Caches whose entries can be moved by index: mlx-lm's KVCache and QuantizedKVCache, and
    a sliding window's WindowKVCache (mlx-lm's rotation and a recurrent state cannot hold a
    tree)."""
    return all(type(c) in (KVCache, QuantizedKVCache, WindowKVCache) for c in cache)


def ancestor_mask(shape: TreeShape) -> mx.array:
    """(N+1, N+1) bool: row i sees node j when j is i or one of its ancestors."""
    rows = []
    for node, parent in enumerate((0,) + shape.parents):
        row = list(rows[parent]) if node else [False] * (shape.size + 1)
        row[node] = True
        rows.append(row)
    return mx.array(rows)


class _TreeView:
    """A cache as the model sees it during a tree pass: the tree's mask, all else the cache's.
    A sliding window's cache masks each node to its own window (WindowKVCache.tree_mask)."""

    def __init__(self, cache, mask: mx.array, ancestors: mx.array, depth: mx.array):
        self._cache, self._mask = cache, mask
        self._ancestors, self._depth = ancestors, depth

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if isinstance(self._cache, WindowKVCache):
            return self._cache.tree_mask(self._ancestors, self._depth, window_size)
        return self._mask

    def __getattr__(self, name):
        return getattr(self._cache, name)


class TreeRoPE:
    """An attention's RoPE rotating token i at offset + depth[i] (a tree node at its depth)."""

    def __init__(self, rope, depth: mx.array):
        self.rope, self.depth = rope, depth

    def __call__(self, x, offset=0):
        # (1, heads, N+1, dims) -> (N+1, heads, 1, dims): a batch of one-position sequences.
        per_node = self.rope(x.transpose(2, 1, 0, 3), offset=offset + self.depth)
        return per_node.transpose(2, 1, 0, 3)

    def __getattr__(self, name):
        return getattr(self.rope, name)


def attention_modules(model) -> list:
    """The model's modules that hold a `rope`: its attention layers."""
    return [m for _, m in model.named_modules() if isinstance(m, dict) and "rope" in m]


@contextmanager
def tree_pass(attentions: list, cache: list, shape: TreeShape):
    """Yield the cache list to give the model (whose `attention_modules` are `attentions`) for
    one pass over [pending, nodes] of `shape`."""
    offset = cache[0].offset
    ancestors = ancestor_mask(shape)
    mask = mx.concatenate([mx.ones((shape.size + 1, offset), dtype=mx.bool_), ancestors],
                          axis=1)
    depth = mx.array(shape.depth, dtype=mx.int32)
    with instance_attributes([(a, "rope", TreeRoPE(a["rope"], depth)) for a in attentions]):
        yield [_TreeView(c, mask, ancestors, depth) for c in cache]


def _move(buffer, start: int, sources: mx.array):
    """Entries at `sources` (positions) to start, start + 1, ... of a (.., positions, dims)
    buffer, or of each part of a quantized one."""
    if isinstance(buffer, (tuple, list)):
        return type(buffer)(_move(part, start, sources) for part in buffer)
    buffer[..., start : start + sources.size, :] = buffer[..., sources, :]
    return buffer


def keep_branch(cache: list, pending_at: int, branch: list[int]) -> None:
    """After a tree pass that put the pending token at `pending_at` and its nodes after it, keep
    the pending token and the nodes of `branch` (1-based, root to leaf), in order."""
    moved = [n for i, n in enumerate(branch, start=1) if n != i]  # a chain's branch stays put
    for c in cache:
        if moved:  # buffers index positions from the first one they hold (a window's start)
            at = pending_at - getattr(c, "start", 0)
            sources = mx.array([at + n for n in branch], dtype=mx.int32)
            c.keys = _move(c.keys, at + 1, sources)
            c.values = _move(c.values, at + 1, sources)
        c.offset = pending_at + 1 + len(branch)
