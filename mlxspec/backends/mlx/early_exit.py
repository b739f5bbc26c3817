"""One mlx-lm model run in two halves, through its own forward: LayerSkip's draft and verify.

The early half runs layers 0..E-1 and then the model's final norm and head (layers E.. stand
aside: they return their input untouched), which is the early-exit prediction. The late half
starts at layer E from hidden states the early half already computed: layers 0..E-2 stand
aside and layer E-1 returns those states, so only layers E.. run, and the embedding, whose output
nothing reads, is never evaluated (MLX evaluates only what an output depends on). No model class
is copied: the stand-ins replace entries of the model's layer list for one call and are removed
in a `finally`, as mlxspec.backends.mlx.hidden_states' recorders are.

Each half extends only its own layers' caches. The late half is given the late layers' view of
the cache in the early slots too, so the mask the model builds from its first cache sees the
positions the late layers hold, not the early layers' (already extended) ones.
"""

from contextlib import contextmanager

import mlx.core as mx

from .hidden_states import capture_layer_outputs, decoder_layers


class _StandIn:
    """A decoder layer's stand-in for one call: returns `output`, or its input when None. Other
    attributes (a model may read `use_sliding` off a layer) are the layer's own."""

    def __init__(self, layer, output):
        self.layer, self.output = layer, output

    def __call__(self, x, *args, **kwargs):
        return x if self.output is None else self.output

    def __getattr__(self, name):
        return getattr(self.layer, name)


@contextmanager
def stand_ins(model, outputs: dict):
    """Replace layer i by a stand-in returning outputs[i] (None: its input) for one call."""
    layers = decoder_layers(model)
    originals = {i: layers[i] for i in outputs}
    try:
        for i, output in outputs.items():
            layers[i] = _StandIn(layers[i], output)
        yield
    finally:
        for i, layer in originals.items():
            layers[i] = layer


def num_layers(model) -> int:
    return len(decoder_layers(model))


def early_forward(model, tokens: mx.array, cache: list, exit_layer: int):
    """tokens (1, n) through layers 0..exit_layer-1 only, extending their caches: (the exit's
    logits (1, n, V), layer exit_layer-1's output (1, n, H))."""
    late = range(exit_layer, num_layers(model))
    with capture_layer_outputs(model, [exit_layer - 1]) as hidden, \
            stand_ins(model, dict.fromkeys(late)):
        logits = model(tokens, cache=cache)
    return logits, hidden[0]


def late_forward(model, tokens: mx.array, cache: list, exit_layer: int, hidden: mx.array):
    """The model's logits (1, n, V) for tokens (1, n) whose layer exit_layer-1 outputs are
    `hidden` (1, n, H), already in the early layers' caches: only layers exit_layer.. run."""
    view = [cache[exit_layer]] * exit_layer + list(cache[exit_layer:])
    early = {**dict.fromkeys(range(exit_layer - 1)), exit_layer - 1: hidden}
    with stand_ins(model, early):
        return model(tokens, cache=view)
