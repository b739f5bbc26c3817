"""Train a DSpark drafter (models.dspark) for a frozen MLX target: DeepSpec's recipe
(deepseek-ai/DeepSpec, `modeling/dspark/qwen3/modeling.py` and `loss.py`) on the shared trainer.

Per training sequence:
  1. the frozen target runs over the whole sequence; the outputs of `target_layer_ids` are the
     drafter's features, and the last layer's (final-normed) hidden states give the target's own
     next-token distribution at every position;
  2. up to `anchors` random anchors a in the answer, each with a next token there; each gives a
     block [token[a], MASK x (B-1)] at positions a..a+B-1 that sees the context strictly before
     a (DFlash's training mask, bidirectional inside the block);
  3. slot j (0..B-1) predicts token[a+1+j]: its logits are the head's plus the Markov bias of
     the true token before it (teacher forcing: token[a] for slot 0), W2 W1[x_{j-1}];
  4. the loss, each term averaged with slot weights exp(-j/gamma) (gamma 4), is
     0.1 * CE(label) + 0.9 * L1(p_draft, p_target) + 1.0 * BCE(confidence, alpha), where
     alpha = 1 - L1/2 = sum_v min(p_draft, p_target) is the slot's chance of acceptance (its
     target detached), and the confidence head reads [h_j ; W1[x_{j-1}]].
Only the drafter trains; its embedding and head are the target's, frozen (the checkpoint
leaves them out: mlxspec then drafts with the target's, as LFM2.5's layout does; DeepSpec's
own files carry copies). DSpark drafts over the full vocabulary; with a loss vocabulary
(`loss_vocab`, the N most frequent answer tokens' head rows: ~6x cheaper steps on SmolLM2) all
three terms are over those rows, both distributions renormalised there (the Markov bias reads
their rows of W2), and the checkpoint still drafts over the full vocabulary.
"""

import json

import mlx.core as mx
import mlx.nn as nn

from ..backends.mlx.hidden_states import decoder_layers
from ..drafters.dspark import DSparkDrafter
from ..models.dspark import ARCHITECTURE, DSparkConfig, DSparkModel
from .dflash_trainer import (
    DFlashRecipe,
    MLXDFlashTraining,
    block_states,
    decayed,
    first_slot_hits,
    sample_anchors,
    slot_labels,
    teacher_forced_before,
    train_block_recipe,
)
from .features import features_batch
from .run import TrainResult

# DeepSpec's published recipe (config/dspark/dspark_qwen3_4b.py)
BLOCK_SIZE, GAMMA, MARKOV_RANK = 7, 4.0, 256
CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
INIT_STD = 0.02  # DeepSpec's (transformers') initializer_range for the heads it adds


def acceptance(draft_logits: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """(L1 distance, its acceptance 1 - L1/2 in [0, 1]) between the two distributions, per slot:
    the chance the lossless rule accepts a draft sampled from the drafter's."""
    l1 = mx.abs(mx.softmax(draft_logits, axis=-1, precise=True) -
                mx.softmax(target_logits, axis=-1, precise=True)).sum(axis=-1)
    return l1, mx.clip(1.0 - 0.5 * l1, 0.0, 1.0)


def dspark_loss(model: DSparkModel, hidden, logits, target_logits, before, labels, weights,
                *, ce_weight=CE_WEIGHT, l1_weight=L1_WEIGHT,
                confidence_weight=CONFIDENCE_WEIGHT) -> mx.array:
    """The weighted sum over slots of DeepSpec's three terms (see the module docstring):
    hidden (N, B, H), logits with the Markov bias and the target's (N, B, V), the tokens
    before each slot and the labels (N, B), slot weights (N, B)."""
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    l1, accepted = acceptance(logits, mx.stop_gradient(target_logits))
    loss = ce_weight * ce + l1_weight * l1
    head = getattr(model, "confidence_head", None)
    if head is not None and confidence_weight:
        predicted = head.proj(model.confidence_input(hidden, before))[..., 0].astype(mx.float32)
        bce = nn.losses.binary_cross_entropy(predicted, mx.stop_gradient(accepted),
                                             with_logits=True, reduction="none")
        loss = loss + confidence_weight * bce
    return (loss * weights).sum()


class MLXDSparkTraining(MLXDFlashTraining):
    """DSpark's training math on MLX: features with the target's last hidden states, and one
    sequence's loss."""

    def __init__(self, target, args, weights, *, loss_weights: dict, **kwargs):
        super().__init__(target, args, weights, **kwargs)
        self.loss_weights = loss_weights
        self.last = len(decoder_layers(target)) - 1

    def _layers(self) -> list[int]:
        """The feature layers, and the last one's (final-normed) output after them."""
        ids = list(self.args.target_layer_ids)
        return ids if self.last in ids else ids + [self.last]

    def _split(self, feats: mx.array, labels) -> tuple:
        ids, H = list(self.args.target_layer_ids), self.args.hidden_size
        at = self._layers().index(self.last)
        final = mx.stop_gradient(feats[:, at * H:(at + 1) * H])
        drafter = feats[:, : len(ids) * H]
        if self.inv_scale is not None:
            drafter = drafter * self.inv_scale
        return drafter, labels, final

    def features(self, tokens):
        return self.features_batch([tokens])[0]

    def features_batch(self, sequences):
        raw = features_batch(self.target, sequences, self._layers(), None, self.target_labels,
                             self.feature_pass)
        return [self._split(feats, labels) for feats, labels in raw]

    def sequence_loss(self, features, tokens, anchors):
        feats, labels_by_position, final = features
        tokens = mx.array(tokens, dtype=mx.int32)
        anchors = mx.array(anchors, dtype=mx.int32)
        model, B = self.model, self.args.block_size
        hidden = block_states(model, feats, tokens, anchors, self.embed)
        labels, valid = slot_labels(tokens, anchors, 1, B, self.head, labels_by_position)
        before = teacher_forced_before(tokens, anchors, B, labels_by_position)
        logits = model.compute_logits(hidden, self.head).astype(mx.float32)
        markov = getattr(model, "markov_head", None)
        if markov is not None:  # over a loss vocabulary's rows where there is one
            rows = getattr(self.head, "token_ids", None)
            logits = logits + markov(before, rows).astype(mx.float32)
        L = tokens.shape[0]
        predicted_at = mx.minimum(anchors[:, None] + mx.arange(B)[None], L - 1)
        # the target's own distribution there: its head (the rows of the loss vocabulary) on
        # its final-normed last hidden state
        target_logits = self.head(final[predicted_at]).astype(mx.float32)
        weights = decayed(valid, self.gamma)
        loss = dspark_loss(model, hidden, logits, target_logits, before, labels, weights,
                           **self.loss_weights)
        return loss, weights.sum(), first_slot_hits(logits, labels, valid)


def dspark_config(config: dict, *, markov_rank=MARKOV_RANK, confidence_head=True,
                  anchors=64) -> dict:
    """DeepSpec's flat Qwen3DSparkModel config.json from a DFlash one (drafter_config_for's)."""
    config = json.loads(json.dumps(config))
    if ARCHITECTURE in (config.get("architectures") or []):
        return config
    nested = config.pop("dflash_config", {})
    config.update(
        architectures=[ARCHITECTURE], target_layer_ids=nested["target_layer_ids"],
        mask_token_id=nested["mask_token_id"], num_anchors=anchors, markov_rank=markov_rank,
        markov_head_type="vanilla" if markov_rank else None,
        enable_confidence_head=bool(confidence_head),
        confidence_head_with_markov=bool(confidence_head and markov_rank))
    return config


def initialise_heads(model: DSparkModel) -> None:
    """The Markov and confidence heads at DeepSpec's initialisation, N(0, 0.02) weights and a
    zero bias: the Markov bias starts near zero (MLX's own embedding init, N(0, 1), would add
    logit noise of ~0.6 to every slot)."""
    markov = getattr(model, "markov_head", None)
    if markov is not None:
        markov.markov_w1.weight = INIT_STD * mx.random.normal(markov.markov_w1.weight.shape)
        markov.markov_w2.weight = INIT_STD * mx.random.normal(markov.markov_w2.weight.shape)
    head = getattr(model, "confidence_head", None)
    if head is not None:
        head.proj.weight = INIT_STD * mx.random.normal(head.proj.weight.shape)
        head.proj.bias = mx.zeros(head.proj.bias.shape)


class DSparkRecipe(DFlashRecipe):
    """DSpark: DFlash's backbone and anchors, every slot drafting, DeepSpec's losses."""

    name = "dspark"
    state_keys = ("gamma", "anchors", "loss_weights")
    config_class, model_class, drafter_class = DSparkConfig, DSparkModel, DSparkDrafter
    training_class = MLXDSparkTraining
    drafts_from_loss_vocab = False  # DeepSpec's layout drafts over the full vocabulary

    def __init__(self, *, markov_rank=MARKOV_RANK, confidence_head=True, ce_weight=CE_WEIGHT,
                 l1_weight=L1_WEIGHT, confidence_weight=CONFIDENCE_WEIGHT, feature_pass=None,
                 block_size=BLOCK_SIZE, gamma=GAMMA, **dflash):
        for name, value in (("ce_weight", ce_weight), ("l1_weight", l1_weight),
                            ("confidence_weight", confidence_weight)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not ce_weight + l1_weight > 0:
            raise ValueError("ce_weight and l1_weight cannot both be 0: nothing would train "
                             "the drafts")
        if markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {markov_rank}")
        super().__init__(block_size=block_size, gamma=gamma, **dflash)
        self.markov_rank, self.confidence_head = markov_rank, confidence_head
        self.loss_weights = dict(ce_weight=ce_weight, l1_weight=l1_weight,
                                 confidence_weight=confidence_weight)
        self.feature_pass = feature_pass

    def continued_config(self, config):
        return dspark_config(config, markov_rank=self.markov_rank,
                             confidence_head=self.confidence_head, anchors=self.anchors)

    def initialise(self, model):
        initialise_heads(model)

    def math_options(self):
        return {"loss_weights": self.loss_weights, "feature_pass": self.feature_pass}

    def example(self, rng, tokens, prompt_len):
        # an anchor is an answer token with a next one (the pending token drafting starts from)
        chosen = sample_anchors(rng, prompt_len + 1, len(tokens), self.anchors)
        return chosen, len(chosen) * self.args.block_size, len(chosen)

    def eval_draft(self, config):
        return config["block_size"]  # every slot drafts


def train_dspark(target, prompts, out, *, tokenizer=None, layers: int | None = None,
                 block_size: int = BLOCK_SIZE, target_layer_ids=None, anchors: int = 64,
                 gamma: float = GAMMA, init: str = "target", init_final_norm: bool = False,
                 mask_token_id: int | None = None, markov_rank: int = MARKOV_RANK,
                 confidence_head: bool = True, ce_weight: float = CE_WEIGHT,
                 l1_weight: float = L1_WEIGHT, confidence_weight: float = CONFIDENCE_WEIGHT,
                 feature_pass=None, **run_options) -> TrainResult:
    """Train (or with `resume`, continue) a DSpark drafter for `target`; the checkpoint in `out`
    (DeepSpec's Qwen3DSparkModel layout, without embedding and head copies) loads with
    `load_dspark_drafter`. The options are `train_dflash`'s (init: 'target', 'random' or a
    DSpark checkpoint), the Markov head's rank (0: none), the confidence head, and the three
    loss weights (DeepSpec's 0.1, 0.9, 1.0). The steps run on MLX; `feature_pass`: the frozen
    target's features from the torch backend (`--features-with torch`)."""
    recipe = DSparkRecipe(
        layers=layers, block_size=block_size, target_layer_ids=target_layer_ids,
        anchors=anchors, gamma=gamma, init=init, init_final_norm=init_final_norm,
        mask_token_id=mask_token_id, markov_rank=markov_rank, confidence_head=confidence_head,
        ce_weight=ce_weight, l1_weight=l1_weight, confidence_weight=confidence_weight,
        feature_pass=feature_pass)
    return train_block_recipe(recipe, target, prompts, out, tokenizer=tokenizer,
                              feature_pass=feature_pass, **run_options)
