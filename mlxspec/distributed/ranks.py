"""The two roles over a split target: rank 0 runs the shared loop with a target that posts each
step's work first (LeaderTarget, opened and closed by `leading`); every other rank runs that work
as it arrives (Follower, `follow_generation`).

The loop itself is unchanged: to it, rank 0's target is a Target like any other. The followers
hold their own layers' caches and cut them exactly as rank 0 cuts its own, so every rank's cache
holds the same positions after every step.
"""

from collections import OrderedDict
from contextlib import contextmanager
from functools import partial
from itertools import count

import mlx.core as mx
from ..backends.mlx.window_cache import make_cache

from ..backends.mlx.target import MLXTarget, cache_offset, stage_of
from ..engine import Draft, Pass, Verdict
from ..sampling import SamplingConfig
from .link import BEGIN, END, PASS, SHUTDOWN, TRIM, DistributedError, Link, Settled
from .stage import Share

_slots = count(1)


def cache_slot(prompt_cache) -> int:
    """The number the other ranks know a kept cache (chat's, a server pool's) by; 0 for none."""
    if prompt_cache is None:
        return 0
    if "distributed_slot" not in vars(prompt_cache):
        prompt_cache.distributed_slot = next(_slots)
    return prompt_cache.distributed_slot


class LeaderTarget:
    """Rank 0's target: the wrapped MLXTarget, each pass and cut posted to the other ranks before
    it is queued here."""

    def __init__(self, inner, link: Link, slot: int = 0):
        self.inner, self.link, self.slot = inner, link, slot
        self.context_length = inner.context_length
        self._settled = None  # the last pass's outcome, posted with the next message

    def prefill(self, tokens):
        self.link.begin(self.slot, self.inner.offset, self.inner.capture_layers, tokens)
        return self.inner.prefill(tokens)

    def _take_settled(self):
        settled, self._settled = self._settled, None
        return settled

    def launch(self, pending: "int | Pass", draft: Draft, sampling: SamplingConfig,
               logprobs: int | None = None) -> Pass:
        head = pending.next_token if isinstance(pending, Pass) else pending
        self.link.post_pass(self._take_settled(), head, draft.tokens, draft.parents)
        return self.inner.launch(pending, draft, sampling, logprobs)  # rank 0 holds the logits

    def settle(self, verdict: Verdict) -> None:
        if verdict.draft_tokens:  # a plain pass's outcome cuts nothing
            branch = None if verdict.branch is None else tuple(verdict.branch)
            self._settled = Settled(len(verdict.draft_tokens), verdict.accepted, branch)
        self.inner.settle(verdict)

    def trim(self, n: int) -> None:
        self.link.trim(self._take_settled(), n)
        self.inner.trim(n)

    def finish(self) -> None:
        """The generation is over: the other ranks keep their caches as this one's stands."""
        self.link.end(self._take_settled())

    def holds_trees(self) -> bool:
        return self.inner.holds_trees()

    def rollback_room(self):
        return self.inner.rollback_room()


class Follower:
    """A rank other than 0: runs its share of each pass rank 0 posts. Caches kept across
    generations (chat turns, a server's pool) are kept here too, by rank 0's slot number."""

    def __init__(self, model, link: Link, kept: int = 8):
        self.model, self.link, self.kept = model, link, kept
        self.caches: OrderedDict[int, list] = OrderedDict()

    def serve(self) -> None:
        """Follow generations until rank 0 shuts down (the CLI's other ranks)."""
        while self.follow():
            pass

    def follow(self) -> bool:
        """Follow one generation, from its BEGIN to its END; False at SHUTDOWN."""
        message = self.link.receive()
        if message.op in (SHUTDOWN, END):  # END: rank 0 failed before it began
            return message.op == END
        if message.op != BEGIN:
            raise DistributedError(f"rank {self.link.rank}: expected a new generation, got "
                                   f"message {message.op}")
        share = Share(stage_of(self.model))
        target = MLXTarget(self.model, capture_layers=message.capture, speculative=True,
                           cache=self._cache(message.slot, message.held), forward=share)
        target.prefill(list(message.tokens), held=message.held)
        while True:
            message = self.link.receive()
            if message.settled is not None:
                s = message.settled
                target.settle(Verdict(draft_tokens=[0] * s.num_draft, accepted=s.accepted,
                                      next_token=0, branch=None if s.branch is None
                                      else list(s.branch)))
            if message.op == PASS:
                target.run_pass(list(message.tokens), message.parents)
                mx.async_eval(share.output)  # its logits are never computed here
            elif message.op == TRIM:
                target.trim(message.count)
            elif message.op == END:
                return True
            else:
                raise DistributedError(f"rank {self.link.rank}: unexpected message "
                                       f"{message.op} inside a generation")

    def _cache(self, slot: int, held: int) -> list:
        """Slot's kept cache cut back to the `held` positions rank 0 kept, or a fresh one."""
        cache = self.caches.get(slot) if held else None
        if held and cache is None:  # never prefill on top of positions this rank lacks
            raise DistributedError(f"rank {self.link.rank}: rank 0 continues a kept cache "
                                   f"(slot {slot}) this rank no longer keeps; keep at most "
                                   f"{self.kept} caches on rank 0")
        if cache is None:
            cache = make_cache(self.model)
        else:
            extra = (cache_offset(cache) or 0) - held
            if extra > 0:  # rank 0 cut its cache: it can be cut (a recurrent one is kept whole)
                for c in cache:
                    c.trim(extra)
        if slot:
            self.caches[slot] = cache
            self.caches.move_to_end(slot)
            while len(self.caches) > self.kept:
                self.caches.popitem(last=False)
        return cache


def follower(model) -> Follower:
    """The Follower of a split model on a rank other than 0 (one per model)."""
    stage = stage_of(model)
    if stage.follower is None:
        stage.follower = Follower(model, stage.link)
    return stage.follower


def follow_generation(model) -> bool:
    """On a rank other than 0 of a split target: run this generation's share of the passes rank
    0 posts (rank 0 drafts, decides and yields the output) and return True; False elsewhere."""
    stage = stage_of(model)
    if stage is None or stage.leads:
        return False
    follower(model).follow()
    return True


@contextmanager
def leading(model, make_target, open_session):
    """The session `open_session(make_target)` opens for one generation on `model` (an object
    with the `target` it runs on and the `kept` cache that target continues, or None).

    On rank 0 of a split target, the target runs this rank's share of each pass and posts each
    pass to the other ranks before queuing it; they end the generation with this one, however
    it ends (a failure to open the session too), keeping their caches as this one's stand; an
    error of MLX's distributed backends (a rank lost) is said as a DistributedError."""
    stage = stage_of(model)
    if stage is None:
        yield open_session(make_target)
        return
    try:
        session = open_session(partial(make_target, forward=Share(stage)))
    except BaseException:
        stage.link.end(None)
        raise
    session.target = leader = LeaderTarget(session.target, stage.link, cache_slot(session.kept))
    try:
        yield session
    except RuntimeError as err:
        if isinstance(err, DistributedError):
            raise
        raise stage.link.lost(err) from None
    finally:
        leader.finish()
