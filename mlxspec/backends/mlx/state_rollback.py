"""Rejected drafts taken out of recurrent states, for one sequence (MLXTarget) and for the rows of
a batch (MLXBatchTarget) alike.

A pass with drafts records, for each recurrent state, the mixer call that updated it (the
module, its input, its cache, its other arguments: hidden_states.record_inputs; the mixers are
found per layer, target.state_mixers) and, where the recurrence runs position by position
anyway, every position's state (state_tape). Rolling back puts each state
back to its snapshot from before the pass and advances it over the kept positions only: from the
tape (each row's state at its last kept position), or by calling the mixer again on the kept
inputs. A lone sequence runs its kept prefix; rows of a batch stop at their own lengths through
the cache's `lengths` and mask, or run one by one where the mixer cannot stop them
(hidden_states.stops_rows), or take their last kept position's projections (baichuan_m1's
state: stop_at_last_position). Nothing here is computed until the next pass is.
"""

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from ...rollback import leaves, recurrent_layers, restore
from .hidden_states import replay, run_rows, stops_rows
from .state_tape import select


def matched_replays(calls: list, recurrent: list,
                    last_position: frozenset = frozenset()) -> list | None:
    """The recorded calls (module, input, cache, other arguments) that updated the `recurrent`
    states, one per state (a CacheList's members counted as its states); None when they do not
    account for every state exactly once (a mixer mlxspec does not find) or when one received
    keys and values beside its states, which a replay would write again (baichuan_m1's
    attention, unless among the `last_position` ones: ids)."""
    wanted = {id(c) for c in recurrent}
    replays = [call for call in calls
               if any(id(s) in wanted for s in recurrent_layers([call[2]]))]
    if sorted(id(s) for call in replays for s in recurrent_layers([call[2]])) != sorted(wanted):
        return None
    if any(id(module) not in last_position and not _states_only(c)
           for module, _, c, _ in replays):
        return None
    return replays


def _states_only(cache) -> bool:
    """Whether a mixer's cache holds recurrent states and nothing else."""
    return all(isinstance(leaf, ArraysCache) for leaf in leaves(cache))


def roll_back_states(recurrent: list, states: list, replays: list, tape: dict,
                     keeps: list[int], last_position: frozenset = frozenset()) -> None:
    """Put the `recurrent` states back to `states` (their snapshot before the pass) and advance
    row i's over its first keeps[i] positions of the pass (one row: a lone sequence) by
    `replays` (matched_replays), `tape` (state_tape's, by module id) or, for the modules in
    `last_position` (ids), the last kept position's projections."""
    restore(recurrent, states)
    alone = len(keeps) == 1
    for module, x, c, extra in replays:
        if id(module) in last_position:
            stop_at_last_position(module, x, c, keeps)
        elif id(module) in tape:
            if alone:
                select(c, *tape[id(module)], keeps[0])
            else:
                select_rows(c, *tape[id(module)], mx.array(keeps, dtype=mx.int32))
        elif alone:  # a lone sequence: the mixer again over its kept prefix
            replay(module, x[:, : keeps[0]], c, **_prefix(extra, keeps[0], x.shape[1]))
        elif stops_rows(module):  # each row stopped at its length by the mask and lengths
            c.prepare(lengths=keeps)
            replay(module, x, c, c.make_mask(x.shape[1]), **extra)
            c.finalize()
        else:  # a mixer that cannot stop rows (Jamba's, Mamba's, nemotron_h's): row by row
            run_rows(module, x, c, keeps, extra)


def _prefix(extra: dict, n: int, width: int) -> dict:
    """A lone sequence's recorded arguments for its first n positions: those that run along
    the pass's `width` positions cut to n, the rest (a RoPE offset) as they were."""
    return {k: v[:, :n] if isinstance(v, mx.array) and v.ndim > 1 and v.shape[1] == width
            else v for k, v in extra.items()}


def select_rows(cache, conv_input: mx.array, states: list, keep: mx.array) -> None:
    """state_tape.select per row: row i's recurrent state after keep[i] positions of the pass
    and its convolution window ending there."""
    width = conv_input.shape[1] - len(states)
    window = (keep[:, None] + mx.arange(width))[..., None]  # (rows, width, 1)
    conv = mx.take_along_axis(conv_input, window, axis=1)
    tape = mx.stack(states, axis=1)  # (rows, S, ...)
    at = (keep - 1).reshape((-1,) + (1,) * (tape.ndim - 1))
    cache.cache = [mx.contiguous(conv), mx.take_along_axis(tape, at, axis=1)[:, 0]]


def stop_at_last_position(module, x: mx.array, cache: CacheList, lengths: list[int],
                          before: list | None = None) -> None:
    """Put each row of the states in `cache` (a CacheList that `module`, a last-position mixer,
    updated on x (B, L, ...)) to what the module leaves after the row's first lengths[i]
    inputs: the module run again on that row's input at lengths[i] - 1 alone, into scratch
    caches (its keys and values go nowhere, its output is never read); a row of length 0 keeps
    `before`, the states before the call (per state member, its arrays; None arrays: zeros,
    as the module reads a missing state)."""
    at = mx.array([max(n - 1, 0) for n in lengths], dtype=mx.int32)
    last = mx.take_along_axis(x, at.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)
    scratch = CacheList(*(ArraysCache(len(m.cache)) if isinstance(m, ArraysCache) else KVCache()
                          for m in cache.caches))
    module(last, None, scratch)
    states = [(m, s) for m, s in zip(cache.caches, scratch.caches) if isinstance(m, ArraysCache)]
    idle = [n == 0 for n in lengths]  # rows given no input: their states stay
    for k, (state, new) in enumerate(states):
        if before is None or not any(idle):
            state.cache = list(new.cache)
            continue
        stay = mx.array(idle)
        state.cache = [mx.where(stay.reshape((-1,) + (1,) * (n.ndim - 1)),
                                mx.zeros_like(n) if old is None else old, n)
                       for old, n in zip(before[k], new.cache)]
