"""EAGLE-3: a one-layer drafter conditioned on three target layers (Li et al., 2025).

The target's features at position i (outputs of three of its layers, concatenated: 3 x H_t) are
fused by `fc` into one vector g_i of the drafter's width H. The drafter's single decoder layer
reads the pair (token i+1, g_i): its attention takes [input_layernorm(embed(token));
hidden_norm(g_i)] (2H wide) as queries, keys and values, the residual is g_i (its normed form
with `norm_before_residual`), then post_attention_layernorm + MLP as in Llama. The layer's
output h_i (before `norm`) is what the next step conditions on: `lm_head(norm(h_i))` ranks the
draft vocabulary for token i+2, and for the steps after that (no target features exist yet) h_i
itself takes g's place, at the next position, with the drafted token. Draft ids map to target
ids as `target = draft + d2t[draft]`.

One KV cache holds committed pairs and the chain's own steps, or a draft tree's entries (a
drafter trims the latter after verification). Pair i sits at position i+1, the position of the
token it embeds, as mlx-vlm's and speculators' drafters place it (RoPE only sees differences,
so the shift changes nothing but rounding). Weight names are the speculators layout's
(`layers.0.*`); the loader (mlxspec/drafters/eagle3_loading.py) renames SpecForge/SGLang's
`midlayer.*`.
"""

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from ..backends.mlx.tree_pass import TreeRoPE
from ..backends.mlx.window import window_mask
from .dflash import rope_for

LAYOUTS = ("speculators", "specforge")
# transformers' config defaults for the layer types a published drafter names: what a config
# that leaves a key out means (speculators serialises transformer_layer_config as a diff).
_LAYER_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0,
              "num_key_value_heads": None, "head_dim": None},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
              "num_key_value_heads": 32, "head_dim": 128},
}
SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass
class Eagle3Config:
    """Both published layouts in one form.

    `aux_layer_ids` are kept as the checkpoint writes them; `capture_layers(L)` turns them into
    the 0-based decoder layers whose outputs the target must hand over (mlxspec's capture):
    speculators/vLLM ids count hidden states (id j = the input of layer j = the output of layer
    j-1, 0 = the embedding), SpecForge's `eagle_config` ids count layer outputs (SGLang adds 1
    to reach its own input-of-layer capture). Absent ids mean [2, L/2, L-3] in hidden-state
    counting (vLLM's, SGLang's and speculators' default), i.e. outputs of [1, L/2-1, L-4].
    """

    layout: str
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary: rows of embed_tokens
    draft_vocab_size: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    target_hidden_size: int
    layer_type: str = "llama"  # "qwen3" adds q_norm/k_norm
    attention_bias: bool = False
    mlp_bias: bool = False
    num_aux_layers: int = 3
    aux_layer_ids: list | None = None
    aux_ids_count_outputs: bool = False  # True for SpecForge's eagle_config ids
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    tie_word_embeddings: bool = False
    num_speculative_tokens: int | None = None
    # Not a checkpoint key: mlxspec's --drafter-window, the most cache entries (its own
    # included) an entry attends to, so a step's cost stops growing with the context.
    context_window: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def qk_norm(self) -> bool:
        return self.layer_type == "qwen3"

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """0-based target decoder layers whose outputs make the features, in fc's order."""
        L = int(num_target_layers)
        if self.aux_layer_ids is None:
            return (1, L // 2 - 1, L - 4)
        if self.aux_ids_count_outputs:
            return tuple(self.aux_layer_ids)
        return tuple(i - 1 for i in self.aux_layer_ids)

    @classmethod
    def from_dict(cls, raw: dict) -> "Eagle3Config":
        """Read a config.json in either layout; one-line ValueError for what cannot be read."""
        if not isinstance(raw, dict):
            raise ValueError("EAGLE-3 config.json must hold a JSON object")
        arch = list(raw.get("architectures") or [])
        if ("transformer_layer_config" in raw or "speculators_model_type" in raw
                or "Eagle3Speculator" in arch):
            return cls._from_speculators(raw)
        if any(a in SPECFORGE_ARCHITECTURES for a in arch):
            return cls._from_specforge(raw)
        eagle3_like = [a for a in arch if "eagle3" in a.lower()]
        if eagle3_like:
            raise ValueError(
                f"EAGLE-3 architecture {eagle3_like[0]} is not supported; supported are the "
                f"speculators layout (Eagle3Speculator) and {', '.join(SPECFORGE_ARCHITECTURES)}"
            )
        raise ValueError(
            "config.json is not an EAGLE-3 drafter config: it has neither "
            "transformer_layer_config (speculators) nor architectures "
            f"{SPECFORGE_ARCHITECTURES[0]} (SpecForge/SGLang); architectures {arch or 'absent'}"
        )

    @classmethod
    def _from_speculators(cls, raw: dict) -> "Eagle3Config":
        if raw.get("speculators_model_type", "eagle3") != "eagle3":
            raise ValueError(
                f"speculators model type {raw['speculators_model_type']!r} is not eagle3"
            )
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError("EAGLE-3 speculators config.json lacks transformer_layer_config")
        for key in ("fc_norm", "norm_output"):
            if raw.get(key):
                raise ValueError(f"EAGLE-3 option {key}=true (Eagle 3.1) is not supported")
        methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [None]
        k = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        return cls._build(
            "speculators", layer, raw,
            draft_vocab_size=raw.get("draft_vocab_size", 32000),  # speculators' default
            target_hidden_size=raw.get("target_hidden_size"),
            aux_layer_ids=ids, aux_ids_count_outputs=False,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_speculative_tokens=k,
        )

    @classmethod
    def _from_specforge(cls, raw: dict) -> "Eagle3Config":
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError("EAGLE-3 config.json: eagle_config must be an object")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError("EAGLE-3 config sets eagle_config.use_aux_hidden_state=false "
                             "(an EAGLE-1/2 style drafter), which is not supported")
        ids, outputs = eagle.get("eagle_aux_hidden_state_layer_ids"), True
        if ids is None and raw.get("eagle_aux_hidden_state_layer_ids") is not None:
            ids, outputs = raw["eagle_aux_hidden_state_layer_ids"], False  # vLLM's reading
        draft_vocab = raw.get("draft_vocab_size")
        return cls._build(
            "specforge", raw, raw,
            draft_vocab_size=raw.get("vocab_size") if draft_vocab is None else draft_vocab,
            target_hidden_size=raw.get("target_hidden_size"),
            aux_layer_ids=ids, aux_ids_count_outputs=outputs,
            norm_before_residual=bool(eagle.get("norm_before_residual",
                                                raw.get("norm_before_residual", False))),
            norm_before_fc=bool(raw.get("norm_before_fc", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_speculative_tokens=None,
        )

    @classmethod
    def _build(cls, layout: str, layer: dict, raw: dict, **top: Any) -> "Eagle3Config":
        where = "transformer_layer_config" if layout == "speculators" else "config.json"
        missing = [k for k in _REQUIRED if layer.get(k) is None]
        if missing:
            raise ValueError(f"EAGLE-3 {where} lacks {', '.join(missing)}")
        layer_type = layer.get("model_type", "llama")
        if layer_type not in _LAYER_DEFAULTS:
            raise ValueError(
                f"EAGLE-3 decoder layer type {layer_type!r} is not supported (llama, qwen3)"
            )
        defaults = _LAYER_DEFAULTS[layer_type]
        get = lambda k: layer.get(k) if layer.get(k) is not None else defaults.get(k)
        layers = int(layer.get("num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(
                f"EAGLE-3 drafters with {layers} decoder layers are not supported, only 1"
            )
        act = layer.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"EAGLE-3 drafter hidden_act {act!r} is not supported (silu)")
        if layer.get("layer_types") and set(layer["layer_types"]) != {"full_attention"}:
            raise ValueError("EAGLE-3 drafters with sliding-window layers are not supported")
        H, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        ids = top.pop("aux_layer_ids")
        if ids is not None and (not isinstance(ids, list) or not ids
                                or not all(type(i) is int for i in ids)):
            raise ValueError(
                f"EAGLE-3 eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}"
            )
        num_aux = len(ids) if ids is not None else 3
        target_hidden = top.pop("target_hidden_size")
        vocab = int(layer["vocab_size"])
        draft_vocab = int(top.pop("draft_vocab_size"))
        if not 0 < draft_vocab <= vocab:
            raise ValueError(
                f"EAGLE-3 draft_vocab_size {draft_vocab} must be between 1 and the vocabulary "
                f"size {vocab}"
            )
        return cls(
            layout=layout,
            hidden_size=H,
            num_attention_heads=heads,
            intermediate_size=int(layer["intermediate_size"]),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            num_key_value_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or H // heads),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope=_rope(layer, defaults),
            max_position_embeddings=int(get("max_position_embeddings")),
            target_hidden_size=int(target_hidden if target_hidden is not None else H),
            layer_type=layer_type,
            attention_bias=bool(layer.get("attention_bias", False)),
            mlp_bias=bool(layer.get("mlp_bias", False)),
            num_aux_layers=num_aux,
            aux_layer_ids=ids,
            raw=raw,
            **top,
        )


def _rope(layer: dict, defaults: dict) -> dict:
    """One rope dict from rope_parameters (transformers 5) or rope_scaling; rope_theta within
    wins. Qwen2.5-VL's M-RoPE sections reduce to plain RoPE for text (as SGLang does)."""
    rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    rope.setdefault("rope_theta", layer.get("rope_theta", defaults["rope_theta"]))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if "mrope_section" in rope or rope_type == "mrope":
        rope_type = "default"
    rope["rope_type"] = rope_type
    rope["rope_theta"] = float(rope["rope_theta"])
    return rope


class Attention(nn.Module):
    """Llama attention whose q/k/v read 2H = [normed embedding; normed hidden]."""

    def __init__(self, args: Eagle3Config):
        super().__init__()
        H, bias = args.hidden_size, args.attention_bias
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.head_dim**-0.5
        self.q_proj = nn.Linear(2 * H, self.n_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * H, self.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * H, self.n_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * args.head_dim, H, bias=bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)

    def project(self, x: mx.array, rope, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Rotated queries and keys, and values, (B, heads, L, head_dim), of inputs (B, L, 2H)
        (the training path builds its own attention over them: mlxspec.training.eagle3_trainer)."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q.transpose(0, 2, 1, 3), offset=offset)
        k = rope(k.transpose(0, 2, 1, 3), offset=offset)
        return q, k, v.transpose(0, 2, 1, 3)

    def output(self, out: mx.array) -> mx.array:
        """(B, heads, L, head_dim) attention outputs -> (B, L, H)."""
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def __call__(self, x: mx.array, rope, mask, cache: KVCache, offset: int) -> mx.array:
        q, k, v = self.project(x, rope, offset)
        k, v = cache.update_and_fetch(k, v)
        if isinstance(mask, mx.array) and mask.shape[-1] < k.shape[2]:  # a window's last keys
            k, v = k[..., -mask.shape[-1] :, :], v[..., -mask.shape[-1] :, :]
        return self.output(scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale,
                                                        mask=mask))


class MLP(nn.Module):
    def __init__(self, args: Eagle3Config):
        super().__init__()
        H, I, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: Eagle3Config):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.norm_before_residual = args.norm_before_residual
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = MLP(args)

    def __call__(self, embeds, hidden, rope, mask, cache, offset):
        return self.around(embeds, hidden, lambda x: self.self_attn(x, rope, mask, cache, offset))

    def around(self, embeds, hidden, attend):
        """The layer around an attention `attend(x)` of its 2H-wide input: the cached one at
        inference, one over every test-time step's keys in training."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = residual + attend(x)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    """The drafter. `own_embed`/`own_head`: the checkpoint carries embed_tokens/lm_head; a
    drafter without them reads the target's embedding (`use_embedding`) or head."""

    def __init__(self, args: Eagle3Config, *, own_embed: bool = True, own_head: bool = True):
        super().__init__()
        self.args = args
        H = args.hidden_size
        fc_in = args.num_aux_layers * args.target_hidden_size
        if args.norm_before_fc:
            self.input_norm = nn.RMSNorm(fc_in, eps=args.rms_norm_eps)
        self.fc = nn.Linear(fc_in, H, bias=False)
        self.layers = [DecoderLayer(args)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        if own_head:
            self.lm_head = nn.Linear(H, args.draft_vocab_size, bias=False)
        self._embed = None  # the target's embedding when the checkpoint has none
        self._head = None  # the target's head (or a tied embedding) when it has no lm_head
        # target id = draft id + d2t[draft id]; None: the draft vocabulary is the target's
        self._d2t = None
        self.rope = rope_for(args)

    @property
    def dtype(self) -> mx.Dtype:
        return self.fc.weight.dtype

    @property
    def d2t(self) -> mx.array | None:
        return self._d2t

    def set_d2t(self, d2t: mx.array | None) -> None:
        self._d2t = None if d2t is None else d2t.astype(mx.int32)

    def use_embedding(self, embedding) -> None:
        """Embed tokens with `embedding` (the target's), for a checkpoint without its own."""
        self._embed = embedding

    def use_head(self, head) -> None:
        """Rank with `head` (a module or callable: the target's LM head, a tied embedding's
        as_linear), for a checkpoint without lm_head."""
        self._head = head

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def embed(self, tokens: mx.array) -> mx.array:
        embed = self.get("embed_tokens", self._embed)
        if embed is None:
            raise ValueError("the EAGLE-3 drafter has no embedding: call use_embedding(target's)")
        return embed(tokens)

    def project(self, features: mx.array) -> mx.array:
        """Target features (..., num_aux * H_t) -> the drafter's hidden (..., H)."""
        x = features.astype(self.dtype)
        if "input_norm" in self:
            x = self.input_norm(x)
        return self.fc(x)

    def __call__(self, tokens: mx.array, hidden: mx.array, cache: list[KVCache], *,
                 mask: mx.array | None = None, positions: mx.array | None = None) -> mx.array:
        """Tokens (B, L) and hidden (B, L, H): projected target features, or the drafter's own
        previous output for a chain step. Appends L positions to `cache`; returns the layer's
        output (B, L, H) before `norm`, which the next step conditions on.

        Entries of a draft tree (B = 1) are not a sequence: `positions` (L,) gives each its RoPE
        position and `mask` (L, cached + L) the entries it sees, its ancestors' and its own."""
        embeds = self.embed(tokens).astype(self.dtype)
        h = hidden.astype(self.dtype)
        c, window = cache[0], self.args.context_window
        if positions is None:
            rope, offset = self.rope, c.offset + 1  # pair i embeds token i+1
            mask = create_attention_mask(h, c) if window is None else None
        else:  # the L entries rotated as L one-position sequences, one position each
            rope, offset = TreeRoPE(self.rope, positions), 0
        if window is not None:
            mask = window_mask(c.offset, h.shape[1], window, mask, positions)
        return self.layers[0](embeds, h, rope, mask, c, offset)

    def logits(self, hidden: mx.array) -> mx.array:
        """Draft-vocabulary logits (..., draft_vocab) of layer outputs (..., H)."""
        normed = self.norm(hidden)
        if "lm_head" in self:
            return self.lm_head(normed)
        if self._head is None:
            raise ValueError("the EAGLE-3 drafter has no lm_head: call use_head(target's)")
        return self._head(normed)

    def to_target(self, draft_ids: mx.array) -> mx.array:
        """Draft-vocabulary ids -> target ids (d2t holds the offsets)."""
        draft_ids = draft_ids.astype(mx.int32)
        if self._d2t is None:
            return draft_ids
        return draft_ids + self._d2t[draft_ids]

    def target_ids(self) -> mx.array:
        """The target id of every draft-vocabulary row, (draft_vocab,)."""
        return self.to_target(mx.arange(self.args.draft_vocab_size))
