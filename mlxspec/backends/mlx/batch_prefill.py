"""Rows on their way into a batch (issue #39): their prompts prefilled together, in chunks, so
the rows already generating get a step between two chunks instead of waiting out a long prompt.

Joining rows live in batch caches of their own (mlx-lm's BatchKVCache and batch ArraysCache,
merged from each row's start: fresh caches, or a kept prompt cache holding a prefix of its
prompt). A chunk runs every joining row's next tokens through the model in one pass,
right-padded to the chunk's width; a row whose prompt ends inside the chunk (or before it: a
length of 0) is rolled right by its padding (attention) or stopped at its length (recurrent
layers), mlx-lm's own path after a right-padded prefill, and is then ready: it leaves these
caches for the running batch.
"""

import copy
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList

from .hidden_states import (capture_layer_outputs, concat_features, decoder_layers,
                            instance_attributes, rows_to_their_lengths)
from .batch_adapters import rows_at_their_positions
from .state_rollback import stop_at_last_position
from .target import state_mixers


class JoiningRows:
    """Prompts being prefilled, by ticket, in the order they were added."""

    def __init__(self, model, capture_layers: tuple, step_size: int = 2048,
                 mixers: list | None = None, last_position: list | None = None):
        self.model, self.capture_layers = model, capture_layers
        self.step_size = step_size  # the widest chunk, whatever the budget (memory)
        self.cache = None  # batch caches, one per layer; None while no row joins
        self.tickets: list[int] = []
        self.bodies: list[list[int]] = []  # per row: the tokens still to prefill
        self.features: list[list] = []  # per row: its captured feature chunks so far
        # Recurrent mixers, so that those that cannot stop rows (Jamba's, Mamba's) stop each
        # row of a right-padded chunk at its length too (hidden_states.rows_to_their_lengths),
        # and the last-position ones (baichuan_m1's) keep each row's own last position.
        self.mixers = state_mixers(model) if mixers is None else mixers
        self.last_position = last_position_mixers(model) if last_position is None \
            else last_position

    def __len__(self) -> int:
        return len(self.tickets)

    def add(self, tickets: list[int], bodies: list[list[int]], starts: list[list],
            features: list | None = None, forgotten: list[list[int]] | None = None) -> None:
        """Rows to prefill `bodies` on top of `starts` (per row, its single-row caches), with
        the features of what those hold (per row, or None) to put before the bodies';
        forgotten[i][layer]: positions before what row i's cache of that layer holds (a
        sliding window's), which its RoPE positions count."""
        cache = [type(cs[0]).merge(list(cs)) for cs in zip(*starts)]
        for layer, c in enumerate(cache):
            if forgotten:
                _shift(c, [row[layer] for row in forgotten])
        if self.cache is None:
            self.cache = cache
        else:
            for joining, new in zip(self.cache, cache):
                joining.extend(new)
        self.tickets += tickets
        self.bodies += [list(b) for b in bodies]
        self.features += [[f] if f is not None and f.shape[0] else []
                          for f in features or [None] * len(bodies)]

    def step(self, budget: int | None) -> tuple[list[int], list | None, list | None]:
        """Prefill up to about `budget` tokens (None: every row to its end) in chunks; returns
        the rows now ready, in the order they were added: their tickets, their batch caches
        (None when none is ready) and their features (n_i, H*layers) (None without capture
        layers); the rest stay."""
        spent = 0
        while any(self.bodies) and (budget is None or spent < budget):
            spent += self._chunk(None if budget is None else budget - spent)
        return self._split([i for i, body in enumerate(self.bodies) if not body])

    def _chunk(self, budget: int | None) -> int:
        """One pass over every row's next tokens, `budget` (None: all) shared between rows;
        returns the tokens it ran, padding included."""
        rows, longest = len(self.bodies), max(len(b) for b in self.bodies)
        width = min(longest, self.step_size if budget is None else max(1, budget // rows))
        lengths = [min(len(b), width) for b in self.bodies]
        padding = [width - n for n in lengths]
        if max(padding):
            for c in self.cache:
                c.prepare(lengths=lengths, right_padding=padding)
        tokens = mx.array([b[:n] + [0] * p for b, n, p in zip(self.bodies, lengths, padding)],
                          dtype=mx.int32)
        with (capture_layer_outputs(self.model, self.capture_layers) as hidden,
              rows_to_their_lengths(self.mixers if max(padding) else []),
              rows_stop_at_their_lengths(self.last_position if max(padding) else []),
              rows_at_their_positions(self.model, self.cache) as cache):
            self.model(tokens, cache=cache)
        features = concat_features(hidden) if hidden else None
        for c in self.cache:  # also clears the ArraysCache padding merge() sets
            _finalize(c)
        mx.eval([c.state for c in self.cache] + ([features] if features is not None else []))
        mx.clear_cache()
        for i, n in enumerate(lengths):
            self.bodies[i] = self.bodies[i][n:]
            if features is not None:
                self.features[i].append(features[i, :n])
        return rows * width

    def _split(self, ready: list[int]) -> tuple[list[int], list | None, list | None]:
        if not ready:
            return [], None, None
        keep = [i for i in range(len(self.tickets)) if i not in set(ready)]
        done = mx.array(ready, dtype=mx.int32)
        cache = []
        for c in self.cache:  # filter() rebinds its arrays: a shallow copy leaves c whole
            part = _shallow_copy(c)
            part.filter(done)
            part.finalize()  # an ArraysCache merged from fresh ones still holds padding
            cache.append(part)
        tickets = [self.tickets[i] for i in ready]
        features = [self._features(i) for i in ready] if self.capture_layers else None
        self._keep(keep)
        return tickets, cache, features

    def _keep(self, keep: list[int]) -> None:
        """Only these joining rows stay, in their order."""
        self.cache = keep_rows(self.cache, keep)
        self.tickets = [self.tickets[i] for i in keep]
        self.bodies = [self.bodies[i] for i in keep]
        self.features = [self.features[i] for i in keep]

    def _features(self, i: int) -> mx.array:
        chunks = [f for f in self.features[i] if f.shape[0]]
        return mx.concatenate(chunks, axis=0) if chunks else mx.zeros((0, 0))

    def drop(self, ticket: int) -> None:
        """A joining row leaves before it is ready (its client is gone)."""
        i = self.tickets.index(ticket)
        self._keep([j for j in range(len(self.tickets)) if j != i])


def _shift(cache, forgotten: list) -> None:
    """Count forgotten[i] more positions before what row i of a layer's batch cache holds (a
    sliding window's): its RoPE positions. For a CacheList, forgotten[i] holds its members'."""
    if isinstance(cache, CacheList):
        for k, c in enumerate(cache.caches):
            _shift(c, [row[k] for row in forgotten])
    elif any(forgotten):
        cache.offset = cache.offset + mx.array(forgotten)


def _finalize(cache) -> None:
    """mlx-lm's finalize after a right-padded chunk, except that a layer's batch cache no pass
    writes (nemotron-nas's attention replaced by a linear map keeps an unused KVCache) has no
    keys to roll right: it only forgets the padding."""
    if isinstance(cache, CacheList):
        for c in cache.caches:
            _finalize(c)
    elif isinstance(cache, BatchKVCache) and cache.keys is None:
        cache._right_padding = None
    else:
        cache.finalize()


def _shallow_copy(cache):
    """A layer's batch cache whose filter() leaves `cache` whole (a CacheList's members each
    copied: filter() rebinds their arrays)."""
    if isinstance(cache, CacheList):
        return CacheList(*(_shallow_copy(c) for c in cache.caches))
    return copy.copy(cache)


def keep_rows(cache: list, keep: list[int]) -> list | None:
    """Batch caches (one per layer) filtered in place to the rows `keep`, in that order; None
    when no row stays."""
    if not keep:
        return None
    index = mx.array(keep, dtype=mx.int32)
    for c in cache:
        c.filter(index)
    return cache


# Mixers whose recurrent state is what they compute at their input's last position, by model
# module: the decoder layer's attribute holding one. baichuan_m1's attention keeps its last
# position's key and value projections (its convolution's window of one) in the ArraysCache
# beside its keys and values, CacheList(ArraysCache, KVCache or window), whatever a batch's
# padding or its rows' lengths: each row's state is put back to what the module computes at
# the row's own last position (stop_at_last_position).
_LAST_POSITION = {"mlx_lm.models.baichuan_m1": "self_attn"}


def last_position_mixers(model) -> list[tuple[object, str]]:
    """(decoder layer, attribute) of each mixer whose state is its last position's."""
    name = _LAST_POSITION.get(type(model).__module__)
    if name is None:
        return []
    return [(layer, name) for layer in decoder_layers(model) if name in layer]


class _LastPosition:
    """A last-position mixer, during a right-padded batch pass whose caches were `prepare`d
    with each row's length (a batch's prefill): each row's state ends at its own length."""

    def __init__(self, module):
        self.module = module

    def __call__(self, x, mask=None, cache=None):
        states = [m for m in getattr(cache, "caches", ()) if isinstance(m, ArraysCache)]
        lengths = states[0].lengths if states else None
        if lengths is None:
            return self.module(x, mask, cache)
        before = [list(s.cache) for s in states]
        out = self.module(x, mask, cache)
        stop_at_last_position(self.module, x, cache, lengths.tolist(), before)
        return out

    def __getattr__(self, name):
        return getattr(self.module, name)


@contextmanager
def rows_stop_at_their_lengths(modules: list[tuple[object, str]]):
    """For one batch pass: the last-position mixers named by (owner, attribute name) leave
    each row's state at its own length (see _LastPosition)."""
    with instance_attributes([(owner, name, _LastPosition(getattr(owner, name)))
                              for owner, name in modules]):
        yield
