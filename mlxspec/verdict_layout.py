"""One row's pass result as a target writes it on the device and `engine.Pass.verdict` reads it
on the host: the layout, in one place.

A pass over [pending, K drafts] (a chain) or [pending, K nodes] (a tree) leaves two flat arrays,
read back together in the step's one host sync:

    ints:   drafts (K) | path (P: a tree's only) | top ids (R·n: with logprobs n) | accepted | next
    floats: each draft's log-probability (K) | the next token's (1) | top values (R·n)

`path` is the committed branch's nodes, root first, left-padded with the root to P = the tree's
depth; R = K + 1, the rows of the pass (pending, then each draft or node), each with its n best
(id, value), best first. The floats exist only with logprobs. A batch's pass lays its rows' ints
(and floats) one after another: each row's width is `int_width` (`float_width`).
"""

from typing import Any, NamedTuple


class Layout(NamedTuple):
    """What a row's ints hold, read back on the host."""

    drafts: list[int]
    path: list[int] | None
    top_ids: list[int]
    accepted: int
    next_token: int


def int_parts(drafts, path, top_ids, accepted, next_token) -> list:
    """The device arrays to concatenate, in order (path and top_ids may be None): drafts (K,),
    path (P,), top ids (R·n,), accepted (1,), next token (1,)."""
    return [drafts] + [p for p in (path, top_ids) if p is not None] + [accepted, next_token]


def int_width(num_draft: int, path_slots: int | None, top_n: int) -> int:
    return num_draft + (path_slots or 0) + top_n * (num_draft + 1) + 2


def float_width(num_draft: int, top_n: int) -> int:
    return num_draft + 1 + top_n * (num_draft + 1)


def read(host: list[int], num_draft: int, path_slots: int | None) -> Layout:
    """A row's ints, as `int_parts` laid them out."""
    path_end = num_draft + (path_slots or 0)
    return Layout(drafts=host[:num_draft],
                  path=host[num_draft:path_end] if path_slots is not None else None,
                  top_ids=host[path_end:-2], accepted=host[-2], next_token=host[-1])


def read_scores(values: list[float], num_draft: int) -> tuple[list[float], float, list[float]]:
    """A row's floats: each draft's log-probability, the next token's, and the top values."""
    return values[:num_draft], values[num_draft], values[num_draft + 1 :]


class HostInts(list):
    """Ints already on the host, handed to engine.Pass in place of a device array (a batch's
    row, cut out of the batch's array after its one read, or a target that computes nothing)."""

    def tolist(self) -> list[Any]:
        return list(self)
