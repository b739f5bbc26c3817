"""Capture the outputs of chosen decoder layers of any mlx-lm model during a forward pass.

Drafters such as DFlash condition on target hidden states. Rather than copy every architecture,
the chosen entries of `model.layers` are wrapped for the duration of one call and restored in a
`finally`, so the caller's model is never left altered and plain decoding pays nothing.
"""

import inspect
from contextlib import contextmanager

import mlx.core as mx


class _Recorder:
    def __init__(self, layer, sink: dict, index: int):
        self.layer, self.sink, self.index = layer, sink, index

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.sink[self.index] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):  # models read attributes such as `use_sliding` off their layers
        return getattr(self.layer, name)


def decoder_layers(model) -> list:
    """The list of decoder layers the model's forward reads. Stored lists are looked up first:
    some models' `layers` is a property returning a copy (Qwen3-Next's and Qwen3.5's pipeline
    slice), where a wrapped entry would never be called."""
    language_model = getattr(model, "language_model", None)
    for owner in (getattr(language_model, "model", None), getattr(model, "model", None), model):
        layers = owner.get("layers") if isinstance(owner, dict) else None  # nn.Module is a dict
        if isinstance(layers, list):
            return layers
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"{type(model).__module__} has no list of decoder layers to capture from")
    return layers


@contextmanager
def capture_layer_outputs(model, layer_ids):
    """Yield a list that, after the forward pass, holds the outputs of `layer_ids` in order."""
    if not layer_ids:
        yield []
        return
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer ids {bad} out of range for a {len(layers)}-layer target")
    sink, outputs = {}, []
    originals = {i: layers[i] for i in set(layer_ids)}
    try:
        for i, layer in originals.items():
            layers[i] = _Recorder(layer, sink, i)
        yield outputs
        outputs.extend(sink[i] for i in layer_ids)
    finally:
        for i, layer in originals.items():
            layers[i] = layer


def concat_features(outputs: list) -> mx.array:
    """(B, L, H) per layer -> (B, L, H * num_layers), in layer_ids order."""
    return mx.concatenate(outputs, axis=-1)


class _InputRecorder:
    def __init__(self, module, sink: list):
        self.module, self.sink = module, sink
        self.signature = inspect.signature(module.__call__)

    def __call__(self, x, *args, **kwargs):
        cache = self.signature.bind(x, *args, **kwargs).arguments.get("cache")
        self.sink.append((self.module, x, cache))
        return self.module(x, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)


@contextmanager
def instance_attributes(values: list[tuple[object, str, object]]):
    """Set each (owner, name, value) on the owner instance for one call and remove it in a
    `finally`: attribute lookup finds it before the owner's own child module of that name, which
    shows again afterwards, so no module (nor its parameters) is ever replaced."""
    try:
        for owner, name, value in values:
            object.__setattr__(owner, name, value)
        yield
    finally:
        for owner, name, _ in values:
            if name in vars(owner):
                object.__delattr__(owner, name)


@contextmanager
def record_inputs(modules: list[tuple[object, str]]):
    """Yield a list that, after the forward pass, holds (module, input, cache) for each call of
    the modules named by (owner, attribute name), in call order; a model may keep one cache per
    layer or skip the layers that hold none (Nemotron-H's MLP blocks), so each call says which
    cache it updated."""
    calls = []
    recorders = [(owner, name, _InputRecorder(getattr(owner, name), calls))
                 for owner, name in modules]
    with instance_attributes(recorders):
        yield calls
