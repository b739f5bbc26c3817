"""Train Medusa-1 heads on a frozen MLX target (Cai et al., 2024).

Per training sequence t_0..t_{T-1} the frozen target runs once; its last layer's output after
the final norm, h_j at every position j, is what inference feeds the heads. Head i at position j
learns t_{j+2+i} (labels: the text's tokens, or with labels="target" the target's teacher-forced
greedy choices), by cross-entropy weighted 0.8^i (the paper's λ_i), on positions whose label is
an answer token. Heads start as the identity (blocks zero: they rank like the target's head),
so training only improves on "predict the next token again".

The projection: by default each head shares the target's LM head, frozen (the reference's
"version 2" heads: the checkpoint holds only the blocks, 2.6 MB for SmolLM2 instead of 340), so a
step trains 0.33M parameters a head and computes logits for the loss vocabulary's rows only.
With `own_projection` each head also trains a projection of its own, started from the target's
head; with a loss vocabulary only its rows train, and the checkpoint's projection is the
target's head with those rows replaced (the published Medusa-1 layout either way).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..drafters.medusa import MedusaDrafter
from ..backends import backend_named
from ..backends.mlx.hidden_states import decoder_layers
from ..models.medusa import WEIGHTS, MedusaHeads, parameter_name, published_weights
from ..backends.mlx.target_parts import target_head, target_sizes
from .features import features_batch, head_weight, raw_features_of
from .eagle3_trainer import answer_labels, label_map_of
from .run import (
    MLXTraining,
    Recipe,
    RunSettings,
    TrainResult,
    predictions_ahead,
    train,
    write_checkpoint_files,
)

NUM_HEADS = 3
HEAD_DECAY = 0.8  # the Medusa paper's λ_i = 0.8^i


class LossHead:
    """The frozen target head restricted to the loss vocabulary's rows (all rows without one)."""

    def __init__(self, target, loss_ids):
        weight = head_weight(target_head(target))
        if loss_ids is not None:
            weight = weight[mx.array(loss_ids, dtype=mx.int32)]
        self.weight = mx.stop_gradient(weight.astype(mx.float32))
        mx.eval(self.weight)

    def __call__(self, hidden):
        return hidden @ self.weight.T


class MLXMedusaTraining(MLXTraining):
    """Medusa-1's training math on MLX: target features, and one sequence's loss over heads."""

    def __init__(self, target, config: dict, weights: dict, *, schedule, weight_decay, grad_clip,
                 loss_ids, inv_scale, labels="text", feature_pass=None):
        self.target, self.grad_clip, self.feature_pass = target, grad_clip, feature_pass
        self.target_labels = labels == "target"
        self.layers = [len(decoder_layers(target)) - 1]
        _, vocab, _ = target_sizes(target)
        self.model = training_heads(config, target, loss_ids)
        self.model.load_weights(list(weights.items()))
        if not config["own_projection"]:
            self.model.use_target_head(LossHead(target, loss_ids))
        mx.eval(self.model.parameters())
        self.label_map = label_map_of(loss_ids, vocab) if loss_ids is not None else None
        self.init_optimizer(schedule, weight_decay)

    def features_batch(self, sequences: list[list[int]]) -> list[tuple]:
        return features_batch(self.target, sequences, self.layers, None, self.target_labels,
                              self.feature_pass)

    def sequence_loss(self, features, tokens, prompt_len):
        hidden, labels = features
        return heads_loss(self.model, hidden, mx.array(tokens, dtype=mx.int32), prompt_len,
                          label_map=self.label_map, labels=labels)


def heads_loss(model: MedusaHeads, hidden, tokens, prompt_len: int, *, label_map=None,
               labels=None, decay: float = HEAD_DECAY):
    """(sum of weighted CE, sum of weights, correct head-0 predictions) for one sequence:
    head i at position j against the label of position j + 2 + i."""
    T = tokens.shape[0]
    labels = tokens if labels is None else labels
    total = weight = correct = 0
    for i in range(model.num_heads):
        at = mx.arange(T) + 2 + i
        y, valid = answer_labels(labels, at, prompt_len, label_map)
        logits = model.head(i, hidden).astype(mx.float32)
        w = valid.astype(mx.float32) * decay**i
        total = total + (nn.losses.cross_entropy(logits, y, reduction="none") * w).sum()
        weight = weight + w.sum()
        if i == 0:
            correct = ((mx.argmax(logits, axis=-1) == y) & valid).sum()
    return total, weight, correct


def training_heads(config: dict, target, loss_ids) -> MedusaHeads:
    """Heads shaped as training holds them: projections (if own) over the loss vocabulary."""
    hidden, vocab, _ = target_sizes(target)
    return MedusaHeads(config["medusa_num_heads"], config["medusa_num_layers"], hidden,
                       len(loss_ids) if loss_ids is not None else vocab, config["own_projection"])


def export_weights(weights: dict, config: dict, target, loss_ids) -> dict[str, mx.array]:
    """Published tensors (unprefixed, as the reference's training saves its head list): the
    blocks, and with own projections each one full-size, the target's head outside the loss
    vocabulary's rows."""
    heads = training_heads(config, target, loss_ids)
    heads.load_weights(list(weights.items()))
    widen = config["own_projection"] and loss_ids is not None
    if widen:
        rows = mx.array(loss_ids, dtype=mx.int32)
        full = head_weight(target_head(target))
    out = {}
    for name, value in published_weights(heads).items():
        name = name.removeprefix("medusa_head.")
        if widen and name.endswith(f".{heads.num_layers}.weight"):
            head = full.astype(value.dtype)
            value = head.at[rows].add(value - head[rows])
        out[name] = value
    return out


class MedusaRecipe(Recipe):
    """Medusa-1 heads on the frozen target; see the module docstring."""

    name = "medusa"
    state_keys = ("num_heads", "num_layers", "own_projection")

    def __init__(self, *, num_heads: int | None = None, num_layers: int | None = None,
                 own_projection: bool | None = None, feature_pass=None):
        for name, value, least in (("num_heads", num_heads, 1), ("num_layers", num_layers, 1)):
            if value is not None and value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        self.num_heads, self.num_layers = num_heads, num_layers
        self.own_projection, self.feature_pass = own_projection, feature_pass

    def config(self, target, tokenizer, run, loss_ids):
        self.num_heads = self.num_heads or NUM_HEADS
        self.num_layers = self.num_layers or 1
        self.own_projection = bool(self.own_projection)
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "base_model_name_or_path": ""}  # as the reference's MedusaConfig writes it

    def feature_layers(self, config, target):
        return [len(decoder_layers(target)) - 1]

    def fresh_weights(self, config, target, loss_ids):
        """Blocks zero (each head starts as the identity); own projections start as the
        target's head rows."""
        heads = training_heads(self.settings(config), target, loss_ids)
        weights = {k: mx.zeros_like(v) for k, v in tree_flatten(heads.parameters())}
        if self.own_projection:
            head = head_weight(target_head(target)).astype(mx.float32)
            if loss_ids is not None:
                head = head[mx.array(loss_ids, dtype=mx.int32)]
            for i in range(config["medusa_num_heads"]):
                weights[f"heads.{i}.projection.weight"] = head
        return weights

    def settings(self, config: dict) -> dict:
        """The config with what the published one leaves out: whether heads own projections."""
        return {**config, "own_projection": bool(self.own_projection)}

    def math(self, target, config, weights, **options):
        self.target = target  # write() fills own projections' untrained rows from its head
        return MLXMedusaTraining(target, self.settings(config), weights,
                                 feature_pass=self.feature_pass, **options)

    def example(self, rng, tokens, prompt_len):
        return predictions_ahead(tokens, prompt_len, self.num_heads)

    def write(self, out, config, weights, inv_scale, loss_ids):
        tensors = export_weights(weights, self.settings(config), self.target, loss_ids)
        write_checkpoint_files(out, config, tensors, weights_file=WEIGHTS)

    def drafter(self, config, weights, inv_scale, target, loss_ids):
        hidden, vocab, _ = target_sizes(target)
        tensors = export_weights(weights, self.settings(config), target, loss_ids)
        heads = MedusaHeads(config["medusa_num_heads"], config["medusa_num_layers"], hidden,
                            vocab, bool(self.own_projection))
        heads.load_weights([(parameter_name("medusa_head." + k, heads.num_layers), v)
                            for k, v in tensors.items()])
        if not self.own_projection:
            heads.use_target_head(target_head(target))
        return MedusaDrafter(heads, target)

    def eval_draft(self, config):
        return config["medusa_num_heads"]


def train_medusa(target, prompts, out, *, tokenizer=None, num_heads: int | None = None,
                 num_layers: int | None = None, own_projection: bool | None = None,
                 feature_pass=None, **run_options) -> TrainResult:
    """Train (or with `resume`, continue) Medusa-1 heads for the MLX `target`; the checkpoint in
    `out` (config.json + medusa_lm_head.safetensors) loads with `load_drafter("medusa", out,
    model=target)`.

    `num_heads`: heads (default 3; head i drafts the token i+2 ahead); `num_layers`: residual
    blocks per head (1); `own_projection`: each head trains its own projection (Medusa-1's)
    instead of sharing the target's frozen head (the default, cheaper on a CPU). `loss_vocab`
    (a `RunSettings` option, as steps, lr, resume, minutes, ...): the loss's vocabulary, the N
    most frequent answer tokens. `feature_pass`: the frozen target's hidden states from
    elsewhere than the MLX target (the torch backend's `TorchTraining(target).features`).
    """
    recipe = MedusaRecipe(num_heads=num_heads, num_layers=num_layers,
                          own_projection=own_projection, feature_pass=feature_pass)
    run = RunSettings(out=out, prompts=prompts, tokenizer=tokenizer, normalize_features=False,
                      **run_options)
    if backend_named(run.backend).training is not None:  # steps of its own, not these MLX ones
        raise ValueError("Medusa training runs on the MLX backend only")
    raw_features = raw_features_of(feature_pass) if feature_pass is not None else None
    return train(recipe, target, run, raw_features=raw_features)
