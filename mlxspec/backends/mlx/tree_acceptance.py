"""Acceptance of a tree of drafts in MLX: the branch the target's own decoding would take.

A tree verifies several continuations in one pass: node 0 is the pending token, nodes 1..N are
drafts, each with a parent of lower index (so a pass can list them in order and a node's logits
row is the target's distribution after the path to it). A chain is the tree whose parents are
0, 1, ..., K-1. Both rules are lazy device math, like the chain's (mlxspec.backends.mlx.acceptance): a step
still reads back one packed array.
"""

import mlx.core as mx

from ...sampling import SamplingConfig
from ...tree import TreeShape
from .sampling import processed_logprobs


def device_arrays(shape: TreeShape):
    """(parent of each node 0..N, the root its own; depth; children padded with -1)."""
    width = max((len(c) for c in shape.children), default=0) or 1
    table = [list(c) + [-1] * (width - len(c)) for c in shape.children]
    return (mx.array((0,) + shape.parents, dtype=mx.int32),
            mx.array(shape.depth, dtype=mx.int32), mx.array(table, dtype=mx.int32))


def _path_to(node: mx.array, parents: mx.array, max_depth: int) -> mx.array:
    """Nodes from the root to `node`, (max_depth + 1,), left-padded with the root."""
    path = [node]
    for _ in range(max_depth):
        path.append(parents[path[-1]])
    return mx.stack(path[::-1])


def accept_tree_greedy(logits: mx.array, tokens: mx.array, shape: TreeShape):
    """logits (N+1, V) at nodes 0..N, tokens (N,) -> (accepted count, next token, path).

    A draft is kept when it is the target's argmax after its parent and its parent is kept; the
    deepest kept node ends the committed branch (the first of equals: siblings should differ),
    and the next token is the target's argmax there. `path` lists the branch's nodes from the
    root, left-padded with the root to max_depth + 1 entries.
    """
    parents, depth, _ = device_arrays(shape)
    targets = mx.argmax(logits, axis=-1)
    match = mx.concatenate([mx.array([True]), tokens == targets[parents[1:]]])
    kept = match
    for _ in range(shape.max_depth):
        kept = match & kept[parents]
    best = mx.argmax(mx.where(kept, depth, -1))
    return depth[best], targets[best], _path_to(best, parents, shape.max_depth)


def accept_tree_sampled(logits: mx.array, tokens: mx.array, shape: TreeShape,
                        draft_probs: mx.array | None, sampling: SamplingConfig):
    """Multi-candidate speculative sampling over a tree (SpecInfer, Miao et al. 2024).

    From the root, a node's children are tried in order against the target's distribution q
    there: a child x drawn from the drafter's p (row `draft_probs[node]`, the distribution all of
    that node's children were drawn from) is kept with probability min(1, q(x) / p(x)), else q
    becomes normalise(max(0, q - p)) and the next child is tried; with `draft_probs` None the
    children are deterministic (p one-hot per child): x is kept with probability q(x), else
    removed from q. A kept child continues the branch with the target's q there; when no child
    is kept the next token is drawn from what is left of q, and past a leaf from the target's q.
    The output is distributed exactly as the target's own sampling.
    """
    parents, depth, children = device_arrays(shape)
    q_all = mx.exp(processed_logprobs(logits, sampling))  # (N+1, V)
    p_all = None if draft_probs is None else draft_probs.astype(mx.float32)
    vocab = q_all.shape[-1]
    node, q, stopped = mx.array(0, dtype=mx.int32), q_all[0], mx.array(False)
    for _ in range(shape.max_depth):
        kids = children[node]
        p = None if p_all is None else p_all[node]
        chosen = mx.array(-1, dtype=mx.int32)
        for j in range(children.shape[1]):
            child = kids[j]
            tried = (child >= 0) & (chosen < 0) & ~stopped
            x = tokens[mx.maximum(child - 1, 0)]
            if p is None:
                keep_probability = q[x]
                residual = mx.where(mx.arange(vocab) == x, 0.0, q)
            else:
                keep_probability = mx.minimum(1.0, q[x] / mx.maximum(p[x], 1e-30))
                residual = mx.maximum(q - p, 0.0)
            kept = tried & (mx.random.uniform() < keep_probability)
            mass = residual.sum()
            # A rejection has probability 0 when nothing is left; guard the division anyway.
            residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), q)
            chosen = mx.where(kept, child, chosen)
            q = mx.where(tried & ~kept, residual, q)
        moved = chosen >= 0
        node = mx.where(moved, chosen, node)
        q = mx.where(moved, q_all[node], q)
        stopped = stopped | ~moved
    next_token = mx.random.categorical(mx.log(q))
    return depth[node], next_token, _path_to(node, parents, shape.max_depth)
