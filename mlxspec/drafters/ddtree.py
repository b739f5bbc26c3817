"""DDTree drafts on MLX, from independent per-depth distributions: a DFlash block's slots,
Medusa's heads. The tree itself is grown on the host (mlxspec.tree.best_first_drafts)."""

import mlx.core as mx

from ..engine import Draft
from ..tree import best_first_drafts


def best_rows(logprobs: mx.array, width: int, ids=None) -> tuple[list, list]:
    """Each depth's `width` best rows of logprobs (depth, rows), read to the host once: their
    log-probabilities and ids (target ids through `ids`, a draft vocabulary's, when given)."""
    best = mx.argsort(-logprobs, axis=-1)[:, :width]
    scores = mx.take_along_axis(logprobs, best, axis=-1)
    ids = best if ids is None else ids[best]
    mx.eval(scores, ids)
    return scores.tolist(), ids.tolist()


def best_first_draft(logprobs: mx.array, width: int, budget: int, ids=None) -> Draft:
    """A DDTree draft from logprobs (depth, rows): each depth's `width` best rows grown into the
    `budget` most probable branches. Children are deterministic (Draft.probs None), which the
    tree rule keeps lossless when sampling too."""
    drafts, shape = best_first_drafts(*best_rows(logprobs, width, ids), budget)
    return Draft(tokens=drafts, parents=shape.parents)
