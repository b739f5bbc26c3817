"""Train an EAGLE-3 drafter for a frozen MLX target (the EAGLE-3 paper's recipe).

Per training sequence t_0..t_{T-1} (a prompt and an answer, token ids from the run's store):
  1. the frozen target runs once; the outputs of three of its layers make the features g_i of
     every position (scaled per dimension, as DFlash's; the scale folds into `fc` on export);
  2. step 0 runs the drafter's layer over all pairs (t_{i+1}, g_i) at once, causally, exactly
     as inference fills its cache; its output h_i ranks t_{i+2};
  3. training-time test (TTT), steps s = 1..S-1: pair row i is fed (t_{i+1+s}, h^{s-1}_i) at
     position i+1+s and sees the step-0 entries of rows <= i plus its own entries of steps
     1..s, which is what the inference chain sees after committing t_0..t_{i+1} and drafting
     s tokens (the true tokens stand in for drafts: a chain only goes on where they agree);
     step s ranks t_{i+2+s}. `tests/test_eagle3_training.py` checks logits against the
     inference drafter's, step by step;
  4. cross-entropy over the draft vocabulary (the run's loss vocabulary: the most frequent
     answer tokens; d2t maps it to target ids), step s weighted decay**s (SpecForge's 0.8),
     on positions whose label is an answer token and inside the draft vocabulary; labels are
     the text's tokens or, with labels="target", the target's teacher-forced greedy choices.
Only the drafter trains: fc, the decoder layer, its final norm and its draft-vocabulary head (the
last two start as the target's final norm and head rows). The embedding is the target's and
frozen; the checkpoint leaves it out (speculators' layout allows that: the target's is used).
The checkpoint is speculators-layout (config.json with transformer_layer_config, model.safetensors
with fc, layers.0.*, norm, lm_head, d2t, t2d), loadable by `--drafter eagle3 --drafter-model`.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention

from ..drafters.eagle3 import Eagle3Drafter
from ..backends import backend_named
from ..backends.mlx.hidden_states import decoder_layers
from ..models.eagle3 import Eagle3Config, Eagle3Model
from ..backends.mlx.target_parts import target_embedding, target_final_norm, target_head, target_sizes
from .features import features_batch, head_weight, raw_features_of
from .run import (
    MLXTraining,
    Recipe,
    RunSettings,
    TrainResult,
    fold_feature_scale,
    predictions_ahead,
    train,
    write_checkpoint_files,
)

TTT_STEPS = 7  # SpecForge's ttt_length
STEP_DECAY = 0.8  # SpecForge's loss weight per TTT step


def eagle3_config_for(target, *, draft_vocab_size: int, speculative_tokens: int = 4,
                      aux_layer_ids=None) -> dict:
    """A speculators-layout config.json whose layer has the target's width, heads, MLP and
    rope; `aux_layer_ids` count hidden states (vLLM's and speculators' convention: id j is
    the output of layer j-1), default [2, L/2, L-3]."""
    hidden, vocab, layers = target_sizes(target)
    a = getattr(target, "args", None)

    def arg(name, default=None):
        return getattr(a, name, None) if getattr(a, name, None) is not None else default

    heads = arg("num_attention_heads", max(hidden // 64, 1))
    ids = list(aux_layer_ids) if aux_layer_ids else [2, layers // 2, layers - 3]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": arg("intermediate_size", 4 * hidden),
            "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": arg("num_key_value_heads", heads),
            "head_dim": arg("head_dim", hidden // heads), "hidden_act": "silu",
            "rms_norm_eps": arg("rms_norm_eps", 1e-6), "vocab_size": vocab,
            "max_position_embeddings": arg("max_position_embeddings", 32768),
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": float(arg("rope_theta", 10000.0))},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        },
        "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens)}],
        },
        "torch_dtype": "float32",
    }


# ---- The training forward pass --------------------------------------------------------------


def ttt_outputs(model: Eagle3Model, projected: mx.array, tokens: mx.array,
                steps: int) -> list[mx.array]:
    """The drafter layer's outputs (n, H) of TTT steps 0..steps-1 over n pairs, from
    `projected` (1, n, H) fused features of positions 0..n-1 and the sequence's `tokens`
    (at least n + 1). Rows past the sequence's end at a later step read its last token; the
    loss gives them no weight."""
    layer, n, last = model.layers[0], projected.shape[1], tokens.shape[0] - 1
    attn = layer.self_attn
    rows = mx.arange(n)
    causal, own = rows[:, None] >= rows[None], rows[:, None] == rows[None]
    keys, values, outputs, hidden = [], [], [], projected
    for s in range(steps):
        ids = tokens[mx.minimum(rows + 1 + s, last)][None]
        embeds = mx.stop_gradient(model.embed(ids)).astype(model.dtype)

        def attend(x, s=s):
            q, k, v = attn.project(x, model.rope, 1 + s)  # row i at position i + 1 + s
            keys.append(k)
            values.append(v)
            mask = mx.concatenate([causal] + [own] * s, axis=1)
            out = scaled_dot_product_attention(q, mx.concatenate(keys, axis=2),
                                               mx.concatenate(values, axis=2), cache=None,
                                               scale=attn.scale, mask=mask)
            return attn.output(out)

        hidden = layer.around(embeds, hidden, attend)
        outputs.append(hidden[0])
    return outputs


def ttt_loss(model: Eagle3Model, features: mx.array, tokens: mx.array, prompt_len: int, *,
             steps: int, label_map: mx.array | None, labels: mx.array | None = None,
             decay: float = STEP_DECAY):
    """(sum of weighted CE, sum of weights, correct step-0 predictions) for one sequence.
    `labels`: the label of each position (default the tokens); `label_map`: target id -> draft
    row, -1 outside the draft vocabulary (None: the draft vocabulary is the target's)."""
    T = tokens.shape[0]
    n = T - 1  # pair i = (t_{i+1}, g_i)
    projected = model.project(features[:n][None])
    labels = tokens if labels is None else labels
    total = weight = correct = 0
    for s, h in enumerate(ttt_outputs(model, projected, tokens, steps)):
        at = mx.arange(n) + 2 + s  # the position step s ranks
        y, valid = answer_labels(labels, at, prompt_len, label_map)
        logits = model.logits(h).astype(mx.float32)
        w = valid.astype(mx.float32) * decay**s
        total = total + (nn.losses.cross_entropy(logits, y, reduction="none") * w).sum()
        weight = weight + w.sum()
        if s == 0:
            correct = ((mx.argmax(logits, axis=-1) == y) & valid).sum()
    return total, weight, correct


def answer_labels(labels, at, prompt_len: int, label_map=None):
    """(label rows, which count) for predictions of positions `at`: answer positions inside the
    sequence, with a `label_map` (target id -> loss-vocabulary row, -1 outside it) also only
    labels inside the loss vocabulary."""
    T = labels.shape[0]
    valid = (at < T) & (at >= prompt_len)
    y = labels[mx.minimum(at, T - 1)]
    if label_map is not None:
        y = label_map[y]
        valid = valid & (y >= 0)
        y = mx.maximum(y, 0)
    return y, valid


def label_map_of(draft_ids, vocab: int) -> mx.array:
    """Target id -> its row in the draft vocabulary, -1 outside it."""
    table = np.full(vocab, -1, dtype=np.int32)
    table[np.asarray(draft_ids)] = np.arange(len(draft_ids), dtype=np.int32)
    return mx.array(table)


class MLXEagle3Training(MLXTraining):
    """EAGLE-3's training math on MLX: features, and one sequence's TTT loss."""

    def __init__(self, target, args: Eagle3Config, weights: dict, *, schedule, weight_decay,
                 grad_clip, loss_ids, inv_scale, labels="text", steps=TTT_STEPS,
                 decay=STEP_DECAY, feature_pass=None):
        self.target, self.args, self.grad_clip = target, args, grad_clip
        self.feature_pass = feature_pass  # the torch backend's, or None: the MLX target's
        self.inv_scale, self.target_labels = inv_scale, labels == "target"
        self.steps, self.decay = steps, decay
        self.layers = args.capture_layers(len(decoder_layers(target)))
        self.model = Eagle3Model(args, own_embed=False, own_head=True)
        self.model.load_weights(list(weights.items()))
        self.model.use_embedding(target_embedding(target))
        mx.eval(self.model.parameters())
        _, vocab, _ = target_sizes(target)
        self.label_map = label_map_of(loss_ids, vocab) if loss_ids is not None else None
        self.init_optimizer(schedule, weight_decay)

    def features_batch(self, sequences: list[list[int]]) -> list[tuple]:
        return features_batch(self.target, sequences, self.layers, self.inv_scale,
                              self.target_labels, self.feature_pass)

    def sequence_loss(self, features, tokens, prompt_len):
        feats, labels = features
        return ttt_loss(self.model, feats, mx.array(tokens, dtype=mx.int32), prompt_len,
                        steps=self.steps, label_map=self.label_map, labels=labels,
                        decay=self.decay)


# ---- Checkpoints ----------------------------------------------------------------------------


def export_weights(weights: dict, inv_scale, draft_ids, vocab: int) -> dict[str, mx.array]:
    """Checkpoint tensors: the training weights with the feature scale folded into fc, and the
    draft vocabulary as speculators writes it (d2t: target id - draft id; t2d: a mask)."""
    out = fold_feature_scale(weights, inv_scale)
    if draft_ids is not None:
        ids = np.asarray(draft_ids, dtype=np.int64)
        out["d2t"] = mx.array(ids - np.arange(len(ids)))
        t2d = np.zeros(vocab, dtype=bool)
        t2d[ids] = True
        out["t2d"] = mx.array(t2d)
    return out


def drafter_from(config: dict, weights: dict, inv_scale, target, draft_ids) -> Eagle3Drafter:
    """An inference drafter with these training weights (what the checkpoint will load as)."""
    _, vocab, layers = target_sizes(target)
    args = Eagle3Config.from_dict(config)
    model = Eagle3Model(args, own_embed=False, own_head=True)
    tensors = export_weights(weights, inv_scale, draft_ids, vocab)
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    model.load_weights(list(tensors.items()))
    model.set_d2t(d2t)
    model.use_embedding(target_embedding(target))
    mx.eval(model.parameters())
    return Eagle3Drafter(model, num_target_layers=layers, target_vocab=vocab)


class Eagle3Recipe(Recipe):
    """EAGLE-3 with training-time test over `ttt_steps` steps; see the module docstring."""

    name = "eagle3"
    drafts_from_loss_vocab = True  # its d2t/t2d: the draft vocabulary
    state_keys = ("ttt_steps", "decay")

    def __init__(self, *, ttt_steps: int | None = None, decay: float | None = None,
                 aux_layer_ids=None, speculative_tokens: int = 4, feature_pass=None):
        if ttt_steps is not None and ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        if decay is not None and not 0 < decay <= 1:
            raise ValueError(f"decay (the TTT steps' loss weight) must be in (0, 1], got {decay}")
        if speculative_tokens < 1:
            raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
        self.ttt_steps, self.decay = ttt_steps, decay
        self.aux_layer_ids, self.speculative_tokens = aux_layer_ids, speculative_tokens
        self.feature_pass = feature_pass

    def config(self, target, tokenizer, run, loss_ids):
        _, vocab, layers = target_sizes(target)
        bad = [i for i in self.aux_layer_ids or () if not 1 <= i <= layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside 1..{layers} (hidden states of a "
                             f"{layers}-layer target, 0 being the embedding)")
        self.ttt_steps = self.ttt_steps or TTT_STEPS
        self.decay = self.decay or STEP_DECAY
        return eagle3_config_for(target, draft_vocab_size=len(loss_ids) if loss_ids else vocab,
                                 speculative_tokens=self.speculative_tokens,
                                 aux_layer_ids=self.aux_layer_ids)

    def feature_layers(self, config, target):
        return list(Eagle3Config.from_dict(config).capture_layers(len(decoder_layers(target))))

    def fresh_weights(self, config, target, loss_ids):
        """Random layer and fc (MLX's defaults); the final norm and the head start as the
        target's, so the untrained drafter already ranks like the target's last layer would."""
        model = Eagle3Model(Eagle3Config.from_dict(config), own_embed=False, own_head=True)
        head = head_weight(target_head(target))
        rows = head[mx.array(loss_ids, dtype=mx.int32)] if loss_ids is not None else head
        updates = [("lm_head.weight", rows.astype(mx.float32))]
        norm = target_final_norm(target)
        if norm is not None:
            updates.append(("norm.weight", norm.weight.astype(mx.float32)))
        model.load_weights(updates, strict=False)
        return dict(tree_flatten(model.parameters()))

    def math(self, target, config, weights, **options):
        return MLXEagle3Training(target, Eagle3Config.from_dict(config), weights,
                                 steps=self.ttt_steps, decay=self.decay,
                                 feature_pass=self.feature_pass, **options)

    def example(self, rng, tokens, prompt_len):
        return predictions_ahead(tokens, prompt_len, self.ttt_steps)

    def write(self, out, config, weights, inv_scale, loss_ids):
        vocab = int(config["transformer_layer_config"]["vocab_size"])
        write_checkpoint_files(out, config, export_weights(weights, inv_scale, loss_ids, vocab))

    def drafter(self, config, weights, inv_scale, target, loss_ids):
        return drafter_from(config, weights, inv_scale, target, loss_ids)

    def eval_draft(self, config):
        return self.speculative_tokens


def train_eagle3(target, prompts, out, *, tokenizer=None, ttt_steps: int | None = None,
                 decay: float | None = None, aux_layer_ids=None, speculative_tokens: int = 4,
                 feature_pass=None, **run_options) -> TrainResult:
    """Train (or with `resume`, continue) an EAGLE-3 drafter for the MLX `target`; the
    checkpoint in `out` loads with `load_drafter("eagle3", out, model=target)`.

    `ttt_steps`: training-time test steps (default 7, SpecForge's; a resume keeps its run's);
    `decay`: step s's loss weight decay**s (0.8); `aux_layer_ids`: the three target hidden
    states fused (speculators' counting, default [2, L/2, L-3]); `speculative_tokens`: the chain
    length the config suggests and held-out τ uses. `loss_vocab` (a `RunSettings` option, as all
    others: steps, lr, resume, minutes, ...) is the draft vocabulary's size (d2t); default the
    whole vocabulary. `feature_pass`: the frozen target's features and labels from elsewhere
    than the MLX target (mlxspec.training.features; the torch backend's
    `TorchTraining(target).features` over `mlxspec.load(..., backend="torch")`): the drafter's
    steps stay on MLX, the features equal within float32 rounding.
    """
    recipe = Eagle3Recipe(ttt_steps=ttt_steps, decay=decay, aux_layer_ids=aux_layer_ids,
                          speculative_tokens=speculative_tokens, feature_pass=feature_pass)
    run = RunSettings(out=out, prompts=prompts, tokenizer=tokenizer, **run_options)
    if backend_named(run.backend).training is not None:  # steps of its own, not these MLX ones
        raise ValueError("EAGLE-3 training runs on the MLX backend only")
    raw_features = raw_features_of(feature_pass) if feature_pass is not None else None
    return train(recipe, target, run, raw_features=raw_features)
