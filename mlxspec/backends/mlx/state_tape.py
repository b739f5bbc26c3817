"""A per-position state tape for the Gated DeltaNet layers of mlx-lm's Qwen3-Next and Qwen3.5.

During a verify pass each such layer's recurrence keeps its state after every position, and its
convolution input is kept too; a rollback then selects the state and the convolution window at
the last kept position instead of computing anything. Where the recurrence runs position by
position anyway (mlx-lm's ops path: the CPU), keeping those states costs memory only (K + 1
states per layer) and the tape beats re-running the layers (docs/benchmarks.md); where a fused
kernel runs all positions at once (Metal), splitting it per position would cost a dispatch per
position and layer, so there the rollback re-runs the layers instead.

The tape sits at two seams of mlx-lm's Gated DeltaNet: its `conv1d` module (called once with
the window of earlier inputs followed by this pass's) and the `gated_delta_update` function its
module calls, swapped for the duration of one forward pass and restored in a `finally`.
"""

import sys
from contextlib import contextmanager

import mlx.core as mx

from .hidden_states import instance_attributes

_UPDATE = "gated_delta_update"


def fused_kernel_would_run() -> bool:
    """Whether mlx-lm's gated-delta update would run its fused Metal kernel over all positions."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def tape_modules(modules: list) -> list:
    """The modules among `modules` that a tape can follow: mlx-lm Gated DeltaNet layers, which
    have a `conv1d` and whose module calls `gated_delta_update`."""
    return [m for m in modules if hasattr(m, "conv1d")
            and callable(vars(sys.modules[type(m).__module__]).get(_UPDATE))]


class _ConvRecorder:
    def __init__(self, owner, conv, events: list):
        self.owner, self.conv, self.events = owner, conv, events

    def __call__(self, x):
        self.events.append([self.owner, x, None])  # the states follow from the update
        return self.conv(x)

    def __getattr__(self, name):
        return getattr(self.conv, name)


def _per_position(update, events: list):
    def run(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
        ys, states = [], []
        for t in range(q.shape[1]):
            y, state = update(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                              a[:, t : t + 1], b[:, t : t + 1], A_log, dt_bias, state,
                              None if mask is None else mask[:, t : t + 1], **kwargs)
            ys.append(y)
            states.append(state)
        if events and events[-1][2] is None:
            events[-1][2] = states
        return mx.concatenate(ys, axis=1), state

    return run


@contextmanager
def state_tape(modules: list):
    """Yield a dict that, after the forward pass, maps each of `modules` that ran to (its
    convolution input, its state after each position)."""
    events, namespaces = [], {}
    for m in modules:
        namespace = vars(sys.modules[type(m).__module__])
        namespaces.setdefault(id(namespace), (namespace, namespace[_UPDATE]))
    tape = {}
    recorders = [(m, "conv1d", _ConvRecorder(m, m.conv1d, events)) for m in modules]
    try:
        for namespace, update in namespaces.values():
            namespace[_UPDATE] = _per_position(update, events)
        with instance_attributes(recorders):
            yield tape
        tape.update({id(owner): (x, states) for owner, x, states in events
                     if states is not None})
    finally:
        for namespace, update in namespaces.values():
            namespace[_UPDATE] = update


def select(cache, conv_input: mx.array, states: list, keep: int) -> None:
    """Set a Gated DeltaNet layer's cache to its state after `keep` of the pass's positions: the
    recurrent state recorded there and the convolution window ending there."""
    width = conv_input.shape[1] - len(states)
    cache.cache = [mx.contiguous(conv_input[:, keep : keep + width]), states[keep - 1]]
