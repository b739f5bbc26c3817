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


def _parameters(module) -> tuple[str, ...]:
    """The names a module's __call__ takes, its input first; read once per module class."""
    kind = type(module)
    names = _PARAMETERS.get(kind)
    if names is None:
        names = _PARAMETERS[kind] = tuple(inspect.signature(module.__call__).parameters)
    return names


_PARAMETERS: dict[type, tuple[str, ...]] = {}


def takes_mask(module) -> bool:
    """Whether a recurrent mixer takes a `mask` (Jamba's and Mamba's take (x, cache) only)."""
    return "mask" in _parameters(module)


# Recurrent mixers that take a mask but do not stop a row at its length with it: nemotron_h's
# Mamba-2 mixer hands its scan no `lengths` (mlx-lm's mamba2 and falcon_h1 do), so a row that
# ends before the pass does keeps a state read at the pass's last, masked position.
# olmo_hybrid's GatedDeltaNet masks its scan but keeps its convolutions' last columns of the pass;
# recurrent_gemma's RecurrentBlock and bailing_moe_linear's LinearAttention ignore their mask.
_IGNORE_LENGTHS = ("mlx_lm.models.nemotron_h.NemotronHMamba2Mixer",
                   "mlx_lm.models.olmo_hybrid.GatedDeltaNet",
                   "mlx_lm.models.recurrent_gemma.RecurrentBlock",
                   "mlx_lm.models.bailing_moe_linear.LinearAttention")


def stops_rows(module) -> bool:
    """Whether a recurrent mixer stops each row of a padded batch pass at its own length (the
    cache's `lengths` and mask); the others run row by row (run_rows)."""
    kind = type(module)
    return takes_mask(module) and f"{kind.__module__}.{kind.__qualname__}" not in _IGNORE_LENGTHS


def replay(module, x, cache, mask=None, **extra):
    """Call a recorded mixer again on `x` and `cache` as its own signature takes them: the input
    first, the cache by name, and `mask` only where it takes one (`extra`: its other arguments,
    by name)."""
    if takes_mask(module):
        return module(x, mask=mask, cache=cache, **extra)
    return module(x, cache=cache, **extra)


def run_rows(module, x: mx.array, cache, lengths: list[int], extra: dict | None = None,
             fresh: list[bool] | None = None):
    """Run a recurrent mixer that cannot stop rows at their own lengths (it takes no mask and
    reads no `cache.lengths`: Jamba's, Mamba's) on each row's first lengths[i] inputs alone,
    from that row's state in `cache` (a batch's ArraysCache), which ends up holding each row's
    state after its own length; `extra`: its other arguments by name, each cut to the row
    (_row_argument); fresh[i]: row i starts its sequence here, from no state (a batch holds
    zeros for it). Returns the outputs (B, L, ...) (a tuple of such where the mixer returns
    one: rwkv7's time mixing), zeros past each row's length: right padding that causal layers
    never let reach a real position."""
    outputs, states = [], []
    for i, n in enumerate(lengths):
        row = type(cache)(len(cache.cache))
        row.cache = [None if a is None or fresh and fresh[i] else a[i : i + 1]
                     for a in cache.cache]
        cut = {k: _row_argument(v, i, n, x.shape[:2]) for k, v in (extra or {}).items()}
        outputs.append(replay(module, x[i : i + 1, :n], row, **cut) if n else None)
        states.append(row.cache)
    _merge_states(cache, states)
    like = next((y for y in outputs if y is not None), None)
    if isinstance(like, tuple):
        return tuple(_padded([None if y is None else y[k] for y in outputs], x, like[k])
                     for k in range(len(like)))
    return _padded(outputs, x, x[:1, :0] if like is None else like)


def _row_argument(value, i: int, n: int, shape: tuple):
    """Row i's part of a mixer's other argument: an array over the batch's rows its row i (its
    first n positions where it runs along the pass: rwkv7's v_first), else the value itself (a
    Python offset); a mask, which only marks the padding a row alone does not have, none."""
    if not isinstance(value, mx.array) or value.ndim == 0 or value.shape[0] != shape[0]:
        return value
    if value.dtype == mx.bool_:
        return None
    return value[i : i + 1, :n] if value.ndim > 1 and value.shape[1] == shape[1] else \
        value[i : i + 1]


def _padded(outputs: list, x: mx.array, like: mx.array) -> mx.array:
    """Per-row outputs (1, n_i, ...) (None: a row given no input) as one (B, L, ...) array,
    zeros past each row's length."""
    width = x.shape[1]
    outputs = [mx.zeros((1, width) + like.shape[2:], like.dtype) if y is None else
               y if y.shape[1] == width else
               mx.concatenate([y, mx.zeros((1, width - y.shape[1]) + y.shape[2:], y.dtype)], 1)
               for y in outputs]
    return mx.concatenate(outputs)


def _merge_states(cache, states: list) -> None:
    """Rows' states (per row, its list of arrays) back into the batch's `cache`."""
    merged = []
    for parts in zip(*states):  # a row still without a state (nothing run yet) holds zeros
        ref = next((a for a in parts if a is not None), None)
        merged.append(None if ref is None else mx.concatenate(
            [mx.zeros_like(ref) if a is None else a for a in parts]))
    cache.cache = merged


class _RowByRow:
    """A mixer that cannot stop rows at their lengths (stops_rows), during a right-padded batch
    pass whose caches were `prepare`d with each row's length (a batch's prefill): it runs each
    row to its own length (run_rows)."""

    def __init__(self, module):
        self.module = module
        self.signature = inspect.signature(module.__call__)
        self.input = _parameters(module)[0]

    def __call__(self, *args, **kwargs):
        arguments = self.signature.bind(*args, **kwargs).arguments
        cache = arguments.get("cache")
        lengths = getattr(cache, "lengths", None)
        if lengths is None:
            return self.module(*args, **kwargs)
        extra = {k: v for k, v in arguments.items() if k not in (self.input, "cache", "mask")}
        return run_rows(self.module, arguments[self.input], cache, lengths.tolist(), extra)

    def __getattr__(self, name):
        return getattr(self.module, name)


@contextmanager
def rows_to_their_lengths(modules: list[tuple[object, str]]):
    """For one batch pass: the mixers named by (owner, attribute name) that cannot stop each
    row at its length (stops_rows) run row by row (see _RowByRow); the others already do."""
    wrapped = [(owner, name, _RowByRow(getattr(owner, name))) for owner, name in modules
               if not stops_rows(getattr(owner, name))]
    with instance_attributes(wrapped):
        yield


class _InputRecorder:
    def __init__(self, module, sink: list):
        self.module, self.sink = module, sink
        self.signature = inspect.signature(module.__call__)
        self.input = _parameters(module)[0]

    def __call__(self, *args, **kwargs):
        # Models pass the input by position or by name (falcon_h1's `input_states=`, plamo2's
        # `hidden_states=`).
        arguments = self.signature.bind(*args, **kwargs).arguments
        extra = {k: v for k, v in arguments.items() if k not in (self.input, "cache", "mask")}
        self.sink.append((self.module, arguments[self.input], arguments.get("cache"), extra))
        return self.module(*args, **kwargs)

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
    """Yield a list that, after the forward pass, holds (module, input, cache, its other
    arguments by name: bailing_hybrid's RoPE `offset`) for each call of the modules named by
    (owner, attribute name), in call order; a model may keep one cache per layer or skip the
    layers that hold none (Nemotron-H's MLP blocks), so each call says which cache it updated."""
    calls = []
    recorders = [(owner, name, _InputRecorder(getattr(owner, name), calls))
                 for owner, name in modules]
    with instance_attributes(recorders):
        yield calls
