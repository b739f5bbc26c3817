"""DFlash: a block-diffusion drafter conditioned on target hidden states (z-lab, 2026).

N Qwen3-style layers fill a whole block [last token, MASK, ...] in one pass. The target's
features (outputs of `target_layer_ids`) are fused by `fc` + `hidden_norm` into one context
vector per committed position; every layer projects that context with its own k/v weights, so
context exists only as K/V. Block queries see the context and the block; "sliding_attention"
layers are causal inside the block and windowed over the context.

The context K/V of committed positions are computed once and kept in a per-layer cache (rotated
at their true positions); block K/V are transient. Embedding and LM head are the target's unless
the checkpoint ships its own. Weight names are z-lab's safetensors names (no `model.` prefix).
"""

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..checkpoint_checks import check_checkpoint_config
from ..file_checks import check_safetensors, read_json, safetensors_files

ARCHITECTURE = "DFlashDraftModel"
# The block drafters whose checkpoints look alike (config.json with target_layer_ids and a
# mask token, no embedding of their own): which --drafter loads each architecture.
BLOCK_DRAFTERS = {
    "DFlashDraftModel": "dflash",
    "DFlash2DraftModel": "dflash2",
    "Qwen3DSparkModel": "dspark",
    "Gemma4DSparkModel": "dspark",
    "Lfm2DSparkDraftModel": "dspark",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys z-lab reads from `dflash_config` first, then from the top level of config.json.
_DRAFT_KEYS = (
    "target_layer_ids",
    "block_size",
    "mask_token_id",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: evenly spaced between layer 1 and layer T-3 (Python round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    # Defaults are transformers' Qwen3Config ones, which z-lab's reference inherits.
    num_key_value_heads: int | None = None
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    is_causal: bool | None = None
    # Not a checkpoint key: mlxspec's --drafter-window, the most context positions (with the
    # block slot's own) any layer sees, a window over the full-attention layers too.
    context_window: int | None = None
    tie_word_embeddings: bool = False
    architectures: list = field(default_factory=list)
    num_target_layers: int | None = None
    target_layer_ids: list | None = None
    block_size: int = 16
    mask_token_id: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, params: dict) -> "DFlashConfig":
        """Read a released config.json: `dflash_config` entries win, unknown keys are ignored."""
        params = dict(params)
        draft = params.get("dflash_config") or {}
        params.update({k: draft[k] for k in cls.draft_keys if k in draft})
        names = inspect.signature(cls).parameters
        required = [n for n, p in names.items() if p.default is inspect.Parameter.empty]
        missing = [n for n in required if n not in params]
        if missing:
            raise ValueError(f"DFlash config.json lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in params.items() if k in names})

    architecture: ClassVar[str] = ARCHITECTURE
    kind: ClassVar[str] = "dflash"  # the --drafter that loads it
    draft_keys: ClassVar[tuple[str, ...]] = _DRAFT_KEYS

    def __post_init__(self):
        other = next((a for a in self.architectures or []
                      if BLOCK_DRAFTERS.get(a, self.kind) != self.kind), None)
        if other is not None:
            raise ValueError(f"the checkpoint is a {other}, not a {self.architecture}: load it "
                             f"with --drafter {BLOCK_DRAFTERS[other]}")
        if self.hidden_act != "silu":
            raise ValueError(f"DFlash drafter hidden_act {self.hidden_act!r} is not supported")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        # As transformers' Qwen3Config, which z-lab's reference builds on: the window applies
        # only with use_sliding_window, and absent layer_types derive from max_window_layers.
        if not self.use_sliding_window:
            self.sliding_window = None
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention"
                if self.sliding_window is not None and i >= self.max_window_layers
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported DFlash layer types {unknown}")
        if self.target_layer_ids is None:
            if self.num_target_layers is None:
                raise ValueError("config needs dflash_config.target_layer_ids or num_target_layers")
            self.target_layer_ids = build_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.mask_token_id is None:
            raise ValueError("config has no dflash_config.mask_token_id")
        self.mask_token_id = int(self.mask_token_id)
        self.block_size = int(self.block_size)
        if self.block_size < 2:
            raise ValueError(f"config block_size must be >= 2, got {self.block_size}")

    @property
    def rope(self) -> dict:
        """One rope dict: rope_scaling or rope_parameters; its rope_theta wins (transformers 5)."""
        rope = dict(self.rope_scaling or self.rope_parameters or {})
        if rope and set(rope) <= set(self.layer_types):
            raise ValueError("per-layer-type rope parameters are not supported")
        rope.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else 10000.0)
        rope.setdefault("rope_type", rope.get("type", "default"))
        return rope


def rope_for(args):
    """mlx-lm's RoPE module for a drafter config's one rope dict (`args.rope`: its type, theta
    and scaling), as DFlash and EAGLE-3 drafters both use it."""
    traditional = not getattr(args, "rope_is_neox_style", True)  # LFM2.5's DSpark: interleaved
    return initialize_rope(args.head_dim, args.rope["rope_theta"], traditional=traditional,
                           scaling_config=args.rope,
                           max_position_embeddings=args.max_position_embeddings)


class Attention(nn.Module):
    """Queries from the block; keys/values from [context ; block] with the same weights."""

    def __init__(self, args: DFlashConfig, layer_type: str):
        super().__init__()
        dim, bias = args.hidden_size, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        sliding = layer_type == "sliding_attention"
        self.is_causal = sliding if args.is_causal is None else bool(args.is_causal)
        self.window = context_window(args.sliding_window if sliding else None, args)

    def keys_values(self, x: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        """(B, L, H) -> rotated keys and values, each (B, kv_heads, L, head_dim)."""
        keys, values = self._keys_values(x)
        return rope(keys, offset=offset), values

    def _keys_values(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(B, L, H) -> keys (not yet rotated) and values, each (B, kv_heads, L, head_dim)."""
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1))
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        return keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)

    def _queries(self, x: mx.array) -> mx.array:
        """(B, L, H) -> queries (not yet rotated), (B, heads, L, head_dim)."""
        B, L, _ = x.shape
        return self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, rope, start: int, context: tuple | None) -> mx.array:
        B, L, _ = x.shape
        queries = rope(self._queries(x), offset=start)
        keys, values = self.keys_values(x, rope, start)
        out = self._attend(queries, keys, values, start, context)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def rows(self, x: mx.array, rope, rows: list[tuple[int, int, tuple | None]]) -> mx.array:
        """Several sequences' blocks at once, x (B, L, H): row i's block is its first n_i
        slots, at positions start_i.., attending to its own context, for rows[i] =
        (start_i, n_i, context_i). The projections run batched (one read of the weights);
        RoPE and attention run per row, as `__call__` runs them. Slots past n_i are zeros."""
        B, L, _ = x.shape
        queries = self._queries(x)
        keys, values = self._keys_values(x)
        outs = []
        for i, (start, n, context) in enumerate(rows):
            out = self._attend(rope(queries[i : i + 1, :, :n], offset=start),
                               rope(keys[i : i + 1, :, :n], offset=start),
                               values[i : i + 1, :, :n], start, context)
            outs.append(mx.pad(out, [(0, 0), (0, 0), (0, L - n), (0, 0)]) if n < L else out)
        out = mx.concatenate(outs)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _attend(self, queries, keys, values, start: int, context: tuple | None) -> mx.array:
        """Rotated block queries/keys/values (B, heads, L, head_dim) attending to
        [context ; block] -> (B, heads, L, head_dim)."""
        L = queries.shape[2]
        num_ctx = 0
        if context is not None:
            ctx_keys, ctx_values = context
            if self.window is not None:  # the first block slot sees only the last window-1
                ctx_keys = ctx_keys[..., -(self.window - 1) :, :]
                ctx_values = ctx_values[..., -(self.window - 1) :, :]
            num_ctx = ctx_keys.shape[2]
            keys = mx.concatenate([ctx_keys, keys], axis=2)
            values = mx.concatenate([ctx_values, values], axis=2)
        mask = block_mask(start, num_ctx, L, causal=self.is_causal, window=self.window)
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )


def context_window(window: int | None, args: DFlashConfig) -> int | None:
    """A layer's window, narrowed to the drafter window where one is set (either backend)."""
    if args.context_window is None:
        return window
    return args.context_window if window is None else min(window, args.context_window)


def block_mask(start: int, num_ctx: int, length: int, *, causal: bool, window: int | None):
    """(length, num_ctx + length) bool visibility by absolute position, or None (see all).

    Context keys sit at positions start-num_ctx .. start-1, block slot i at start+i.
    """
    if not causal and window is None:
        return None
    query = start + mx.arange(length)[:, None]
    key = start - num_ctx + mx.arange(num_ctx + length)[None]
    visible = mx.ones((length, num_ctx + length), dtype=mx.bool_)
    if causal:
        visible = visible & (key <= query)
    if window is not None:
        visible = visible & (query - key < window)
        if not causal:
            visible = visible & (key - query < window)
    return visible


def training_mask(anchors: mx.array, block_size: int, seq_len: int, *, causal: bool = False,
                  window: int | None = None) -> mx.array:
    """(N, bs, seq_len + bs) bool: what slot i of the block at anchor a sees.

    Keys are the context positions 0..seq_len-1 followed by the block's own slots. Context p is
    visible iff p < a (strictly before the anchor); other blocks are not keys at all. Causal
    ("sliding_attention") layers see slots j <= i; a window keeps keys with |q - k| < window,
    by absolute position (query a+i), as `block_mask` does at inference.
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


class DecoderLayer(nn.Module):
    def __init__(self, args: DFlashConfig, layer_type: str):
        super().__init__()
        self.self_attn = Attention(args, layer_type)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, rope, start, context):
        return self.around(x, lambda n: self.self_attn(n, rope, start, context))

    def rows(self, x, rope, rows):
        return self.around(x, lambda n: self.self_attn.rows(n, rope, rows))

    def around(self, x, attend):
        """The layer around an attention `attend` (normed input -> output): the inference
        paths' and training's (mlxspec.training.dflash_trainer), one body for every kind."""
        h = x + attend(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter. `own_embed`/`own_head`: the checkpoint carries embed_tokens/lm_head."""

    layer_class = DecoderLayer

    def __init__(self, args: DFlashConfig, *, own_embed: bool = False, own_head: bool = False):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, t) for t in args.layer_types]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        if own_head:
            self.lm_head = nn.Linear(H, args.vocab_size, bias=False)
        self.rope = rope_for(args)

    @property
    def dtype(self) -> mx.Dtype:
        return self.fc.weight.dtype

    def make_cache(self) -> list[KVCache]:
        """One context K/V cache per layer; trimmable, so a caller can roll positions back."""
        return [KVCache() for _ in self.layers]

    def append_context(self, features: mx.array, cache: list[KVCache]) -> None:
        """Append target features (S, n_ids * H) of the next S committed positions."""
        ctx = self.hidden_norm(self.fc(features.astype(self.dtype)[None]))  # (1, S, H)
        offset = cache[0].offset
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.keys_values(ctx, self.rope, offset))

    def __call__(self, embeddings: mx.array, cache: list[KVCache]) -> mx.array:
        """Block embeddings (B, L, H) at positions offset..offset+L-1 -> normed hidden (B, L, H)."""
        start = cache[0].offset
        h = embeddings.astype(self.dtype)
        for layer, c in zip(self.layers, cache):
            context = c.keys_and_values() if c.offset else None
            h = layer(h, self.rope, start, context)
        return self.norm(h)

    def rows(self, embeddings: mx.array, caches: list[list[KVCache]],
             lengths: list[int]) -> mx.array:
        """Several sequences' blocks in one pass: embeddings (B, L, H), row i's block its first
        lengths[i] slots after its own context caches[i] -> normed hidden (B, L, H), each row
        as `__call__` would give it alone (slots past lengths[i] are not)."""
        h = embeddings.astype(self.dtype)
        for j, layer in enumerate(self.layers):
            rows = [(c[j].offset, n, c[j].keys_and_values() if c[j].offset else None)
                    for c, n in zip(caches, lengths)]
            h = layer.rows(h, self.rope, rows)
        return self.norm(h)

    def compute_logits(self, hidden: mx.array, head) -> mx.array:
        """z-lab's head: the LM head, times output_multiplier, then optional tanh softcap."""
        logits = head(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = mx.tanh(logits / cap) * cap
        return logits


# ---- Checkpoint files -------------------------------------------------------------------------


def read_config(path: Path) -> dict:
    """config.json, its numbers checked against the weights' headers (check_checkpoint_config)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json; it is not a DFlash checkpoint")
    return check_checkpoint_config(config_path)


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(path: Path, vocab_size: int) -> list[int] | None:
    """The checkpoint's draft vocabulary, or None when it has none (z-lab's checkpoints don't).

    draft_vocab.json, {"token_ids": [...]}, lists the tokens a drafter trained with a reduced
    loss vocabulary learned to rank; drafting from their head rows only skips the cost of the
    rest (the head is most of a drafter pass for a small target with a large vocabulary).
    Kept out of *.safetensors so that engines reading z-lab's format see only z-lab's names.
    """
    file = Path(path) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    data = read_json(file)
    try:
        ids = data["token_ids"]
    except (KeyError, TypeError) as err:
        raise ValueError(
            f'{file} is not a draft vocabulary ({{"token_ids": [...]}}): {err}'
        ) from None
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise ValueError(f"{file}: token_ids must be a non-empty list of integers")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{file}: token ids {bad[:5]} outside the vocabulary of {vocab_size}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{file}: token_ids repeats some ids")
    return sorted(ids)


def draft_vocab_json(token_ids) -> str:
    """The text of draft_vocab.json for `token_ids` (what read_draft_vocab reads)."""
    return json.dumps({"token_ids": sorted(int(i) for i in token_ids)}) + "\n"


def read_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of the directory's *.safetensors files (pickle checkpoints never load)."""
    files = safetensors_files(path)
    check_safetensors(files)
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def check_weights(args: DFlashConfig, weights: dict[str, mx.array],
                  model_class: type = DFlashModel) -> DFlashModel:
    """Build the model the weights describe; name any missing, wrong-shaped or unexpected one."""
    model = model_class(
        args,
        own_embed="embed_tokens.weight" in weights,
        own_head="lm_head.weight" in weights,
    )
    check_weight_shapes(args, {name: p.shape for name, p in tree_flatten(model.parameters())},
                        weights)
    return model


def check_weight_shapes(args: DFlashConfig, expected: dict[str, tuple], weights: dict) -> None:
    """One line naming every missing, wrong-shaped or unexpected tensor of either backend's
    `weights`, against the parameter shapes `expected` of the model config.json describes."""
    expected = {name: tuple(shape) for name, shape in expected.items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [
        f"{n} has shape {tuple(weights[n].shape)}, config.json implies {expected[n]}"
        for n in sorted(set(expected) & set(weights))
        if tuple(weights[n].shape) != expected[n]
    ]
    problems = []
    if missing:
        problems.append(f"missing weights: {', '.join(missing)}")
    if wrong:
        problems.append("wrong-shaped weights: " + "; ".join(wrong))
    if unexpected:
        problems.append(f"unexpected weights: {', '.join(unexpected)}")
    if problems:
        raise ValueError(
            f"{type(args).__name__.removesuffix('Config')} checkpoint does not match its "
            f"config.json (hidden {args.hidden_size}, "
            f"{args.num_hidden_layers} layers): " + ". ".join(problems)
        )


def load_model(path: Path) -> tuple[DFlashModel, dict[str, Any]]:
    """Read, check and load a checkpoint directory; returns (model, raw config dict)."""
    raw = read_config(path)
    args = DFlashConfig.from_dict(raw)
    weights = read_weights(path)
    model = check_weights(args, weights)
    model.load_weights(list(weights.items()))
    model.eval()
    return model, raw
