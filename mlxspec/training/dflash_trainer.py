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
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..drafters.dflash import (
    DFlashDrafter,
    _target_inner,
    check_against_target,
    target_embedding,
    target_final_norm,
    target_head,
    target_sizes,
)
from ..hidden_states import capture_layer_outputs, concat_features, decoder_layers
from ..models.dflash import (
    ARCHITECTURE,
    DRAFT_VOCAB_FILE,
    DFlashConfig,
    DFlashModel,
    build_target_layer_ids,
    check_weights,
    draft_vocab_json,
    read_weights,
)
from .data import (
    SequenceStore,
    _atomic_save_safetensors,
    _atomic_write_text,
    build_sequences,
    encode_prompt,
    eos_ids,
    fingerprint,
    load_examples,
    split_heldout,
)

FIT_HORIZON = 10**9  # the provisional schedule length while a time-fitted run times its warmup
FIT_MIN_STEPS = 4  # steps timed at least before fitting
STATE_DIR = "train_state"


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


# ---- Target features ----------------------------------------------------------------------


def target_features(target, tokens, layer_ids, *, predictions: bool = False):
    """(L, len(ids)*H) outputs of `layer_ids` for the whole sequence, as the inference path sees
    them (the last target layer's output after the final norm). Layers past the deepest id and
    the LM head are not run, unless `predictions`: then the whole target runs and the result is
    (features, (L,) greedy next-token predictions)."""
    inner = _target_inner(target)
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


# ---- The training forward pass ------------------------------------------------------------


def training_mask(anchors: mx.array, block_size: int, seq_len: int, *, causal: bool = False,
                  window: int | None = None) -> mx.array:
    """(N, bs, seq_len + bs) bool: what slot i of the block at anchor a sees.

    Keys are the context positions 0..seq_len-1 followed by the block's own slots. Context p is
    visible iff p < a (strictly before the anchor); other blocks are not keys at all. Causal
    ("sliding_attention") layers see slots j <= i; a window keeps keys with |q - k| < window,
    by absolute position (query a+i), as `models.dflash.block_mask` does at inference.
    """
    a = anchors.astype(mx.int32)[:, None, None]
    i = mx.arange(block_size)[None, :, None]
    p = mx.arange(seq_len)[None, None, :]
    j = mx.arange(block_size)[None, None, :]
    ctx = p < a
    blk = mx.ones((1, block_size, block_size), dtype=mx.bool_)
    if causal:
        blk = blk & (j <= i)
    if window is not None:
        ctx = ctx & ((a + i) - p < window)
        blk = blk & (i - j < window)
        if not causal:
            blk = blk & (j - i < window)
    N = anchors.shape[0]
    return mx.concatenate(
        [mx.broadcast_to(ctx, (N, block_size, seq_len)),
         mx.broadcast_to(blk, (N, block_size, block_size))], axis=-1
    )


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
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), ctx, anchors, model.rope,
                           seq_len)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def block_tokens(tokens: mx.array, anchors: mx.array, block_size: int, mask_id: int) -> mx.array:
    """(N, bs) block inputs: [token[a], MASK, ...]."""
    first = tokens[anchors][:, None]
    return mx.concatenate(
        [first, mx.full((anchors.shape[0], block_size - 1), mask_id, dtype=first.dtype)], axis=1
    )


def training_logits(model, features, tokens, anchors, *, embed_tokens, lm_head):
    """Drafter logits (N, bs-1, V) of slots 1..bs-1 for every anchor (the training path)."""
    args = model.args
    block = block_tokens(tokens, anchors, args.block_size, args.mask_token_id)
    emb = mx.stop_gradient(embed_tokens(block) * args.input_embedding_scale)
    hidden = block_hidden(model, features, emb, anchors)[:, 1:]
    return model.compute_logits(hidden, lm_head)


def head_weight(head) -> mx.array:
    """(V, H) weight of an LM head module or of a tied embedding's `as_linear` (dequantized)."""
    module = getattr(head, "__self__", head)
    if hasattr(module, "scales"):
        return mx.dequantize(module.weight, module.scales, module.get("biases"),
                             group_size=module.group_size, bits=module.bits)
    return module.weight


class SubsetHead:
    """The frozen LM head restricted to `token_ids`: the training loss's reduced vocabulary.

    On SmolLM2 the full 49k-row head and its log-sum-exp are most of a training step; the
    target's responses use far fewer distinct tokens (8k of them cover ~97%). Inference keeps
    the full head; `label_map` sends a token id to its row here, or -1 (left out of the loss).
    """

    def __init__(self, head, token_ids, vocab_size: int):
        token_ids = mx.array(token_ids, dtype=mx.int32)
        self.weight = mx.stop_gradient(head_weight(head)[token_ids])
        mx.eval(self.weight)
        label_map = np.full(vocab_size, -1, dtype=np.int32)
        label_map[np.array(token_ids)] = np.arange(token_ids.shape[0], dtype=np.int32)
        self.label_map = mx.array(label_map)

    def __call__(self, hidden: mx.array) -> mx.array:
        return hidden @ self.weight.T


def answer_counts(sequences, vocab_size: int) -> np.ndarray:
    """How often each id occurs in the responses (prompt tokens are never labels)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens, prompt_len in sequences:
        np.add.at(counts, np.asarray(tokens[prompt_len:], dtype=np.int64), 1)
    return counts


def frequent_tokens(sequences, vocab_size: int, count: int, always=()) -> list[int]:
    """The `count` most frequent ids of the responses, plus `always` (end tokens), sorted."""
    counts = answer_counts(sequences, vocab_size)
    keep = set(np.argsort(-counts, kind="stable")[:count].tolist()) | {int(t) for t in always}
    return sorted(keep)


def answer_share(sequences, token_ids, vocab_size: int) -> float:
    """The share of the responses' tokens that are among `token_ids`: what a loss (and draft)
    vocabulary holds of the data, since a token outside it is never learned nor drafted."""
    counts = answer_counts(sequences, vocab_size)
    total = counts.sum()
    return float(counts[np.asarray(token_ids)].sum() / total) if total else 0.0


def sample_anchors(rng: np.random.Generator, prompt_len: int, length: int, count: int) -> np.ndarray:
    """Up to `count` distinct anchors, sorted, among the answer's positions that have a next
    token: from the prompt's last token (its block predicts the answer's first) to length - 2."""
    lo, hi = max(prompt_len - 1, 0), length - 1
    return np.sort(rng.choice(np.arange(lo, hi), size=min(count, hi - lo), replace=False))


def trainable_ids(store, max_seq_len: int) -> list[int]:
    """Store ids of the sequences with a response to learn from once cut at `max_seq_len`
    (at least two answer positions); an epoch's order indexes this list."""
    return [i for i in range(len(store))
            if min(len(store[i][0]), max_seq_len) - max(store[i][1] - 1, 0) >= 2]


def epoch_order(seed: int, epoch: int, sizes: list[int]) -> np.ndarray:
    """The order in which an epoch visits training sequences 0..sizes[-1]-1: a shuffle of the
    first sizes[0], then a shuffle of each block added while the epoch ran (`sizes` grows when
    a run resumes on a larger store). Reshuffling the grown store instead would reorder the
    rest of the epoch and revisit sequences it had already trained on."""
    parts, start = [], 0
    for k, size in enumerate(sizes):
        key = [seed, epoch] if k == 0 else [seed, epoch, k]
        parts.append(start + np.random.default_rng(key).permutation(size - start))
        start = size
    return np.concatenate(parts)


def block_loss(model, features, tokens, anchors, *, embed_tokens, lm_head, gamma, labels=None):
    """(sum of weighted CE, sum of weights, correct slot-1 predictions) for one sequence.
    `labels`: the label of each position (default: the tokens themselves).
    With a `SubsetHead`, labels outside its vocabulary carry no weight."""
    bs = model.args.block_size
    logits = training_logits(model, features, tokens, anchors,
                             embed_tokens=embed_tokens, lm_head=lm_head).astype(mx.float32)
    L = tokens.shape[0]
    idx = anchors[:, None] + mx.arange(1, bs)[None]
    valid = idx < L
    labels = (tokens if labels is None else labels)[mx.minimum(idx, L - 1)]
    if isinstance(lm_head, SubsetHead):
        labels = lm_head.label_map[labels]
        valid = valid & (labels >= 0)
        labels = mx.maximum(labels, 0)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    weights = mx.exp(-mx.arange(bs - 1, dtype=mx.float32) / gamma)[None] * valid
    correct = ((mx.argmax(logits[:, 0], axis=-1) == labels[:, 0]) & valid[:, 0]).sum()
    return (ce * weights).sum(), weights.sum(), correct


# ---- Checkpoints ----------------------------------------------------------------------------


def export_weights(weights: dict, inv_scale: mx.array | None) -> dict[str, mx.array]:
    """z-lab-named weights with the feature scale folded into fc (x/s then W  ==  W/s then x)."""
    weights = {k: mx.array(v) for k, v in weights.items()}
    if inv_scale is not None:
        weights["fc.weight"] = weights["fc.weight"] * inv_scale[None].astype(weights["fc.weight"].dtype)
    return weights


def export_drafter(args: DFlashConfig, weights: dict, inv_scale, target,
                   draft_vocab=None) -> DFlashDrafter:
    """An inference drafter with the given training weights (scale folded), for τ measurement;
    it drafts from `draft_vocab` (the loss vocabulary) as the written checkpoint will."""
    copy = DFlashModel(args)
    copy.load_weights(list(export_weights(weights, inv_scale).items()))
    mx.eval(copy.parameters())
    copy.eval()
    return DFlashDrafter(
        copy, embed_tokens=target_embedding(target), lm_head=target_head(target),
        final_norm=target_final_norm(target), target_layers=len(decoder_layers(target)),
        draft_vocab=draft_vocab,
    )


def write_checkpoint(out: Path, config: dict, weights: dict, inv_scale, draft_vocab=None) -> None:
    """config.json + model.safetensors (z-lab's format), and with a loss vocabulary its ids as
    the draft vocabulary: the rows the drafter learned to rank, all that drafting needs."""
    out.mkdir(parents=True, exist_ok=True)
    state = out / STATE_DIR
    state.mkdir(exist_ok=True)
    _atomic_save_safetensors(out / "model.safetensors", export_weights(weights, inv_scale),
                             tmp_dir=state)  # the temporary file must not sit beside config.json
    _atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    if draft_vocab is not None:
        write_draft_vocab(out, draft_vocab)


def write_draft_vocab(out: Path, token_ids) -> None:
    _atomic_write_text(Path(out) / DRAFT_VOCAB_FILE, draft_vocab_json(token_ids))


def package_drafter(run_dir, dest, target, *, dtype=mx.bfloat16, notes: dict | None = None) -> Path:
    """Copy a trained checkpoint into `dest` as a shippable drafter: config.json, the weights in
    `dtype` (bf16 halves the size; loading casts to the target's dtype), its draft vocabulary if
    any, and target.json, which names the target it was trained for (sizes and embedding
    checksum) so that `--drafter dflash` finds it for that target only."""
    from ..drafters.dflash import embedding_checksum

    run_dir, dest = Path(run_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in mx.load(str(run_dir / "model.safetensors")).items()}
    _atomic_save_safetensors(dest / "model.safetensors", weights)
    config = json.loads((run_dir / "config.json").read_text())
    config["torch_dtype"] = {mx.bfloat16: "bfloat16", mx.float16: "float16"}.get(dtype, "float32")
    _atomic_write_text(dest / "config.json", json.dumps(config, indent=2) + "\n")
    vocab_file = run_dir / DRAFT_VOCAB_FILE
    if vocab_file.is_file():
        _atomic_write_text(dest / DRAFT_VOCAB_FILE, vocab_file.read_text())
    else:  # a drafter trained on the full vocabulary drafts from all of it
        (dest / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    hidden, vocab, layers = target_sizes(target)
    _atomic_write_text(dest / "target.json", json.dumps({
        "hidden_size": hidden, "vocab_size": vocab, "num_layers": layers,
        "embedding_checksum": embedding_checksum(target), **(notes or {}),
    }, indent=2) + "\n")
    return dest


# ---- τ on held-out prompts ---------------------------------------------------------------------


def heldout_tau(target, drafter, prompts: list[list[int]], *, tokenizer=None,
                max_tokens: int = 64) -> float:
    """Tokens per target pass over all held-out prompts, by the real loop (greedy, full blocks).

    With a tokenizer this is `mlxspec.stream_generate` (stops at eos); without one the engine's
    `speculative_tokens` with an `MLXTarget`, the loop stream_generate wraps.
    """
    generated = passes = 0
    for ids in prompts:
        if tokenizer is not None:
            from ..generate import stream_generate

            last = None
            for last in stream_generate(target, tokenizer, ids, max_tokens, drafter=drafter,
                                        adaptive=False):
                pass
            generated += last.tau * last.target_passes
            passes += last.target_passes
        else:
            from ..engine import SpecStats, speculative_tokens
            from ..mlx_backend import MLXTarget
            from ..sampling import SamplingConfig

            stats = SpecStats()
            for _ in speculative_tokens(
                MLXTarget(target, capture_layers=drafter.capture_layers, speculative=True),
                drafter, ids, sampling=SamplingConfig(), max_tokens=max_tokens,
                num_draft=drafter.block_size - 1, stats=stats,
            ):
                pass
            generated += stats.generated
            passes += stats.target_passes
    return generated / passes if passes else 0.0


# ---- The trainer ------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out: Path
    step: int
    losses: list = field(default_factory=list)  # (step, loss) of this call's steps
    taus: list = field(default_factory=list)  # (step, τ)
    block_tokens_per_s: float = 0.0
    loss_vocab_share: float | None = None  # of the answer tokens, with a loss vocabulary


def _save_tree(path: Path, tree, tmp_dir: Path) -> None:
    flat = dict(tree_flatten(tree))
    _atomic_save_safetensors(path, flat or {"__empty__": mx.zeros(1)}, tmp_dir=tmp_dir)


def _load_tree(path: Path):
    flat = mx.load(str(path))
    flat.pop("__empty__", None)
    return tree_unflatten(list(flat.items()))


class FittedSchedule:
    """Warmup then cosine decay, whose length can be set once the run knows it: `train_dflash`
    with a time budget and no step count times its warmup steps (which do not depend on the
    length) and then fits the cosine into the time left."""

    def __init__(self, lr: float, warmup: int, steps: int):
        self.lr, self.warmup = lr, warmup
        self.set_length(steps)

    def set_length(self, steps: int) -> None:
        self.steps, self._schedule = steps, _schedule(self.lr, self.warmup, steps)

    def __call__(self, step):
        return self._schedule(step)


def _schedule(lr: float, warmup: int, steps: int, min_ratio: float = 0.1):
    warmup = max(min(warmup, steps - 1), 0)
    decay = optim.cosine_decay(lr, max(steps - warmup, 1), lr * min_ratio)
    if warmup == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(lr * 0.01, lr, warmup), decay], [warmup])


def _resolve_target(target, tokenizer):
    if target is None or isinstance(target, (str, os.PathLike)):
        from ..loading import load

        model, tok = load(target)
        return model, tokenizer if tokenizer is not None else tok
    return target, tokenizer


def prepare_data(target, tokenizer, prompts, data_dir, *, responses="target",
                 max_new_tokens=256, max_prompt_tokens=512, num_prompts=None, heldout=8, seed=0,
                 generator=None, generate_batch_size=32, progress=True):
    """(store, train examples, held-out examples): the training sequences in `data_dir`, made
    (or completed, after an interruption or with more prompts) from `prompts`. Responses come
    from `generator` (default: the target itself; a torch copy of the same weights is faster
    batched on CPU)."""
    examples = load_examples(prompts, num_prompts)
    train_examples, heldout_examples = split_heldout(examples, heldout, seed)
    if not train_examples:
        raise ValueError("no training prompts")
    meta = {
        "target": [target_sizes(target), float(target_embedding(target).weight[:8].sum().item())],
        "source": prompts if isinstance(prompts, str) else fingerprint(examples),
        "responses": responses, "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens, "heldout": heldout, "seed": seed,
    }
    if not isinstance(prompts, str):
        meta["source"] = fingerprint(train_examples[:1])  # stable as the list grows
    store = SequenceStore(data_dir, meta=meta)
    build_sequences(store, generator if generator is not None else target, tokenizer,
                    train_examples, responses=responses, max_new_tokens=max_new_tokens,
                    max_prompt_tokens=max_prompt_tokens, batch_size=generate_batch_size,
                    progress=progress)
    return store, train_examples, heldout_examples


class MLXDFlashTraining:
    """The tensor math of training on MLX: features, one optimizer step, optimizer state.
    (The torch twin is mlxspec.torch_backend.dflash_training; the loop is `train_dflash`.)"""

    def __init__(self, target, args: DFlashConfig, weights: dict, *, schedule, weight_decay,
                 grad_clip, gamma, loss_ids, inv_scale, labels="text"):
        self.target, self.args, self.gamma, self.grad_clip = target, args, gamma, grad_clip
        self.inv_scale, self.target_labels = inv_scale, labels == "target"
        self.model = DFlashModel(args)
        self.model.load_weights(list(weights.items()))
        mx.eval(self.model.parameters())
        self.embed = target_embedding(target)
        head = target_head(target)
        _, vocab, _ = target_sizes(target)
        self.head = SubsetHead(head, loss_ids, vocab) if loss_ids is not None else head
        self.optimizer = optim.AdamW(schedule, weight_decay=weight_decay, bias_correction=True)
        self.optimizer.init(self.model.trainable_parameters())
        self._grad = nn.value_and_grad(self.model, self._loss)

    def features(self, tokens: list[int]):
        """(features, labels by position): the target's predictions, or None (`block_loss`'s
        default: the tokens themselves)."""
        ids = self.args.target_layer_ids
        labels = None
        if self.target_labels:
            feats, predicted = target_features(self.target, tokens, ids, predictions=True)
            labels = mx.array(shifted_labels(tokens, predicted), dtype=mx.int32)
        else:
            feats = target_features(self.target, tokens, ids)
        return (feats * self.inv_scale if self.inv_scale is not None else feats), labels

    def features_batch(self, sequences: list[list[int]]) -> list[tuple]:
        """`features` of each sequence, one at a time (the MLX step loops over them too)."""
        return [self.features(tokens) for tokens in sequences]

    def _loss(self, batch):
        total = weight = correct = 0
        for (feats, labels), tokens, chosen in batch:
            t, w, c = block_loss(self.model, feats, mx.array(tokens, dtype=mx.int32),
                                 mx.array(chosen, dtype=mx.int32), embed_tokens=self.embed,
                                 lm_head=self.head, gamma=self.gamma, labels=labels)
            total, weight, correct = total + t, weight + w, correct + c
        return total / weight, correct

    def step(self, batch) -> tuple[float, int]:
        (loss, correct), grads = self._grad(batch)
        if self.grad_clip:
            grads, _ = optim.clip_grad_norm(grads, self.grad_clip)
        self.optimizer.update(self.model, grads)
        mx.eval(loss, correct, self.model.parameters(), self.optimizer.state)
        return loss.item(), int(correct.item())

    def weights(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.parameters()))

    def save_optimizer(self, state_dir: Path) -> None:
        _save_tree(state_dir / "optimizer.safetensors", self.optimizer.state, state_dir)

    def load_optimizer(self, state_dir: Path) -> None:
        self.optimizer.state = _load_tree(state_dir / "optimizer.safetensors")


def train_dflash(
    target,
    prompts,
    out,
    *,
    tokenizer=None,
    layers: int | None = None,
    block_size: int = 16,
    target_layer_ids=None,
    steps: int | None = None,
    resume: bool = False,
    lr: float = 6e-4,
    warmup: int | None = None,
    weight_decay: float = 0.01,
    grad_clip: float = 1.0,
    anchors: int = 64,
    batch_size: int = 1,
    gamma: float | None = None,
    max_seq_len: int = 1024,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    num_prompts: int | None = None,
    heldout: int = 8,
    eval_every: int = 200,
    eval_max_tokens: int = 64,
    eval_prompts: int | None = None,
    save_every: int = 50,
    responses: str = "target",
    labels: str = "text",
    data_dir=None,
    init: str = "target",
    normalize_features: bool = True,
    mask_token_id: int | None = None,
    drafter_overrides: dict | None = None,
    seed: int = 0,
    stop_after: int | None = None,
    minutes: float | None = None,
    loss_vocab: int | None = None,
    init_final_norm: bool = False,
    backend: str = "mlx",
    torch_target=None,
    device=None,
    generator=None,
    generate_batch_size: int = 32,
    progress: bool = True,
) -> TrainResult:
    """Train (or with `resume`, continue training) a DFlash drafter for `target`; the checkpoint
    in `out` (config.json + model.safetensors) is loadable by `load_dflash_drafter`.

    target: an mlx-lm model (with `tokenizer` for text prompts), or a model path / repo id /
    None (the default SmolLM2) to load. prompts: "sharegpt", a .jsonl/.txt path, or a list of
    strings or token-id lists (token ids need no tokenizer). Responses ("target": the target's
    greedy answers; "conversation": the data's real answers) are cached in `data_dir` (default
    out/data) and reused or continued by later calls. `steps` is the schedule's length (default
    1000; a resume keeps its run's); `stop_after` stops early at that step (as an interruption
    would, after saving); `minutes` stops (saved) after the step that ends past that much training
    time, for a machine lent for a fixed time, keeping the schedule, so a resume carries on along
    it. `minutes` without `steps` fits the schedule to the time: the warmup steps are timed and
    the cosine gets the steps the time left allows (evaluations on the way shorten it).
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
    `backend="torch"`: the training steps run in torch on `torch_target` (the same weights as a
    transformers model, `mlxspec.load(..., backend="torch")`; ~2.5x faster on this CPU, and CUDA
    with `device`); the checkpoint, the data and the held-out τ (measured on the MLX target)
    are the same. A run resumes on the backend it started with.
    """
    out = Path(out).expanduser()
    state_dir = out / STATE_DIR
    if backend not in ("mlx", "torch"):
        raise ValueError(f"backend must be 'mlx' or 'torch', got {backend!r}")
    if labels not in ("text", "target"):
        raise ValueError(f"labels must be 'text' or 'target', got {labels!r}")
    if gamma is not None and not gamma > 0:
        raise ValueError(f"gamma (the slot weights' decay) must be > 0, got {gamma}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if minutes is not None and not minutes > 0:
        raise ValueError(f"minutes (the training time budget) must be > 0, got {minutes}")
    if resume and not (state_dir / "state.json").is_file():
        raise FileNotFoundError(f"{out} has no training state to resume ({STATE_DIR}/state.json)")
    if steps is None and resume:
        steps = json.loads((state_dir / "state.json").read_text())["steps"]
    fit_to_time = steps is None and minutes is not None
    if steps is None:
        steps = FIT_HORIZON if fit_to_time else 1000
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if stop_after is not None and not 0 <= stop_after <= steps:
        raise ValueError(f"stop_after must be within 0..steps ({steps}), got {stop_after}")
    start_from = None
    if init not in ("target", "random"):
        start_from = Path(init).expanduser()
        if not (start_from / "config.json").is_file():
            raise ValueError(f"init must be 'target', 'random' or a DFlash checkpoint directory; "
                             f"{init!r} has no config.json")
    if not resume and (state_dir / "state.json").is_file():
        raise FileExistsError(f"{out} already holds a training run; pass resume=True to continue it")
    continued = out if resume else start_from  # a drafter whose config already exists
    if layers is not None and continued is not None:
        have = json.loads((continued / "config.json").read_text())["num_hidden_layers"]
        if layers < have:
            raise ValueError(f"{continued} holds a {have}-layer drafter; layers can be added "
                             f"to it, not removed (got layers={layers})")

    if backend == "torch" and torch_target is None:
        if target is not None and not isinstance(target, (str, os.PathLike)):
            raise ValueError("backend='torch' needs torch_target=, the target loaded with "
                             "mlxspec.load(..., backend='torch')")
        from ..loading import load

        torch_target = load(target, backend="torch", device=device, torch_dtype="float32")[0]
    target, tokenizer = _resolve_target(target, tokenizer)

    # -- data: held-out prompts for τ, training sequences in the store
    store, train_examples, heldout_examples = prepare_data(
        target, tokenizer, prompts, data_dir or out / "data", responses=responses,
        max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
        num_prompts=num_prompts, heldout=heldout, seed=seed, generator=generator,
        generate_batch_size=generate_batch_size, progress=progress)
    _, vocab, num_layers = target_sizes(target)
    train_ids = trainable_ids(store, max_seq_len)
    if not train_ids:
        raise ValueError("no training sequence has a response to learn from")
    heldout_prompts = [encode_prompt(tokenizer, p)[-max_prompt_tokens:]
                       for p, _ in heldout_examples[:eval_prompts]]

    # -- configuration, weights, optimizer
    if resume:
        config = json.loads((out / "config.json").read_text())
        state = json.loads((state_dir / "state.json").read_text())
        if state.get("backend", "mlx") != backend:
            raise ValueError(f"{out} was trained with backend={state.get('backend', 'mlx')!r}; "
                             f"resume it with that backend (the optimizer state is per backend)")
        if state.get("labels", "text") != labels:
            raise ValueError(f"{out} was trained with labels={state.get('labels', 'text')!r}; "
                             f"resume it with the same labels")
    elif start_from is not None:  # continue a trained drafter (its config wins)
        config = json.loads((start_from / "config.json").read_text())
        config["torch_dtype"] = "float32"
        check_against_target(DFlashConfig.from_dict(config), target)
    else:
        mask_id = mask_token_id if mask_token_id is not None else default_mask_token_id(tokenizer, vocab)
        config = drafter_config_for(target, layers=layers or 1, block_size=block_size,
                                    target_layer_ids=target_layer_ids, mask_token_id=mask_id,
                                    overrides=drafter_overrides)
    args = DFlashConfig.from_dict(config)
    ids = args.target_layer_ids
    bs = args.block_size
    if gamma is None:  # a resumed run keeps its own unless told otherwise
        gamma = state["gamma"] if resume else default_gamma(bs)
    warmup = warmup if warmup is not None else min(100, steps // 10)
    schedule = FittedSchedule(lr, warmup, steps)
    vocab_file = state_dir / "loss_vocab.safetensors"
    scale_file = state_dir / "feature_scale.safetensors"
    if resume:
        weights = dict(mx.load(str(state_dir / "params.safetensors")))
        loss_ids = mx.load(str(vocab_file))["ids"].tolist() if vocab_file.is_file() else None
        inv_scale = mx.load(str(scale_file)).get("inv_scale")
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        step, epoch, cursor = state["step"], state["epoch"], state["cursor"]
        epoch_sizes = state.get("epoch_sizes", [len(train_ids)])  # older states: no growth
        if len(train_ids) < epoch_sizes[-1]:
            raise ValueError(f"{out} was training on {epoch_sizes[-1]} sequences and the data "
                             f"now holds {len(train_ids)}; resume with at least as many prompts")
        if len(train_ids) > epoch_sizes[-1]:  # the store grew: new sequences join this epoch
            epoch_sizes = epoch_sizes + [len(train_ids)]
    else:
        mx.random.seed(seed)
        fresh = DFlashModel(args)
        if init == "target":
            init_from_target(fresh, target, final_norm=init_final_norm)
        weights = dict(tree_flatten(fresh.parameters()))
        if start_from is not None:
            weights = {k: v.astype(mx.float32) for k, v in read_weights(start_from).items()}
            check_weights(args, weights)
        loss_ids = None
        if loss_vocab and loss_vocab < vocab:
            loss_ids = frequent_tokens((store[i] for i in train_ids), vocab, loss_vocab,
                                       always=eos_ids(tokenizer))
        inv_scale = None
        if normalize_features:
            if backend == "torch":  # the backend that trains computes its own features
                from ..torch_backend.dflash_training import target_features as torch_features

                def raw_features(tokens):
                    return mx.array(torch_features(torch_target, tokens, ids)[0].cpu().numpy())
            else:
                def raw_features(tokens):
                    return target_features(target, tokens, ids)
            sq, count = 0.0, 0
            for i in train_ids[:16]:
                f = raw_features(store[i][0][:max_seq_len])
                sq = sq + (f.astype(mx.float32) ** 2).sum(axis=0)
                count += f.shape[0]
            inv_scale = 1.0 / mx.maximum(mx.sqrt(sq / count), 1e-3)
            mx.eval(inv_scale)
            if start_from is not None:  # its fc has a scale folded in: train on the unfolded one
                weights["fc.weight"] = weights["fc.weight"] / inv_scale[None]
        rng = np.random.default_rng(seed)
        step, epoch, cursor = 0, 0, 0
        epoch_sizes = [len(train_ids)]
        state = {"log": []}
    if continued is not None and layers is not None and layers > args.num_hidden_layers:
        # New layers start with no AdamW moments. torch counts steps per parameter, so their
        # bias correction starts afresh; MLX's AdamW has one step count, so on MLX their first
        # few hundred updates are larger (up to ~6x, for a steady gradient) than a fresh one's.
        donors = growth_donors(target, args.num_hidden_layers, layers)
        config, weights = grow_drafter(config, weights, layers, donors)
        args = DFlashConfig.from_dict(config)
    options = dict(schedule=schedule, weight_decay=weight_decay,
                   grad_clip=grad_clip, gamma=gamma, loss_ids=loss_ids, inv_scale=inv_scale,
                   labels=labels)
    if backend == "mlx":
        math = MLXDFlashTraining(target, args, weights, **options)
    elif backend == "torch":
        from ..torch_backend.dflash_training import TorchDFlashTraining

        math = TorchDFlashTraining(torch_target, args, weights, device=device, **options)
    else:
        raise ValueError(f"backend must be 'mlx' or 'torch', got {backend!r}")
    if resume:
        math.load_optimizer(state_dir)

    def save():
        state_dir.mkdir(parents=True, exist_ok=True)
        current = math.weights()
        write_checkpoint(out, config, current, inv_scale, draft_vocab=loss_ids)
        _atomic_save_safetensors(state_dir / "params.safetensors", current, tmp_dir=state_dir)
        math.save_optimizer(state_dir)
        _atomic_write_text(state_dir / "state.json", json.dumps({
            "step": step, "epoch": epoch, "cursor": cursor, "epoch_sizes": epoch_sizes,
            "rng": rng.bit_generator.state,
            "steps": schedule.steps, "seed": seed, "anchors": anchors, "batch_size": batch_size,
            "gamma": gamma, "lr": lr, "backend": backend, "loss_vocab": loss_vocab,
            "max_seq_len": max_seq_len,
            "labels": labels,
            "log": state["log"],
        }, indent=1))

    def next_sequence():
        nonlocal epoch, cursor, epoch_sizes
        order = epoch_order(seed, epoch, epoch_sizes)
        i = train_ids[int(order[cursor])]
        cursor += 1
        if cursor == len(order):
            epoch, cursor, epoch_sizes = epoch + 1, 0, [len(train_ids)]
        return i

    def make_batch():
        sequences, chosen, used = [], [], []
        for _ in range(batch_size):
            used.append(next_sequence())
            tokens, prompt_len = store[used[-1]]
            sequences.append(tokens[:max_seq_len])
            chosen.append(sample_anchors(rng, prompt_len, len(sequences[-1]), anchors))
        batch = list(zip(math.features_batch(sequences), sequences, chosen))
        return batch, sum(len(c) for c in chosen) * bs, used

    result = TrainResult(out=out, step=step)
    if loss_ids is not None:
        result.loss_vocab_share = answer_share((store[i] for i in train_ids), loss_ids, vocab)
    last_tau = next((e["tau"] for e in reversed(state["log"]) if "tau" in e), None)
    end = min(steps, stop_after) if stop_after is not None else steps
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=step, desc="train dflash", unit="step")
    timed_tokens, step_seconds = 0, []
    deadline = None if minutes is None else time.monotonic() + 60 * minutes
    fit_at = step + max(warmup, FIT_MIN_STEPS)  # the step after which the cosine is fitted
    try:
        if not resume:  # the loss vocabulary and feature scale are fixed for the whole run
            state_dir.mkdir(parents=True, exist_ok=True)
            if loss_ids is not None:
                _atomic_save_safetensors(vocab_file, {"ids": mx.array(loss_ids, dtype=mx.int32)})
            _atomic_save_safetensors(scale_file, {"inv_scale": inv_scale} if inv_scale is not None
                                     else {"__none__": mx.zeros(1)})
            save()
        while step < end:
            t0 = time.perf_counter()
            batch, n_tokens, used = make_batch()
            loss, correct = math.step(batch)
            seconds = time.perf_counter() - t0
            step += 1
            timed_tokens += n_tokens
            step_seconds.append(seconds)
            if fit_to_time and step == fit_at:  # the warmup is timed: fit the rest into the time
                per_step = float(np.median(step_seconds[len(step_seconds) // 2:]))
                left = max(deadline - time.monotonic(), 0.0)
                schedule.set_length(step + max(int(left / per_step), 1))
                end = min(schedule.steps, stop_after) if stop_after is not None else schedule.steps
                fit_to_time = False
                if bar:
                    bar.total = schedule.steps
            entry = {"step": step, "sequences": used, "loss": round(loss, 5),
                     "block_tokens_per_s": round(n_tokens / seconds, 1),
                     "slot1_acc": round(correct / max(n_tokens // bs, 1), 4),
                     "trained_blocks": (state["log"][-1]["trained_blocks"] if state["log"] else 0)
                     + n_tokens // bs}
            result.losses.append((step, loss))
            if eval_every and heldout_prompts and (step % eval_every == 0 or step == end):
                drafter = export_drafter(args, math.weights(), inv_scale, target,
                                         draft_vocab=loss_ids)
                last_tau = heldout_tau(target, drafter, heldout_prompts, tokenizer=tokenizer,
                                       max_tokens=eval_max_tokens)
                entry["tau"] = round(last_tau, 4)
                result.taus.append((step, last_tau))
            state["log"].append(entry)
            if bar:
                postfix = {"loss": f"{loss:.3f}", "tok/s": f"{n_tokens / seconds:.0f}"}
                if last_tau is not None:
                    postfix["tau"] = f"{last_tau:.2f}"
                bar.set_postfix(postfix)
                bar.update(1)
            out_of_time = deadline is not None and time.monotonic() > deadline
            if out_of_time and fit_to_time:  # the time ran out within the warmup: it ends here
                schedule.set_length(step)
            if step % save_every == 0 or step == end or out_of_time:
                save()
            if out_of_time:
                break
    finally:
        if bar:
            bar.close()
    result.step = step
    result.block_tokens_per_s = timed_tokens / sum(step_seconds) if step_seconds else 0.0
    return result
