"""Acceptance of a tree of drafts in torch: mlxspec.backends.mlx.tree_acceptance's rules, returning what it
returns (accepted depth, next token, the branch's path from the root), so that a torch pass packs
the same result and Pass.verdict() reads either backend's.

The sampled rule runs for every node at once: each node's children are tried against the
target's q there, with uniforms of its own, then the branch walks down from the root through the
child each node kept. Only the nodes on that branch count and their draws are independent, so the
output is distributed as the sequential rule's, with the vocabulary-wide work batched over the
nodes and Python loops only over the tree's width and depth. Nothing is read back to the host.
"""

from dataclasses import dataclass

import torch

from ...sampling import SamplingConfig
from ...tree import TreeShape
from .acceptance import normalised
from .sampling import categorical, processed_logprobs
from .transfer import host_tokens


@dataclass(frozen=True)
class DeviceTree:
    """A TreeShape's topology on the device, as the target's pass and the acceptance index it."""

    shape: TreeShape
    parents: torch.Tensor  # (N+1,): each node's parent, the root its own
    depth: torch.Tensor  # (N+1,)
    children: torch.Tensor  # (N+1, width): each node's children in the order tried, -1 padded

    @classmethod
    def of(cls, shape: TreeShape, device: torch.device) -> "DeviceTree":
        """Copied in one host-to-device transfer (one per step, queued without a sync)."""
        width = max(map(len, shape.children), default=0) or 1
        table = [n for kids in shape.children for n in kids + (-1,) * (width - len(kids))]
        size = shape.size + 1
        flat = host_tokens([0, *shape.parents, *shape.depth, *table], device)
        return cls(shape, flat[:size], flat[size : 2 * size], flat[2 * size :].view(size, width))


def _path_to(node: torch.Tensor, tree: DeviceTree) -> torch.Tensor:
    """Nodes from the root to `node` (a 1-element tensor), left-padded with the root to
    max_depth + 1 entries, as mlxspec.backends.mlx.tree_acceptance lays a path out."""
    path = [node]
    for _ in range(tree.shape.max_depth):
        path.append(tree.parents[path[-1]])
    return torch.cat(path[::-1])


def accept_tree_greedy(logits: torch.Tensor, tokens: torch.Tensor, tree: DeviceTree):
    """logits (N+1, V) at nodes 0..N, tokens (N,) -> (accepted, next token, path), each 1-D.

    A node is kept when its token is the target's argmax after its parent and its parent is kept;
    the deepest kept node (the first of equals) ends the branch, as on MLX, and the next token is
    the target's argmax there: greedy decoding of the target, whichever branch holds it.
    """
    targets = logits.argmax(dim=-1)
    match = torch.cat([tokens.new_ones(1, dtype=torch.bool), tokens == targets[tree.parents[1:]]])
    kept = match
    for _ in range(tree.shape.max_depth):
        kept = match & kept[tree.parents]
    best = torch.where(kept, tree.depth, -1).argmax().reshape(1)
    return tree.depth[best], targets[best], _path_to(best, tree)


def accept_tree_sampled(logits: torch.Tensor, tokens: torch.Tensor, tree: DeviceTree,
                        draft_probs: torch.Tensor | None, sampling: SamplingConfig):
    """Multi-candidate speculative sampling over a tree (SpecInfer), as
    mlxspec.backends.mlx.tree_acceptance.accept_tree_sampled: at each node its children are tried in order; a
    child x drawn from the drafter's p (row `draft_probs[node]`) is kept with probability
    min(1, q(x) / p(x)), else q becomes normalise(max(0, q - p)); with `draft_probs` None the
    children are deterministic, x is kept with probability q(x), else removed from q. The next
    token is drawn from what the branch's last node has left of q (its q itself past a leaf).
    """
    q = processed_logprobs(logits, sampling).exp()  # (N+1, V): row n after node n's path
    p = None if draft_probs is None else draft_probs.float()
    node_tokens = torch.cat([tokens[:1], tokens])  # node n's token at n (the root's unused)
    kept_child = torch.full_like(tree.parents, -1)  # per node: the child it keeps, or -1
    uniform = torch.rand(tree.children.shape, device=q.device)
    for j, child in enumerate(tree.children.unbind(dim=1)):
        x = node_tokens[child.clamp_min(0)][:, None]  # (N+1, 1)
        if p is None:
            keep_probability, residual = q.gather(1, x)[:, 0], q.scatter(1, x, 0.0)
        else:
            keep_probability = q.gather(1, x)[:, 0] / p.gather(1, x)[:, 0].clamp_min(1e-30)
            residual = (q - p).clamp_min(0.0)
        tried = (child >= 0) & (kept_child < 0)
        kept = tried & (uniform[:, j] < keep_probability)
        kept_child = torch.where(kept, child, kept_child)
        q = torch.where((tried & ~kept)[:, None], normalised(residual, q), q)
    node = tree.parents.new_zeros(1)
    for _ in range(tree.shape.max_depth):  # down the kept children; a node keeping none stays
        node = torch.where(kept_child[node] >= 0, kept_child[node], node)
    return tree.depth[node], categorical(q[node]), _path_to(node, tree)
