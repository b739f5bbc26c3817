"""Train a DFlash2 drafter (models.dflash2) for a frozen MLX target: DFlash's recipe
(dflash_trainer: anchors in the answer, blocks [token[a], MASK, ...], slot weights
exp(-(k-1)/gamma), the target's frozen embedding and head) plus the candidate selector's loss.

z-lab publishes no DFlash2 training code; this follows the one public recipe, vLLM's speculators
(PR #1006, `dflash2/metrics.py`): the unary DFlash loss, plus `selector_weight` times a K-way
cross-entropy over each slot's top-k unary candidates (the set the walk serves from), scored
with the true previous token as predecessor (teacher forcing; the anchor for slot 1). Where the
label is not among the candidates it takes the place of one, in the loss only, so every slot has
a label. Same slot weights as the unary loss.

Starts: the convolutions as the identity (tap 0 of both kernels one, the rest and the tap
projections zero) and the successor codebook zero, so a fresh DFlash2 drafts exactly as its
DFlash backbone would and the pair scores grow from there; with `init` a DFlash checkpoint (the
shipped drafter, say), that backbone is the trained one. DFlash2 drafts over the full vocabulary
(its codebooks are indexed by target token). With a loss vocabulary (`loss_vocab`: the N most
frequent answer tokens' head rows, ~6x cheaper steps on SmolLM2's 49k vocabulary) the unary and
selector losses are over those rows only; the checkpoint still drafts over the full vocabulary,
as Medusa's does with one.
"""

import json

import mlx.core as mx
import mlx.nn as nn

from ..drafters.dflash2 import DFlash2Drafter
from ..models.dflash2 import ARCHITECTURE, DFlash2Config, DFlash2Model
from .dflash_trainer import (
    DFlashRecipe,
    MLXDFlashTraining,
    block_states,
    decayed,
    first_slot_hits,
    slot_labels,
    teacher_forced_before,
    train_block_recipe,
)
from .run import TrainResult

# speculators' defaults (and z-lab's released configs' sizes)
CONV_KERNEL_SIZE, CONV_GROUP_SIZE, SELECTOR_RANK, SELECTOR_TOP_K = 2, 16, 256, 16
SELECTOR_WEIGHT = 1.0


def selector_candidates(logits: mx.array, labels: mx.array, top_k: int):
    """(candidate ids (N, n, k), the label's index among them (N, n)): each slot's top-k unary
    tokens, the label in place of the weakest where it is not among them."""
    scores = mx.stop_gradient(logits)
    ids = mx.argpartition(scores, kth=logits.shape[-1] - top_k, axis=-1)
    ids = ids[..., -top_k:].astype(mx.int32)
    hits = ids == labels[..., None]
    present = hits.any(axis=-1)
    weakest = mx.argmin(mx.take_along_axis(scores, ids, axis=-1), axis=-1)
    replaced = (mx.arange(top_k) == weakest[..., None]) & ~present[..., None]
    ids = mx.where(replaced, labels[..., None], ids)
    where = mx.where(present, mx.argmax(hits, axis=-1), weakest)
    return ids, where


def selector_loss(model: DFlash2Model, hidden, logits, before, labels, token_ids=None):
    """Per-slot K-way cross-entropy (N, n) of the selector's pair scores, teacher-forced:
    `before` (N, n) the token before each slot (the anchor's for the first, then the labels').
    With a loss vocabulary, logits and labels are its rows and `token_ids` maps a row to the
    target token the successor codebook is indexed by."""
    selector = model.candidate_selector
    ids, where = selector_candidates(logits, labels, selector.top_k)
    unary = mx.take_along_axis(logits, ids, axis=-1)  # (N, n, k)
    successors = ids if token_ids is None else token_ids[ids]
    edge = selector.predecessor_codebook[before] * selector.hidden_projection(hidden)  # (N, n, R)
    scores = unary + (selector.successor_codebook[successors] @ edge[..., None])[..., 0]
    return nn.losses.cross_entropy(scores.astype(mx.float32), where, reduction="none")


class MLXDFlash2Training(MLXDFlashTraining):
    """DFlash's training math with the selector's loss added (see the module docstring)."""

    def __init__(self, *args, selector_weight: float = SELECTOR_WEIGHT, **kwargs):
        super().__init__(*args, **kwargs)
        self.selector_weight = selector_weight

    def sequence_loss(self, features, tokens, anchors):
        feats, labels_by_position = features
        tokens = mx.array(tokens, dtype=mx.int32)
        anchors = mx.array(anchors, dtype=mx.int32)
        model, n = self.model, self.args.block_size - 1
        hidden = block_states(model, feats, tokens, anchors, self.embed)[:, 1:]
        logits = model.compute_logits(hidden, self.head).astype(mx.float32)
        labels, valid = slot_labels(tokens, anchors, 1, n, self.head, labels_by_position)
        before = teacher_forced_before(tokens, anchors, n, labels_by_position)
        weights = decayed(valid, self.gamma)
        unary = nn.losses.cross_entropy(logits, labels, reduction="none")
        paired = selector_loss(model, hidden, logits, before, labels,
                               getattr(self.head, "token_ids", None))
        loss = ((unary + self.selector_weight * paired) * weights).sum()
        return loss, weights.sum(), first_slot_hits(logits, labels, valid)


def dflash2_config(config: dict, *, kernel_size=CONV_KERNEL_SIZE, group_size=CONV_GROUP_SIZE,
                   rank=SELECTOR_RANK, top_k=SELECTOR_TOP_K) -> dict:
    """A DFlash config.json made DFlash2's (z-lab's layout: the new keys under dflash_config);
    a DFlash2 one is returned as it is."""
    config = json.loads(json.dumps(config))
    if ARCHITECTURE in (config.get("architectures") or []):
        return config
    config["architectures"] = [ARCHITECTURE]
    config.setdefault("dflash_config", {}).update(
        conv_kernel_size=kernel_size, conv_group_size=group_size, selector_rank=rank,
        selector_top_k=top_k)
    return config


def fresh_parts(model: DFlash2Model) -> None:
    """What DFlash2 adds to DFlash, started so the drafter drafts as its backbone does: identity
    convolutions, and pair scores of zero that still get gradients (random predecessor codebook
    and projection, zero successor codebook)."""
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            base = mx.zeros(conv.base_kernel.shape)
            conv.base_kernel = base.at[:, 0].add(1.0)
            conv.kernel_projection.weight = mx.zeros(conv.kernel_projection.weight.shape)
    selector = model.candidate_selector
    selector.predecessor_codebook = mx.random.normal(selector.predecessor_codebook.shape)
    selector.successor_codebook = mx.zeros(selector.successor_codebook.shape)


class DFlash2Recipe(DFlashRecipe):
    """DFlash2: DFlash's recipe, its model, and the selector's loss."""

    name = "dflash2"
    state_keys = ("gamma", "anchors", "selector_weight")
    config_class, model_class, drafter_class = DFlash2Config, DFlash2Model, DFlash2Drafter
    training_class = MLXDFlash2Training
    drafts_from_loss_vocab = False  # z-lab's layout drafts over the full vocabulary

    def __init__(self, *, conv_kernel_size=CONV_KERNEL_SIZE, conv_group_size=CONV_GROUP_SIZE,
                 selector_rank=SELECTOR_RANK, selector_top_k=SELECTOR_TOP_K,
                 selector_weight=SELECTOR_WEIGHT, feature_pass=None, **dflash):
        if not selector_weight >= 0:
            raise ValueError(f"selector_weight must be >= 0, got {selector_weight}")
        super().__init__(**dflash)
        self.shape = dict(kernel_size=conv_kernel_size, group_size=conv_group_size,
                          rank=selector_rank, top_k=selector_top_k)
        self.selector_weight, self.feature_pass = selector_weight, feature_pass

    def continued_config(self, config):
        return dflash2_config(config, **self.shape)

    def initialise(self, model):
        fresh_parts(model)

    def continued_weights(self, stored, fresh):
        # a DFlash checkpoint's backbone: DFlash2's own parts start fresh
        return {**{k: v for k, v in fresh.items() if k not in stored and
                   ("_conv." in k or k.startswith("candidate_selector."))}, **stored}

    def math_options(self):
        return {"selector_weight": self.selector_weight, "feature_pass": self.feature_pass}


def train_dflash2(target, prompts, out, *, tokenizer=None, layers: int | None = None,
                  block_size: int = 16, target_layer_ids=None, anchors: int = 64,
                  gamma: float | None = None, init: str = "target",
                  init_final_norm: bool = False, mask_token_id: int | None = None,
                  conv_kernel_size: int = CONV_KERNEL_SIZE,
                  conv_group_size: int = CONV_GROUP_SIZE, selector_rank: int = SELECTOR_RANK,
                  selector_top_k: int = SELECTOR_TOP_K,
                  selector_weight: float = SELECTOR_WEIGHT, feature_pass=None,
                  **run_options) -> TrainResult:
    """Train (or with `resume`, continue) a DFlash2 drafter for `target`; the checkpoint in `out`
    (z-lab's DFlash2DraftModel layout) loads with `load_dflash2_drafter`. The options are
    `train_dflash`'s (a DFlash checkpoint as `init` starts DFlash2 from its backbone), the
    convolution and selector sizes, and `selector_weight` (the selector loss's, 1.0). The
    training steps run on MLX; `feature_pass`: the frozen target's features from the torch
    backend (`--features-with torch`)."""
    recipe = DFlash2Recipe(
        layers=layers, block_size=block_size, target_layer_ids=target_layer_ids,
        anchors=anchors, gamma=gamma, init=init, init_final_norm=init_final_norm,
        mask_token_id=mask_token_id, conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size, selector_rank=selector_rank,
        selector_top_k=selector_top_k, selector_weight=selector_weight,
        feature_pass=feature_pass)
    return train_block_recipe(recipe, target, prompts, out, tokenizer=tokenizer,
                              feature_pass=feature_pass, **run_options)
