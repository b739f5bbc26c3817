"""What rank 0 tells the other ranks, one small all-sum per step.

Every rank runs its share of every pass, but only rank 0 drafts, accepts and samples: before each
pass it posts the pass's input (the pending token, the drafts, a tree's parents) together with
how the pass before ended (drafts verified, accepted, a tree's branch), which the other ranks
need to cut their caches the same way. A message is a fixed-size int32 vector that rank 0 fills
and the others contribute zeros to, so an all-sum delivers it; it is queued without a host sync
(the pending token of a plain pass queued early is still on the device), and only the receiving
ranks read it on the host. Nothing else crosses between ranks but the pipeline's hidden states.
"""

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

CAPACITY = 1024  # int32 values a message holds: 4 KB
_HEADER = 8
BEGIN, PASS, TRIM, END, SHUTDOWN = 1, 2, 3, 4, 5


class DistributedError(RuntimeError):
    """A rank lost the others (one stopped, or the network dropped): said in one line."""


def lost(err: Exception, rank: int) -> DistributedError:
    return DistributedError(f"rank {rank}: a distributed operation failed ({err}); another rank "
                            f"has stopped or the connection dropped")


@dataclass
class Settled:
    """How a pass ended, as much as the other ranks need to cut their caches alike."""

    num_draft: int
    accepted: int
    branch: tuple[int, ...] | None = None


@dataclass
class Message:
    op: int
    settled: Settled | None = None
    tokens: tuple[int, ...] = ()  # PASS: [pending, drafts]; BEGIN: the prompt
    parents: tuple[int, ...] | None = None  # PASS over a tree
    count: int = 0  # TRIM: positions to drop; BEGIN: the prompt's length
    slot: int = 0  # BEGIN: the kept cache it continues (0: none), and how much of it stays
    held: int = 0
    capture: tuple[int, ...] = ()  # BEGIN: the target layers whose outputs rank 0 reads


def _int32(value) -> mx.array:
    if isinstance(value, mx.array):
        return value.reshape(-1).astype(mx.int32)
    return mx.array(list(value), dtype=mx.int32)


def encode(op: int, settled: Settled | None, fields: Sequence[int] = (),
           parts: Sequence[Any] = ()) -> mx.array:
    """A message as the (CAPACITY,) int32 vector rank 0 contributes to the all-sum: a header
    (op, the settled pass, four fields), a settled tree's branch, then `parts` (host lists or
    device arrays, read without a host sync)."""
    branch = () if settled is None or settled.branch is None else settled.branch
    header = [op, 0, 0, 0, *fields]
    if settled is not None:
        header[1:4] = [settled.num_draft + 1, settled.accepted,
                       0 if settled.branch is None else len(branch) + 1]
    header += [0] * (_HEADER - len(header))
    pieces = [_int32(header + list(branch))] + [_int32(p) for p in parts]
    size = sum(p.size for p in pieces)
    if size > CAPACITY:
        raise ValueError(f"a step of {size} values does not fit a distributed message "
                         f"({CAPACITY}); use a smaller --num-draft or --tree-budget")
    return mx.concatenate(pieces + [mx.zeros((CAPACITY - size,), dtype=mx.int32)])


def decode(v: Sequence[int]) -> Message:
    """The message an all-sum delivered (a BEGIN's prompt follows in a second one: its length
    is in `count`)."""
    op, draft_field, accepted, branch_field, a, b, c, d = v[:_HEADER]
    at, settled = _HEADER, None
    if draft_field:
        branch = None
        if branch_field:
            branch = tuple(v[at : at + branch_field - 1])
            at += branch_field - 1
        settled = Settled(draft_field - 1, accepted, branch)
    if op == BEGIN:
        return Message(BEGIN, slot=a, held=b, count=c, capture=tuple(v[at : at + d]))
    if op == PASS:
        parents = tuple(v[at + a : at + a + b - 1]) if b else None
        return Message(PASS, settled, tokens=tuple(v[at : at + a]), parents=parents)
    if op in (TRIM, END):
        return Message(op, settled, count=a)
    if op == SHUTDOWN:
        return Message(SHUTDOWN)
    raise DistributedError(f"unknown message {op} from rank 0")


class Link:
    """Rank 0's posts and the other ranks' reads over one group."""

    def __init__(self, group):
        self.group = group
        # Set once an operation failed: MLX's backends then hang on any later one, so nothing
        # more is posted (the others learn of it from their own failed operation).
        self.broken = False
        self.shut = False  # the others were told to stop following: nothing more to post

    def lost(self, err: Exception) -> DistributedError:
        self.broken = True
        return lost(err, self.rank)

    @property
    def rank(self) -> int:
        return self.group.rank()

    def _all_sum(self, values: mx.array) -> mx.array:
        return mx.distributed.all_sum(values, group=self.group)

    def _post(self, op: int, settled: Settled | None, fields: Sequence[int] = (),
              parts: Sequence[Any] = (), wait: bool = False) -> None:
        if self.broken or self.shut:
            return
        message = self._all_sum(encode(op, settled, fields, parts))
        if not wait:
            mx.async_eval(message)  # a failure shows at the pass's own host sync
            return
        try:
            mx.eval(message)
        except RuntimeError as err:
            raise self.lost(err) from None

    def begin(self, slot: int, held: int, capture: Sequence[int], prompt: Sequence[int]) -> None:
        self._post(BEGIN, None, [slot, held, len(prompt), len(capture)], [capture])
        mx.async_eval(self._all_sum(_int32(prompt)))

    def post_pass(self, settled: Settled | None, pending, drafts, parents) -> None:
        """`pending` is a host int or a device scalar; `drafts` a host list or a device array."""
        n = 1 + (len(drafts) if isinstance(drafts, (list, tuple)) else int(drafts.size))
        parts = [pending if isinstance(pending, mx.array) else [pending], drafts]
        if parents is not None:
            parts.append(parents)
        self._post(PASS, settled, [n, 0 if parents is None else len(parents) + 1], parts)

    def trim(self, settled: Settled | None, n: int) -> None:
        self._post(TRIM, settled, [n])

    def end(self, settled: Settled | None) -> None:
        """Sent before the caller may exit: the message must leave this process first."""
        self._post(END, settled, wait=True)

    def shutdown(self) -> None:
        """The other ranks stop following; nothing to say if they are gone already."""
        try:
            self._post(SHUTDOWN, None, wait=True)
        except DistributedError:
            pass
        self.shut = True

    def receive(self) -> Message:
        """The next message from rank 0 (a rank other than 0: waits for it)."""
        try:
            message = decode(self._all_sum(mx.zeros((CAPACITY,), dtype=mx.int32)).tolist())
            if message.op == BEGIN:
                prompt = self._all_sum(mx.zeros((message.count,), dtype=mx.int32)).tolist()
                message.tokens = tuple(prompt)
        except RuntimeError as err:
            raise self.lost(err) from None
        return message
