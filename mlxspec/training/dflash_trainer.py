"""Train a DFlash drafter for a frozen MLX target (the paper's recipe, SpecForge-style).

Per training sequence (prompt + the target's own response, token ids from a `SequenceStore`):
  1. the frozen target runs once over the whole sequence; the outputs of `target_layer_ids` are
     captured (only the layers up to the deepest captured one run; no LM head);
  2. up to `anchors` random anchor positions a are drawn in the response; each gives a block
     [token[a], MASK x (bs-1)] at positions a..a+bs-1;
  3. all blocks run through the drafter at once. Attention uses an explicit mask
     (`training_mask`): a block sees the fused context of positions strictly before its anchor
     plus its own block, never another block, exactly what the inference path sees when the block
     is drafted after committing token[a] (tests/test_training.py checks the two agree);
  4. cross-entropy of slot k (1..bs-1) against token[a+k], weighted exp(-(k-1)/gamma), through
     the target's frozen LM head. With `labels="target"` the label of position j is instead the
     target's own greedy prediction there (argmax after positions < j, teacher-forced), read off
     the same forward pass: any text, e.g. a conversation's real answer, then teaches what the
     target would say next, at prefill cost instead of generation cost.
Only the drafter's weights train (AdamW, warmup + cosine). Target features carry huge outlier
dimensions, so the fc input is divided per dimension by its RMS (measured on training data);
being linear, that scale is folded into `fc.weight` when a checkpoint is written, so checkpoints
are plain z-lab format (config.json + model.safetensors) for `load_dflash_drafter`.

The run is resumable: `out/train_state/` holds the training weights, the AdamW state, the feature
scale (safetensors) and step, numpy RNG state, data cursor and log (json); a stop at any point
loses at most the steps since the last save. Every `eval_every` steps, τ (tokens per target pass)
on held-out prompts is measured by the real verification loop with the current drafter.
"""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..drafters.dflash import DFlashDrafter
from ..backends import BACKENDS, backend_named
from ..backends.mlx.hidden_states import decoder_layers
from ..models.dflash import (
    ARCHITECTURE,
    DRAFT_VOCAB_FILE,
    DFlashConfig,
    DFlashModel,
    build_target_layer_ids,
    check_weights,
    draft_vocab_json,
    read_weights,
    training_mask,
)
from ..backends.mlx.target_parts import target_embedding, target_final_norm, target_head, target_sizes
from ..target_sizes import check_against_target
from .data import _atomic_write_text, eos_ids
from .features import features_batch, head_weight, raw_features_of, sequence_features
from .run import (  # noqa: F401  (answer_share .. trainable_ids: imported from here by callers)
    FIT_HORIZON,
    MLXTraining,
    Recipe,
    RunSettings,
    TrainResult,
    answer_share,
    epoch_order,
    fold_feature_scale,
    package_drafter,
    frequent_tokens,
    heldout_tau,
    prepare_data,
    schedule as _schedule,
    train,
    trainable_ids,
    write_checkpoint_files,
)



def default_gamma(block_size: int) -> float:
    """The paper's loss decay: 7 for blocks of 16, 5 for 10, 4 for 8; else scaled from 16."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 7.0 * block_size / 16)


# ---- Drafter configuration and initialisation -----------------------------------------------


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """A special token that is neither eos, bos nor pad (<|endoftext|> for SmolLM2), else the
    last id. The embedding is the target's and frozen: the id only has to be one that never
    starts a block."""
    if tokenizer is not None:
        avoid = eos_ids(tokenizer) | {
            getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "pad_token_id", None)
        }
        for i in getattr(tokenizer, "all_special_ids", []) or []:
            if i not in avoid and 0 <= i < vocab_size:
                return int(i)
    return vocab_size - 1


def drafter_config_for(
    target,
    *,
    layers: int = 1,
    block_size: int = 16,
    target_layer_ids=None,
    mask_token_id: int,
    overrides: dict | None = None,
) -> dict:
    """A released-format config.json whose layers mirror the target's (so they can start as
    copies of target layers): same hidden, heads, head_dim, MLP width, rope and norm eps."""
    hidden, vocab, num_layers = target_sizes(target)
    a = getattr(target, "args", None)

    def arg(name, default=None):
        return getattr(a, name, None) if getattr(a, name, None) is not None else default

    heads = arg("num_attention_heads", max(hidden // 64, 1))
    ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(num_layers, layers)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": arg("intermediate_size", 4 * hidden),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": arg("num_key_value_heads", heads),
        "head_dim": arg("head_dim", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": arg("rms_norm_eps", 1e-6),
        "rope_theta": float(arg("rope_theta", 10000.0)),
        "max_position_embeddings": arg("max_position_embeddings", 32768),
        "vocab_size": vocab,
        "attention_bias": False,
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": num_layers,
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": ids},
        "torch_dtype": "float32",
    }
    if arg("rope_scaling"):
        config["rope_scaling"] = dict(a.rope_scaling)
    for key, value in (overrides or {}).items():
        if key in ("mask_token_id", "target_layer_ids"):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    return config


def init_from_target(model: DFlashModel, target, source_layers=None, *,
                     final_norm: bool = False) -> list[int]:
    """Copy target decoder layers (default: the last N) into the drafter's N layers wherever
    names and shapes agree (q_norm/k_norm, fc and hidden_norm keep their fresh values), and with
    `final_norm` the target's final norm into the drafter's `norm`; returns the layers used."""
    t_layers = decoder_layers(target)
    n = len(model.layers)
    source_layers = list(source_layers) if source_layers else list(range(len(t_layers) - n, len(t_layers)))
    updates = []
    for i, j in enumerate(source_layers):
        ours = dict(tree_flatten(model.layers[i].parameters()))
        for name, w in tree_flatten(t_layers[j].parameters()):
            if name in ours and ours[name].shape == w.shape:
                updates.append((f"layers.{i}.{name}", w.astype(ours[name].dtype)))
    # The drafter reads the target's LM head, which expects the target's final norm (SmolLM2:
    # per-dimension weights from -2.1 to 3.3, mean 1.8). Left at ones, Adam moves them ~lr a
    # step (they had moved 0.1 after 400 steps); copied, the initial loss is higher (27.5 vs
    # 16.6 nats on SmolLM2) but the logits have the target's scale from the start.
    if final_norm and target_final_norm(target) is not None:
        updates.append(("norm.weight", target_final_norm(target).weight.astype(model.norm.weight.dtype)))
    model.load_weights(updates, strict=False)
    return source_layers


# Residual-branch outputs: zeroed, a layer adds nothing to the stream it reads.
BRANCH_OUTPUTS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight",
                  "mlp.down_proj.bias")


def grow_drafter(config: dict, weights: dict, layers: int,
                 donors: list[dict] | None = None) -> tuple[dict, dict]:
    """(config, weights) of the drafter with layers appended that start as the identity: their
    attention and MLP output projections zeroed, so the grown drafter drafts exactly as before
    and training continues from there. New layer k takes its other weights from `donors[k]`
    (a target layer's, names relative to the layer) where names and shapes agree, else from
    the drafter's last layer.

    Why grow: in one layer every mask slot asks the same query (its input is the mask token's
    embedding), so where it looks in the context cannot depend on the anchor or on what came
    before it; a copied span cannot be followed past a slot or two. A second layer's queries
    are built from the first layer's output and can. Why donors: a copy of the trained layer
    computes what that layer already feeds the stream; started from a target layer instead, a
    grown SmolLM2 drafter's loss ran 0.009 nats below the copy's over the same first 200 steps
    (docs/dflash-training.md)."""
    have = config["num_hidden_layers"]
    if layers < have:
        raise ValueError(f"the drafter has {have} layers; layers can be added, not removed "
                         f"(got {layers})")
    config = json.loads(json.dumps(config))
    weights = dict(weights)
    last = f"layers.{have - 1}."
    for k, i in enumerate(range(have, layers)):
        donor = donors[k] if donors else {}
        for name, w in list(weights.items()):
            if name.startswith(last):
                sub = name[len(last):]
                if sub in BRANCH_OUTPUTS:
                    w = mx.zeros_like(w)
                elif sub in donor and donor[sub].shape == w.shape:
                    w = donor[sub].astype(w.dtype)
                weights[f"layers.{i}.{sub}"] = w
    config["num_hidden_layers"] = layers
    if config.get("layer_types"):
        config["layer_types"] = list(config["layer_types"]) + \
            [config["layer_types"][-1]] * (layers - have)
    return config, weights


def growth_donors(target, have: int, layers: int) -> list[dict]:
    """Weights for new drafter layers have..layers-1: target layer T-1-i for drafter layer i, the
    layers just below the last one (which `init_from_target` gives a one-layer drafter)."""
    t_layers = decoder_layers(target)
    return [dict(tree_flatten(t_layers[max(len(t_layers) - 1 - i, 0)].parameters()))
            for i in range(have, layers)]


# ---- The training forward pass ------------------------------------------------------------


def _attention(attn, x, ctx, anchors, rope, seq_len):
    """One drafter attention over all blocks: x (N, bs, H) block inputs, ctx (1, L, H) fused
    context. Context K/V are computed once and shared by every block."""
    N, bs, _ = x.shape
    nh, kvh, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    ctx_k, ctx_v = attn.keys_values(ctx, rope, 0)  # (1, kvh, L, D), rotated at 0..L-1
    q = attn.q_norm(attn.q_proj(x).reshape(N, bs, nh, D)).transpose(0, 2, 1, 3)
    q = rope(q, offset=anchors)  # block slot i of anchor a sits at position a+i
    k = attn.k_norm(attn.k_proj(x).reshape(N, bs, kvh, D)).transpose(0, 2, 1, 3)
    k = rope(k, offset=anchors)
    v = attn.v_proj(x).reshape(N, bs, kvh, D).transpose(0, 2, 1, 3)
    rep = nh // kvh
    qg = (q * attn.scale).reshape(N, kvh, rep, bs, D)
    scores = mx.concatenate([
        qg @ ctx_k[:, :, None].swapaxes(-1, -2),  # (N, kvh, rep, bs, L)
        qg @ k[:, :, None].swapaxes(-1, -2),  # (N, kvh, rep, bs, bs)
    ], axis=-1)
    mask = training_mask(anchors, bs, seq_len, causal=attn.is_causal, window=attn.window)
    scores = mx.where(mask[:, None, None], scores, mx.array(-1e30, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs[..., :seq_len] @ ctx_v[:, :, None] + probs[..., seq_len:] @ v[:, :, None]
    return attn.o_proj(out.reshape(N, nh, bs, D).transpose(0, 2, 1, 3).reshape(N, bs, -1))


def block_hidden(model: DFlashModel, features: mx.array, block_embeddings: mx.array,
                 anchors: mx.array) -> mx.array:
    """Normed drafter hidden states (N, bs, H) of every block, given the whole sequence's
    (already scaled) target features (L, K*H) and the blocks' input embeddings (N, bs, H)."""
    seq_len = features.shape[0]
    ctx = model.hidden_norm(model.fc(features.astype(model.dtype)[None]))
    h = block_embeddings.astype(model.dtype)
    anchors = anchors.astype(mx.int32)
    for layer in model.layers:
        h = layer.around(h, lambda n, attn=layer.self_attn:
                         _attention(attn, n, ctx, anchors, model.rope, seq_len))
    return model.norm(h)


def block_tokens(tokens: mx.array, anchors: mx.array, block_size: int, mask_id: int) -> mx.array:
    """(N, bs) block inputs: [token[a], MASK, ...]."""
    first = tokens[anchors][:, None]
    return mx.concatenate(
        [first, mx.full((anchors.shape[0], block_size - 1), mask_id, dtype=first.dtype)], axis=1
    )


def block_states(model, features, tokens, anchors, embed_tokens) -> mx.array:
    """Normed hidden states (N, bs, H) of every anchor's block [token[a], MASK, ...], from the
    whole sequence's features (the training path of every block drafter)."""
    args = model.args
    block = block_tokens(tokens, anchors, args.block_size, args.mask_token_id)
    emb = mx.stop_gradient(embed_tokens(block) * args.input_embedding_scale)
    return block_hidden(model, features, emb, anchors)


def training_logits(model, features, tokens, anchors, *, embed_tokens, lm_head):
    """Drafter logits (N, bs-1, V) of slots 1..bs-1 for every anchor (the training path)."""
    hidden = block_states(model, features, tokens, anchors, embed_tokens)[:, 1:]
    return model.compute_logits(hidden, lm_head)


class SubsetHead:
    """The frozen LM head restricted to `token_ids`: the training loss's reduced vocabulary.

    On SmolLM2 the full 49k-row head and its log-sum-exp are most of a training step; the
    target's responses use far fewer distinct tokens (8k of them cover ~97%). Inference keeps
    the full head; `label_map` sends a token id to its row here, or -1 (left out of the loss).
    """

    def __init__(self, head, token_ids, vocab_size: int):
        token_ids = mx.array(token_ids, dtype=mx.int32)
        self.token_ids = token_ids  # row -> target token id
        self.weight = mx.stop_gradient(head_weight(head)[token_ids])
        mx.eval(self.weight)
        label_map = np.full(vocab_size, -1, dtype=np.int32)
        label_map[np.array(token_ids)] = np.arange(token_ids.shape[0], dtype=np.int32)
        self.label_map = mx.array(label_map)

    def __call__(self, hidden: mx.array) -> mx.array:
        return hidden @ self.weight.T


def sample_anchors(rng: np.random.Generator, prompt_len: int, length: int, count: int) -> np.ndarray:
    """Up to `count` distinct anchors, sorted, among the answer's positions that have a next
    token: from the prompt's last token (its block predicts the answer's first) to length - 2."""
    lo, hi = max(prompt_len - 1, 0), length - 1
    return np.sort(rng.choice(np.arange(lo, hi), size=min(count, hi - lo), replace=False))


def slot_labels(tokens, anchors, first: int, count: int, lm_head, labels=None):
    """(labels, valid) (N, count) of block slots whose labels sit at positions a+first ..
    a+first+count-1 of each anchor a: `labels` by position (default the tokens themselves);
    valid where inside the sequence and, with a `SubsetHead`, in its vocabulary (then labels
    are its rows)."""
    L = tokens.shape[0]
    idx = anchors[:, None] + mx.arange(first, first + count)[None]
    valid = idx < L
    labels = (tokens if labels is None else labels)[mx.minimum(idx, L - 1)]
    if isinstance(lm_head, SubsetHead):
        labels = lm_head.label_map[labels]
        valid = valid & (labels >= 0)
        labels = mx.maximum(labels, 0)
    return labels, valid


def teacher_forced_before(tokens, anchors, count: int, labels=None) -> mx.array:
    """(N, count) the token before each of the slots labelled a+1 .. a+count: the anchor's
    token, then the labels' (target token ids, whatever rows a loss vocabulary uses)."""
    said, _ = slot_labels(tokens, anchors, 1, count, None, labels)
    return mx.concatenate([tokens[anchors][:, None], said[:, :-1]], axis=1)


def first_slot_hits(logits, labels, valid) -> mx.array:
    """How many blocks' first scored slot predicts its label (the run log's slot1_acc)."""
    return ((mx.argmax(logits[:, 0], axis=-1) == labels[:, 0]) & valid[:, 0]).sum()


def decayed(valid: mx.array, gamma: float) -> mx.array:
    """Slot weights exp(-k/gamma) for slots k = 0.. of the labels, zero where not valid."""
    return mx.exp(-mx.arange(valid.shape[1], dtype=mx.float32) / gamma)[None] * valid


def block_loss(model, features, tokens, anchors, *, embed_tokens, lm_head, gamma, labels=None):
    """(sum of weighted CE, sum of weights, correct slot-1 predictions) for one sequence.
    `labels`: the label of each position (default: the tokens themselves).
    With a `SubsetHead`, labels outside its vocabulary carry no weight."""
    bs = model.args.block_size
    logits = training_logits(model, features, tokens, anchors,
                             embed_tokens=embed_tokens, lm_head=lm_head).astype(mx.float32)
    labels, valid = slot_labels(tokens, anchors, 1, bs - 1, lm_head, labels)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    weights = decayed(valid, gamma)
    return (ce * weights).sum(), weights.sum(), first_slot_hits(logits, labels, valid)


# ---- Checkpoints ----------------------------------------------------------------------------


def export_drafter(args: DFlashConfig, weights: dict, inv_scale, target, draft_vocab=None,
                   model_class=DFlashModel, drafter_class=DFlashDrafter) -> DFlashDrafter:
    """An inference drafter with the given training weights (scale folded), for τ measurement;
    it drafts from `draft_vocab` (the loss vocabulary) as the written checkpoint will."""
    copy = model_class(args)
    copy.load_weights(list(fold_feature_scale(weights, inv_scale).items()))
    mx.eval(copy.parameters())
    copy.eval()
    vocab = {} if draft_vocab is None else {"draft_vocab": draft_vocab}
    return drafter_class(
        copy, embed_tokens=target_embedding(target), lm_head=target_head(target),
        final_norm=target_final_norm(target), target_layers=len(decoder_layers(target)),
        **vocab,
    )


def write_checkpoint(out: Path, config: dict, weights: dict, inv_scale, draft_vocab=None) -> None:
    """config.json + model.safetensors (z-lab's format), and with a loss vocabulary its ids as
    the draft vocabulary: the rows the drafter learned to rank, all that drafting needs."""
    write_checkpoint_files(out, config, fold_feature_scale(weights, inv_scale))
    if draft_vocab is not None:
        write_draft_vocab(out, draft_vocab)


def write_draft_vocab(out: Path, token_ids) -> None:
    _atomic_write_text(Path(out) / DRAFT_VOCAB_FILE, draft_vocab_json(token_ids))


# ---- The trainer ------------------------------------------------------------------------------


class MLXDFlashTraining(MLXTraining):
    """DFlash's training math on MLX: features, and one sequence's block loss.
    (The torch twin is mlxspec.backends.torch.dflash_training; the loop is training.run.train.)"""

    def __init__(self, target, args: DFlashConfig, weights: dict, *, schedule, weight_decay,
                 grad_clip, gamma, loss_ids, inv_scale, labels="text", model_class=DFlashModel,
                 feature_pass=None):
        self.target, self.args, self.gamma, self.grad_clip = target, args, gamma, grad_clip
        self.inv_scale, self.target_labels = inv_scale, labels == "target"
        self.feature_pass = feature_pass  # the torch backend's, or None: the MLX target's
        self.model = model_class(args)
        self.model.load_weights(list(weights.items()))
        mx.eval(self.model.parameters())
        self.embed = target_embedding(target)
        head = target_head(target)
        _, vocab, _ = target_sizes(target)
        self.head = SubsetHead(head, loss_ids, vocab) if loss_ids is not None else head
        self.init_optimizer(schedule, weight_decay)

    def features(self, tokens: list[int]):
        return sequence_features(self.target, tokens, self.args.target_layer_ids,
                                 self.inv_scale, self.target_labels)

    def features_batch(self, sequences: list[list[int]]) -> list[tuple]:
        """`features` of each sequence: one at a time (the MLX step loops over them too), or
        all in one pass of the handed-in feature pass."""
        return features_batch(self.target, sequences, self.args.target_layer_ids,
                              self.inv_scale, self.target_labels, self.feature_pass)

    def sequence_loss(self, features, tokens, anchors):
        feats, labels = features
        return block_loss(self.model, feats, mx.array(tokens, dtype=mx.int32),
                          mx.array(anchors, dtype=mx.int32), embed_tokens=self.embed,
                          lm_head=self.head, gamma=self.gamma, labels=labels)


class DFlashRecipe(Recipe):
    """DFlash (block drafting from target features): anchors drawn in the answer, blocks of
    `block_size`, slot weights exp(-(k-1)/gamma); see the module docstring."""

    name = "dflash"
    state_keys = ("gamma", "anchors")
    config_class, model_class, drafter_class = DFlashConfig, DFlashModel, DFlashDrafter
    training_class = MLXDFlashTraining
    drafts_from_loss_vocab = True  # the checkpoint keeps the loss vocabulary as its draft one

    def __init__(self, *, layers=None, block_size=16, target_layer_ids=None, anchors=64,
                 gamma=None, init="target", init_final_norm=False, mask_token_id=None,
                 drafter_overrides=None, torch_training=None):
        if gamma is not None and not gamma > 0:
            raise ValueError(f"gamma (the slot weights' decay) must be > 0, got {gamma}")
        if layers is not None and layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        self.start_from = None
        if init not in ("target", "random"):
            self.start_from = Path(init).expanduser()
            if not (self.start_from / "config.json").is_file():
                raise ValueError(f"init must be 'target', 'random' or a DFlash checkpoint "
                                 f"directory; {init!r} has no config.json")
        self.layers, self.block_size, self.target_layer_ids = layers, block_size, target_layer_ids
        self.anchors, self.gamma, self.init = anchors, gamma, init
        self.init_final_norm, self.mask_token_id = init_final_norm, mask_token_id
        self.drafter_overrides = drafter_overrides
        self.torch_training = torch_training  # the torch backend's steps, or None: MLX's

    def check_growth(self, continued: Path | None) -> None:
        """Layers can be added to a drafter that exists, not removed."""
        if self.layers is not None and continued is not None:
            have = json.loads((continued / "config.json").read_text())["num_hidden_layers"]
            if self.layers < have:
                raise ValueError(f"{continued} holds a {have}-layer drafter; layers can be added "
                                 f"to it, not removed (got layers={self.layers})")

    def config(self, target, tokenizer, run, loss_ids):
        if self.start_from is not None:  # continue a trained drafter (its config wins)
            config = self.continued_config(
                json.loads((self.start_from / "config.json").read_text()))
            config["torch_dtype"] = "float32"
            check_against_target(self.config_class.from_dict(config), target_sizes(target))
        else:
            _, vocab, _ = target_sizes(target)
            mask_id = self.mask_token_id if self.mask_token_id is not None \
                else default_mask_token_id(tokenizer, vocab)
            config = self.continued_config(drafter_config_for(
                target, layers=self.layers or 1, block_size=self.block_size,
                target_layer_ids=self.target_layer_ids, mask_token_id=mask_id,
                overrides=self.drafter_overrides))
            self.config_class.from_dict(config)  # its numbers checked before any compute
        if self.gamma is None:
            self.gamma = default_gamma(config["block_size"])
        return config

    def feature_layers(self, config, target):
        return self.config_class.from_dict(config).target_layer_ids

    def fresh_weights(self, config, target, loss_ids):
        fresh = self.model_class(self.config_class.from_dict(config))
        if self.init == "target":
            init_from_target(fresh, target, final_norm=self.init_final_norm)
        self.initialise(fresh)
        weights = dict(tree_flatten(fresh.parameters()))
        if self.start_from is not None:
            stored = {k: v.astype(mx.float32) for k, v in read_weights(self.start_from).items()}
            weights = self.continued_weights(stored, weights)
            check_weights(self.config_class.from_dict(config), weights, self.model_class)
        return weights

    # Hooks for a recipe whose drafter is DFlash's with parts added (DFlash2's):
    def continued_config(self, config: dict) -> dict:
        """The config to train, from a DFlash-shaped one (a fresh drafter's, or that of the
        checkpoint `init` names)."""
        return config

    def initialise(self, model) -> None:
        """Start a fresh drafter's own parts (after its layers are copied from the target)."""

    def continued_weights(self, stored: dict, fresh: dict) -> dict:
        """The weights to train, from a checkpoint's and a fresh drafter's."""
        return stored

    def adapt(self, config, weights, inv_scale, target, resumed):
        if self.start_from is not None and not resumed and inv_scale is not None:
            # its fc has a scale folded in: train on the unfolded one
            weights["fc.weight"] = weights["fc.weight"] / inv_scale[None]
        have = config["num_hidden_layers"]
        continued = resumed or self.start_from is not None
        if continued and self.layers is not None and self.layers > have:
            # New layers start with no AdamW moments. torch counts steps per parameter, so their
            # bias correction starts afresh; MLX's AdamW has one step count, so on MLX their
            # first few hundred updates are larger (up to ~6x, for a steady gradient) than a
            # fresh one's.
            config, weights = grow_drafter(config, weights, self.layers,
                                           growth_donors(target, have, self.layers))
        self.args = self.config_class.from_dict(config)
        return config, weights

    def math(self, target, config, weights, **options):
        args = self.config_class.from_dict(config)
        if self.torch_training is not None:
            return self.torch_training.dflash_steps(args, weights, gamma=self.gamma, **options)
        return self.training_class(target, args, weights, gamma=self.gamma,
                                   model_class=self.model_class, **self.math_options(),
                                   **options)

    def math_options(self) -> dict:
        """A subclass's own keywords for its training math."""
        return {}

    def example(self, rng, tokens, prompt_len):
        chosen = sample_anchors(rng, prompt_len, len(tokens), self.anchors)
        return chosen, len(chosen) * self.args.block_size, len(chosen)

    def write(self, out, config, weights, inv_scale, loss_ids):
        write_checkpoint(out, config, weights, inv_scale,
                         draft_vocab=loss_ids if self.drafts_from_loss_vocab else None)

    def drafter(self, config, weights, inv_scale, target, loss_ids):
        vocab = loss_ids if self.drafts_from_loss_vocab else None
        return export_drafter(self.config_class.from_dict(config), weights, inv_scale, target,
                              draft_vocab=vocab, model_class=self.model_class,
                              drafter_class=self.drafter_class)

    def eval_draft(self, config):
        return config["block_size"] - 1


def train_dflash(
    target,
    prompts,
    out,
    *,
    tokenizer=None,
    layers: int | None = None,
    block_size: int = 16,
    target_layer_ids=None,
    anchors: int = 64,
    gamma: float | None = None,
    init: str = "target",
    mask_token_id: int | None = None,
    drafter_overrides: dict | None = None,
    init_final_norm: bool = False,
    backend: str = "mlx",
    torch_training=None,
    **run_options,
) -> TrainResult:
    """Train (or with `resume`, continue training) a DFlash drafter for `target`; the checkpoint
    in `out` (config.json + model.safetensors) is loadable by `load_dflash_drafter`.

    target: an mlx-lm model (with `tokenizer` for text prompts), or a model path / repo id /
    None (the default SmolLM2) to load. prompts: "sharegpt", a .jsonl/.txt path, or a list of
    strings or token-id lists (token ids need no tokenizer). The run's other options are
    `RunSettings`' (mlxspec.training.run): responses ("target": the target's greedy answers;
    "conversation": the data's real answers) are cached in `data_dir` (default out/data) and
    reused or continued by later calls. `steps` is the schedule's length (default 1000; a resume
    keeps its run's); `stop_after` stops early at that step (as an interruption would, after
    saving); `minutes` stops (saved) after the step that ends past that much training time, for a
    machine lent for a fixed time, keeping the schedule, so a resume carries on along it.
    `minutes` without `steps` fits the schedule to the time: the warmup steps are timed and the
    cosine gets the steps the time left allows (evaluations on the way shorten it).
    `layers`: the drafter's depth (default 1); continuing a drafter (`resume`, or `init` from a
    checkpoint) with more layers than it has appends layers that start as the identity
    (`grow_drafter`), so it drafts as before and the new layers learn from there.
    `loss_vocab`: train against the target head's rows of the N most frequent response tokens
    only (`SubsetHead`; ~4x cheaper steps on SmolLM2); the checkpoint lists them as its draft
    vocabulary (drafts come from those rows; verification keeps the target's full head).
    `generator`: the model that writes the responses (default the target; see `prepare_data`).
    `labels`: "text" (the sequences' own next tokens) or "target" (the target's greedy next-token
    prediction at each position, teacher-forced: with responses="conversation" this trains on
    real answers at prefill cost while still teaching what the target would say; with the
    target's own greedy answers the two agree).
    `backend="torch"`: the training steps run in torch, handed in as `torch_training` (a
    `mlxspec.backends.torch.dflash_training.TorchTraining` of the same weights as a transformers
    model, `mlxspec.load(..., backend="torch")`; ~2.5x faster on this CPU, and CUDA with its
    `device`); the checkpoint, the data and the held-out τ (measured on the MLX target) are the
    same. A run resumes on the backend it started with.
    """
    run = RunSettings(out=out, prompts=prompts, tokenizer=tokenizer, backend=backend,
                      **run_options)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be {' or '.join(map(repr, BACKENDS))}, got {backend!r}")
    own_steps = backend_named(backend).training is not None  # else the MLX steps here
    recipe = DFlashRecipe(layers=layers, block_size=block_size, target_layer_ids=target_layer_ids,
                          anchors=anchors, gamma=gamma, init=init, init_final_norm=init_final_norm,
                          mask_token_id=mask_token_id, drafter_overrides=drafter_overrides,
                          torch_training=torch_training if own_steps else None)
    run.check()
    recipe.check_growth(run.out if run.resume else recipe.start_from)
    raw_features = None
    if own_steps:
        if torch_training is None:
            raise ValueError(f"backend={backend!r} needs torch_training=, mlxspec.backends.torch."
                             "dflash_training.TorchTraining(the target loaded with "
                             f"mlxspec.load(..., backend={backend!r}))")
        raw_features = raw_features_of(torch_training.features)  # the backend that trains
    return train(recipe, target, run, raw_features=raw_features)


def train_block_recipe(recipe: DFlashRecipe, target, prompts, out, *, tokenizer=None,
                       feature_pass=None, **run_options) -> TrainResult:
    """Run a block drafter's recipe trained on MLX (DFlash2's, DSpark's): the run's options
    checked, a continued drafter's growth checked, the feature scale measured on the features
    the steps will see."""
    run = RunSettings(out=out, prompts=prompts, tokenizer=tokenizer, **run_options)
    run.check()
    recipe.check_growth(run.out if run.resume else recipe.start_from)
    raw_features = raw_features_of(feature_pass) if feature_pass is not None else None
    return train(recipe, target, run, raw_features=raw_features)

