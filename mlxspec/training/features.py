"""The frozen target's side of training, shared by every trainer: the features a drafter is
conditioned on, the labels the target would predict, and its LM head's weight.

Features come from the MLX target, or from a feature pass the caller hands the trainer (the
torch backend's `TorchTraining.features`: one padded pass, ~4x faster on a Linux CPU). A
feature pass is `(sequences, layer_ids, *, predictions) -> (features, predictions or None)`:
per sequence, the (L, len(ids)*H) outputs of `layer_ids` as host arrays (the last target
layer's after the final norm) and, when asked, the (L,) greedy next-token predictions.
"""

import mlx.core as mx
import numpy as np

from ..backends.mlx.hidden_states import capture_layer_outputs, concat_features, decoder_layers
from ..backends.mlx.target_parts import target_final_norm, target_inner


def target_features(target, tokens, layer_ids, *, predictions: bool = False):
    """(L, len(ids)*H) outputs of `layer_ids` for the whole sequence, as the inference path sees
    them (the last target layer's output after the final norm). Layers past the deepest id and
    the LM head are not run, unless `predictions`: then the whole target runs and the result is
    (features, (L,) greedy next-token predictions)."""
    inner = target_inner(target)
    layers = decoder_layers(target)
    deepest = max(layer_ids)
    inputs = mx.array(tokens, dtype=mx.int32)[None]
    own_list = getattr(inner, "layers", None) is layers
    predicted = None
    with capture_layer_outputs(target, layer_ids) as outputs:
        if predictions:
            predicted = mx.argmax(target(inputs)[0], axis=-1)
        elif own_list:
            inner.layers = layers[: deepest + 1]  # stop after the deepest captured layer
            try:
                inner(inputs)
            finally:
                inner.layers = layers
        else:
            target(inputs)
    features = concat_features(outputs)[0]
    last = len(layers) - 1
    if last in layer_ids:
        H = features.shape[-1] // len(layer_ids)
        norm = target_final_norm(target)
        parts = [features[:, i * H : (i + 1) * H] for i in range(len(layer_ids))]
        parts = [norm(p) if l == last else p for p, l in zip(parts, layer_ids)]
        features = mx.concatenate(parts, axis=-1)
    features = mx.stop_gradient(features)
    return (features, predicted) if predictions else features


def shifted_labels(tokens: list[int], predicted) -> list[int]:
    """Labels by position from next-token predictions: position j's label is the prediction made
    at j-1 (position 0 keeps its token; it is never a label)."""
    return [int(tokens[0])] + [int(t) for t in np.asarray(predicted).tolist()[: len(tokens) - 1]]


def sequence_features(target, tokens: list[int], layer_ids, inv_scale, target_labels: bool):
    """(scaled features, labels by position): with `target_labels` the target's teacher-forced
    greedy predictions, else None (the tokens themselves)."""
    labels = None
    if target_labels:
        feats, predicted = target_features(target, tokens, layer_ids, predictions=True)
        labels = mx.array(shifted_labels(tokens, predicted), dtype=mx.int32)
    else:
        feats = target_features(target, tokens, layer_ids)
    return (feats * inv_scale if inv_scale is not None else feats), labels


def features_batch(target, sequences: list[list[int]], layer_ids, inv_scale, target_labels: bool,
                   feature_pass=None) -> list[tuple]:
    """sequence_features of each sequence, from the MLX target or, given one, from
    `feature_pass` (see the module docstring)."""
    if feature_pass is None:
        return [sequence_features(target, tokens, layer_ids, inv_scale, target_labels)
                for tokens in sequences]
    feats, predicted = feature_pass(sequences, layer_ids, predictions=target_labels)
    out = []
    for b, tokens in enumerate(sequences):
        f = mx.array(feats[b])
        labels = None if predicted is None else mx.array(
            shifted_labels(tokens, predicted[b]), dtype=mx.int32)
        out.append((f * inv_scale if inv_scale is not None else f, labels))
    return out


def raw_features_of(feature_pass):
    """`train`'s raw_features from a feature pass: the feature scale is then measured on the
    features the training steps will see."""
    return lambda tokens, layers: mx.array(feature_pass([tokens], layers)[0][0])


def head_weight(head) -> mx.array:
    """(V, H) weight of an LM head module or of a tied embedding's `as_linear` (dequantized)."""
    module = getattr(head, "__self__", head)
    if hasattr(module, "scales"):
        return mx.dequantize(module.weight, module.scales, module.get("biases"),
                             group_size=module.group_size, bits=module.bits)
    return module.weight
