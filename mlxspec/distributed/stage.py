"""A target split across the ranks of an MLX distributed group: each rank's share of a pass.

Pipeline: rank r runs a contiguous range of decoder layers; as in mlx-lm's own pipelines, the
last rank runs the first layers and rank 0 the last ones, so rank 0 ends a pass holding the final
hidden states and computes the logits (it also runs the drafter and prints). Layers held
elsewhere are replaced, before the weights are read, by placeholders that hold no weights and
return their input; every rank keeps the embedding, final norm and head (as mlx-lm does).

Tensor parallel: mlx-lm's own `shard` splits every layer's projections across the ranks, whose
layers then all-sum their outputs; every rank runs every layer.

Either way the model class is mlx-lm's, run through its own forward: for one call the first and
last layers of a rank's range are wrapped to receive the previous rank's hidden states and send
its own on (mx.distributed.recv / send), as mlxspec.backends.mlx.hidden_states wraps layers to capture their
outputs. Features a drafter reads (DFlash, EAGLE-3) travel with the hidden states down the
pipeline, so rank 0 holds them all when the pass ends, without another round trip.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from ..backends.mlx.hidden_states import _Recorder, concat_features, decoder_layers
from ..backends.mlx.target import model_setting

SHARDINGS = ("pipeline", "tensor")


class _HeldElsewhere:
    """The placeholder of a decoder layer another rank runs: no weights; returns its input.
    Plain attributes of the layer (a model may read `use_sliding` off it) are kept."""

    def __init__(self, layer):
        self.__dict__.update({k: v for k, v in vars(layer).items()
                              if isinstance(v, (bool, int, float, str, type(None)))})

    def __call__(self, x, *args, **kwargs):
        return x


class _Receiving:
    """The first layer of a rank's range: its input is the packet the rank before sent, hidden
    states then the features gathered before it; the features go to `sink`."""

    def __init__(self, layer, stage: "Stage", upstream: list[int], sink: dict):
        self.layer, self.stage, self.upstream, self.sink = layer, stage, upstream, sink

    def __call__(self, x, *args, **kwargs):
        width = x.shape[-1] * (1 + len(self.upstream))
        packet = mx.distributed.recv((*x.shape[:-1], width), x.dtype, self.stage.rank + 1,
                                     group=self.stage.group)
        parts = mx.split(packet, 1 + len(self.upstream), axis=-1)
        self.sink.update(zip(self.upstream, parts[1:]))
        return self.layer(parts[0], *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.layer, name)


class _Sending:
    """The last layer of a rank's range: its output, then every feature gathered so far, goes to
    the rank after; what it returns depends on the send, so evaluating the pass sends."""

    def __init__(self, layer, stage: "Stage", onward: list[int], sink: dict):
        self.layer, self.stage, self.onward, self.sink = layer, stage, onward, sink

    def __call__(self, x, *args, **kwargs):
        out = self.layer(x, *args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        packet = mx.concatenate([hidden] + [self.sink[i] for i in self.onward], axis=-1)
        sent = mx.distributed.send(packet, self.stage.rank - 1, group=self.stage.group)
        return mx.depends(hidden, sent)

    def __getattr__(self, name):
        return getattr(self.layer, name)


@contextmanager
def _wrapped(layers: list, wrappers: list[tuple[int, Any]]):
    """layers[i] = wrap(layers[i]) for each (i, wrap) in order (later ones wrap earlier ones),
    for one call; restored in a `finally`."""
    originals = {i: layers[i] for i, _ in wrappers}
    try:
        for i, wrap in wrappers:
            layers[i] = wrap(layers[i])
        yield
    finally:
        for i, layer in originals.items():
            layers[i] = layer


@dataclass
class Stage:
    """This rank's share of a split target: layers start..end-1 of num_layers (all of them under
    tensor parallelism, where `pipeline` is False)."""

    group: Any
    sharding: str
    start: int
    end: int
    num_layers: int
    # Per layer, the kind of cache the whole model keeps (a hybrid mixes them), and a spare
    # cache of each kind: a layer held elsewhere is shown a cache of its own kind.
    kinds: tuple = field(default=(), repr=False)
    spares: dict = field(default_factory=dict, repr=False)
    link: Any = field(default=None, repr=False)  # rank 0's posts to the others (.link.Link)
    follower: Any = field(default=None, repr=False)  # a follower rank's runner (.ranks)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def leads(self) -> bool:
        """Rank 0 drafts, accepts, samples and prints; the others follow its passes."""
        return self.rank == 0

    @property
    def pipeline(self) -> bool:
        return self.sharding == "pipeline"

    def describe(self) -> str:
        if self.pipeline:
            return (f"pipeline over {self.size} ranks: rank {self.rank} runs layers "
                    f"{self.start}-{self.end - 1} of {self.num_layers}")
        return f"tensor parallel over {self.size} ranks"

    def full_view(self, cache: Sequence) -> list:
        """This rank's caches (one per layer it runs) as the model's per-layer list. A layer held
        elsewhere (its placeholder never touches a cache) shows the rank's first cache of the
        same kind, so a mask the model builds from any slot counts the positions this rank holds;
        a kind this rank runs no layer of shows a spare (its mask feeds no layer here)."""
        own = dict(zip(range(self.start, self.end), cache))
        first = {}
        for i, c in own.items():
            first.setdefault(self.kinds[i], c)
        return [own[i] if i in own else first.get(self.kinds[i], self.spares[self.kinds[i]])
                for i in range(self.num_layers)]

    def forward(self, model, tokens: mx.array, cache: Sequence, capture_layers: Sequence[int]):
        """This rank's share of one pass over tokens (1, n): (logits, features, output).

        logits (1, n, V) and features (1, n, H * len(capture_layers)) are rank 0's to read (on a
        pipeline's other ranks they are never computed); `output` is what this rank evaluates for
        its share to run, every send and all-sum included: the last decoder layer's output."""
        layers = decoder_layers(model)
        receives = self.pipeline and self.rank < self.size - 1
        sends = self.pipeline and self.rank > 0
        upstream = [i for i in capture_layers if i < self.start] if receives else []
        own = [i for i in capture_layers if self.start <= i < self.end]
        last = self.num_layers - 1
        sink: dict = {}
        wrappers = [(i, lambda layer, i=i: _Recorder(layer, sink, i)) for i in {*own, last}]
        if sends:
            onward = sorted(upstream + own)
            wrappers.append((self.end - 1, lambda layer: _Sending(layer, self, onward, sink)))
        if receives:
            wrappers.append((self.start, lambda layer: _Receiving(layer, self, upstream, sink)))
        with _wrapped(layers, wrappers):
            logits = model(tokens, cache=self.full_view(cache))
        features = None
        if capture_layers and not sends:
            features = concat_features([sink[i] for i in capture_layers])
        return logits, features, sink[last]


class Share:
    """This rank's forward of a split target, handed to its MLXTarget in place of the whole
    model's (backends.mlx.target.WholeModel): its share of each pass. A rank holds no whole model to run
    again, so it takes no early exit (LayerSkip refuses a split target) and re-runs nothing."""

    def __init__(self, stage: Stage):
        self.stage = stage
        self.output = None  # what this rank evaluates for its share of the last pass

    def __call__(self, model, tokens: mx.array, cache: Sequence, capture_layers: Sequence[int]):
        logits, features, self.output = self.stage.forward(model, tokens, cache, capture_layers)
        return logits, features

    def outputs(self) -> list:
        """Its sends and sums, which run only when evaluated (rank 0 reads its logits too)."""
        return [] if self.output is None else [self.output]

    def rerun(self, model, tokens: mx.array, cache: list) -> None:
        raise RuntimeError("a split target cannot re-run its kept tokens: a recurrent layer of a "
                           "kind mlxspec does not know was not recorded")


def layer_split(num_layers: int, size: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s layers (start, end) of an even split, the last layers on rank 0 and any
    extra layers on the low ranks, as mlx-lm's pipelines split."""
    base, extra = divmod(num_layers, size)
    counts = [base + (r < extra) for r in range(size)]
    start = sum(counts[rank + 1 :])
    return start, start + counts[rank]


def split_pipeline(model, group, caches: list) -> Stage:
    """Keep this rank's layers of `model` (loaded lazily: the others' weights are never read);
    `caches` are the whole model's, one per layer (mlx-lm's make_prompt_cache, checked)."""
    layers = decoder_layers(model)
    if group.size() > len(layers):
        raise ValueError(f"a pipeline over {group.size()} ranks needs at least as many layers; "
                         f"this model has {len(layers)}")
    start, end = layer_split(len(layers), group.size(), group.rank())
    for i, layer in enumerate(layers):
        if not start <= i < end:
            layers[i] = _HeldElsewhere(layer)
    kinds = tuple(type(c) for c in caches)
    stage = Stage(group, "pipeline", start, end, len(layers), kinds=kinds,
                  spares=dict(zip(kinds, caches)))
    _keep_own_caches(model, stage)
    return stage


def check_caches_per_layer(caches: list, layers: list) -> None:
    if len(caches) != len(layers):
        raise ValueError(f"a pipeline gives each rank its layers' caches, but this model keeps "
                         f"{len(caches)} caches for {len(layers)} layers (some layers keep none)")


def split_tensors(model, group, caches: list) -> Stage:
    """Split every layer's projections across the group with mlx-lm's own `shard`, after
    checking that the head counts and widths divide (mlx-lm divides without checking);
    `caches` are the whole model's."""
    if not hasattr(model, "shard"):
        raise ValueError(f"mlx-lm has no tensor-parallel sharding for "
                         f"{getattr(model, 'model_type', type(model).__module__)!r}; "
                         f"use --shard pipeline")
    n = group.size()
    sizes = {name: model_setting(model, name) for name in
             ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    uneven = {k: v for k, v in sizes.items() if isinstance(v, int) and v % n}
    if uneven:
        listed = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in uneven.items())
        raise ValueError(f"tensor parallelism over {n} ranks needs sizes it divides; this model "
                         f"has {listed}: use --shard pipeline")
    model.shard(group)
    num_layers = len(decoder_layers(model))
    kinds = tuple(type(c) for c in caches)
    return Stage(group, "tensor", 0, num_layers, num_layers, kinds=kinds,
                 spares=dict(zip(kinds, caches)))


def _keep_own_caches(model, stage: Stage) -> None:
    """mlx-lm makes a model's cache with `make_cache` where it has one: this rank's makes only
    the caches of the layers it runs (the loop trims and counts those)."""
    whole = model.make_cache if hasattr(model, "make_cache") else None

    def make_cache():
        caches = whole() if whole is not None else _default_caches(model)
        return caches[stage.start : stage.end]

    object.__setattr__(model, "make_cache", make_cache)


def _default_caches(model) -> list:
    """mlx-lm's make_prompt_cache for a model without `make_cache` (it cannot be called once the
    model has ours: it would call ours)."""
    from mlx_lm.models.cache import KVCache

    return [KVCache() for _ in decoder_layers(model)]
