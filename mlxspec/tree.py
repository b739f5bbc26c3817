"""Draft trees, on the host: their shape, and the chain a target that cannot verify a tree
verifies instead. Backend-neutral (the loop imports it); the acceptance math is per backend."""

import heapq
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class TreeShape:
    """The topology of a draft tree, known on the host: `parents[i - 1]` is node i's parent."""

    parents: tuple[int, ...]

    def __post_init__(self):
        bad = [i + 1 for i, p in enumerate(self.parents) if not 0 <= p <= i]
        if bad:
            raise ValueError(f"tree nodes {bad} have a parent that does not come before them")

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        return cls(tuple(range(k)))

    @property
    def size(self) -> int:
        """Drafts in the tree (the pending token not counted)."""
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """Depth of nodes 0..N (the pending token is at 0)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return tuple(depth)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of nodes 0..N, in the order they are tried."""
        children = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents, start=1):
            children[p].append(i)
        return tuple(tuple(c) for c in children)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def first_chain(self) -> list[int]:
        """Nodes of the branch of first children from the root: each node's first child is the
        drafter's best guess there."""
        nodes, node = [], 0
        while self.children[node]:
            node = self.children[node][0]
            nodes.append(node)
        return nodes


def best_first_tree(logprobs: list[list[float]], budget: int) -> tuple[list[int], TreeShape]:
    """DDTree's construction, best-first over independent per-depth candidates, such as
    one DFlash block's slots: `logprobs[d][r]` is the r-th best token's log-probability at depth
    d + 1, best first. Grows the `budget` nodes of highest path log-probability (a node's score
    is its parent's plus its own) from the root: a node's first child is its rank-0
    candidate, so the tree's first chain is the chain of argmaxes. Returns each node's rank at
    its depth, and the shape."""
    rows = [list(zip(row, range(len(row)))) for row in logprobs]
    return best_first_conditional(lambda depth, parent: rows[depth], len(rows), budget)


def best_first_conditional(candidates, depths: int, budget: int) -> tuple[list, TreeShape]:
    """best_first_tree over candidates that depend on the parent's: `candidates(d, choice)` is
    [(log-probability, choice), ...] best first at depth d + 1 below a node that made `choice`
    (None: the root), as DFlash2's pair scores give (a slot's candidates scored after each of
    the slot before's). Returns each node's choice, and the shape."""
    choices, parents = [], []
    first = candidates(0, None) if budget > 0 and depths > 0 else []
    frontier = [(-first[0][0], 0, 0, 0, None)] if first else []
    while frontier and len(choices) < budget:
        neg_score, parent, depth, rank, above = heapq.heappop(frontier)
        row = candidates(depth, above)
        logprob, choice = row[rank]
        choices.append(choice)
        parents.append(parent)
        node = len(choices)
        score = -neg_score
        if rank + 1 < len(row):  # the next sibling: same parent, next candidate
            sibling = score - logprob + row[rank + 1][0]
            heapq.heappush(frontier, (-sibling, parent, depth, rank + 1, above))
        if depth + 1 < depths:  # the first child: the next depth's best candidate after this
            below = candidates(depth + 1, choice)
            if below:
                heapq.heappush(frontier, (-(score + below[0][0]), node, depth + 1, 0, choice))
    return choices, TreeShape(tuple(parents))  # numbered as added: parents before children


def best_first_drafts(logprobs: list[list[float]], ids: list[list[int]],
                      budget: int) -> tuple[list[int], TreeShape]:
    """A DDTree of draft tokens from per-depth candidates read to the host (any backend's):
    `ids[d][r]` is the token whose log-probability is `logprobs[d][r]`, best first. Returns the
    tokens of best_first_tree's nodes, in node order, and the tree's shape."""
    ranks, shape = best_first_tree(logprobs, budget)
    return [ids[shape.depth[node] - 1][rank] for node, rank in enumerate(ranks, start=1)], shape


MAX_TREE_BUDGET = 256  # nodes verified in one pass; measured budgets that pay are 4 to 64


def check_tree(budget: int | None, width: int) -> tuple[int | None, int]:
    """A tree budget (None: a chain) and width, refused in one line when not positive integers
    or past MAX_TREE_BUDGET (a bound on one step's work)."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise ValueError(f"tree budget must be a positive integer (draft nodes), got {budget!r}")
    if budget is not None and budget > MAX_TREE_BUDGET:
        raise ValueError(f"tree budget must be at most {MAX_TREE_BUDGET} nodes, got {budget}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"tree width must be a positive integer, got {width!r}")
    return budget, width
