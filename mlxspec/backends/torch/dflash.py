"""DFlash in torch: the drafter module, ported from our MLX one (mlxspec.models.dflash), same
math and same released checkpoint format (z-lab's safetensors names, config.json read by the
same DFlashConfig), and the tensor math under the shared drafting (drafters.dflash).

N Qwen3-style layers fill a block [last token, MASK, ...] in one pass. Target features (outputs
of `target_layer_ids`) are fused by `fc` + `hidden_norm` into one context vector per committed
position; each layer projects it with its own k/v weights, so context exists only as K/V, kept
in a per-layer cache at their true positions. Block K/V are transient.
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...drafters.dflash import DFlashDrafting, read_checkpoint
from ...file_checks import check_safetensors, safetensors_files
from ...models.dflash import DFlashConfig, check_weight_shapes, context_window
from .target import decoder_layers, model_device, target_sizes
from .transfer import host_tokens


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_inverse_frequencies(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim/2,), position scale) for mlx-lm's initialize_rope types
    default, linear and llama3 (NeoX style, traditional=False)."""
    base, kind = float(rope["rope_theta"]), rope.get("rope_type", "default")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    if kind in ("default", "linear"):
        scale = 1.0 / rope["factor"] if kind == "linear" else 1.0
        return 1.0 / base**exponents, scale
    if kind == "llama3":
        factor = rope["factor"]
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old_len = rope.get("original_max_position_embeddings", 8192)
        periods = base**exponents
        wavelens = 2 * math.pi * periods
        periods = torch.where(wavelens > old_len / low, periods * factor, periods)
        medium = (wavelens > old_len / high) & (wavelens < old_len / low)
        smooth = (old_len / wavelens - low) / (high - low)
        smoothed = periods / ((1 - smooth) / factor + smooth)
        return 1.0 / torch.where(medium, smoothed, periods), 1.0
    raise ValueError(f"DFlash rope_type {kind!r} is not supported by the torch backend yet")


class RoPE:
    """RoPE at absolute positions offset .. offset+L-1, computed in float32: rotate-half (NeoX),
    or `traditional`, rotating interleaved pairs (GPT-J; LFM2.5's DSpark)."""

    def __init__(self, head_dim: int, rope: dict, traditional: bool = False):
        self.inv_freq, self.scale = rope_inverse_frequencies(head_dim, rope)
        self.traditional = traditional
        self._on: dict = {}

    def __call__(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        """(B, heads, L, head_dim) -> same shape."""
        inv_freq = self._on.get(x.device)
        if inv_freq is None:
            inv_freq = self._on[x.device] = self.inv_freq.to(x.device)
        L = x.shape[-2]
        positions = (offset + torch.arange(L, device=x.device, dtype=torch.float32)) * self.scale
        angles = positions[:, None] * inv_freq[None]  # (L, head_dim/2)
        cos, sin = angles.cos(), angles.sin()
        xf = x.float()
        if self.traditional:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            turned = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
            return turned.flatten(-2).to(x.dtype)
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def block_mask(start: int, num_ctx: int, length: int, *, causal: bool, window: int | None, device):
    """(length, num_ctx + length) bool visibility by absolute position, or None (see all).
    Context keys sit at positions start-num_ctx .. start-1, block slot i at start+i."""
    if not causal and window is None:
        return None
    query = start + torch.arange(length, device=device)[:, None]
    key = start - num_ctx + torch.arange(num_ctx + length, device=device)[None]
    visible = torch.ones((length, num_ctx + length), dtype=torch.bool, device=device)
    if causal:
        visible = visible & (key <= query)
    if window is not None:
        visible = visible & (query - key < window)
        if not causal:
            visible = visible & (key - query < window)
    return visible


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
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        sliding = layer_type == "sliding_attention"
        self.is_causal = sliding if args.is_causal is None else bool(args.is_causal)
        self.window = context_window(args.sliding_window if sliding else None, args)

    def keys_values(self, x: torch.Tensor, rope: RoPE, offset: int):
        """(B, L, H) -> rotated keys and values, each (B, kv_heads, L, head_dim)."""
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).view(B, L, self.n_kv_heads, -1))
        values = self.v_proj(x).view(B, L, self.n_kv_heads, -1)
        return rope(keys.transpose(1, 2), offset), values.transpose(1, 2)

    def forward(self, x, rope: RoPE, start: int, context: tuple | None) -> torch.Tensor:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).view(B, L, self.n_heads, -1))
        queries = rope(queries.transpose(1, 2), start)  # (B, heads, L, head_dim)
        keys, values = self.keys_values(x, rope, start)
        num_ctx = 0
        if context is not None:
            ctx_keys, ctx_values = context
            if self.window is not None:  # the first block slot sees only the last window-1
                ctx_keys = ctx_keys[..., -(self.window - 1) :, :]
                ctx_values = ctx_values[..., -(self.window - 1) :, :]
            num_ctx = ctx_keys.shape[2]
            keys = torch.cat([ctx_keys, keys], dim=2)
            values = torch.cat([ctx_values, values], dim=2)
        repeat = self.n_heads // self.n_kv_heads  # query head h reads kv head h // repeat
        if repeat > 1:
            keys = keys.repeat_interleave(repeat, dim=1)
            values = values.repeat_interleave(repeat, dim=1)
        mask = block_mask(start, num_ctx, L, causal=self.is_causal, window=self.window,
                          device=x.device)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                             scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: DFlashConfig, layer_type: str):
        super().__init__()
        self.self_attn = Attention(args, layer_type)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, rope, start, context):
        return self.around(x, lambda n: self.self_attn(n, rope, start, context))

    def around(self, x, attend):
        """The layer around an attention `attend` (normed input -> output), as on MLX: one body
        for every block drafter (DFlash2 wraps each sublayer in its convolutions)."""
        h = x + attend(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class ContextKV:
    """One layer's context K/V, (1, kv_heads, S, head_dim), grown in steps like mlx-lm's KVCache."""

    step = 256

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor):
        end = self.offset + keys.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            size = -(-end // self.step) * self.step
            grown_k = keys.new_empty((*keys.shape[:2], size, keys.shape[3]))
            grown_v = values.new_empty((*values.shape[:2], size, values.shape[3]))
            if self.keys is not None:
                grown_k[:, :, : self.offset] = self.keys[:, :, : self.offset]
                grown_v[:, :, : self.offset] = self.values[:, :, : self.offset]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self.offset : end] = keys
        self.values[:, :, self.offset : end] = values
        self.offset = end
        return self.keys_and_values()

    def keys_and_values(self):
        return self.keys[:, :, : self.offset], self.values[:, :, : self.offset]

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


class DFlashModel(nn.Module):
    """The drafter. `own_embed`/`own_head`: the checkpoint carries embed_tokens/lm_head."""

    layer_class = DecoderLayer

    def __init__(self, args: DFlashConfig, *, own_embed: bool = False, own_head: bool = False):
        super().__init__()
        self.args = args
        H = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, args.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(args, t) for t in args.layer_types)
        self.norm = RMSNorm(H, args.rms_norm_eps)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        if own_head:
            self.lm_head = nn.Linear(H, args.vocab_size, bias=False)
        self.rope = RoPE(args.head_dim, args.rope,
                         traditional=not getattr(args, "rope_is_neox_style", True))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def make_cache(self) -> list[ContextKV]:
        return [ContextKV() for _ in self.layers]

    def append_context(self, features: torch.Tensor, cache: list[ContextKV]) -> None:
        """Append target features (S, n_ids * H) of the next S committed positions."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)[None]))  # (1, S, H)
        offset = cache[0].offset
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.keys_values(ctx, self.rope, offset))

    def forward(self, embeddings: torch.Tensor, cache: list[ContextKV]) -> torch.Tensor:
        """Block embeddings (B, L, H) at positions offset..offset+L-1 -> normed hidden (B, L, H)."""
        start = cache[0].offset
        h = embeddings.to(self.dtype)
        for layer, c in zip(self.layers, cache):
            context = c.keys_and_values() if c.offset else None
            h = layer(h, self.rope, start, context)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor, head) -> torch.Tensor:
        """z-lab's head: the LM head, times output_multiplier, then optional tanh softcap."""
        logits = head(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits


class TorchDFlashDrafter(DFlashDrafting):
    """DFlashDrafting with torch's tensor math, under inference mode, on the model's device."""

    backend = "torch"

    def __init__(self, model: DFlashModel, **options):
        self.device = model.fc.weight.device
        super().__init__(model, **options)

    begin = torch.inference_mode()(DFlashDrafting.begin)
    commit = torch.inference_mode()(DFlashDrafting.commit)
    propose = torch.inference_mode()(DFlashDrafting.propose)
    block_logits = torch.inference_mode()(DFlashDrafting.block_logits)
    block_hidden = torch.inference_mode()(DFlashDrafting.block_hidden)
    _propose_tree = torch.inference_mode()(DFlashDrafting._propose_tree)

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return host_tokens(tokens, self.device)[None]

    def _head_rows(self, head, ids: torch.Tensor):
        bias = getattr(head, "bias", None)
        return _WeightHead(head.weight[ids].detach(), None if bias is None else bias[ids].detach())

    def _concat(self, parts) -> torch.Tensor:
        return torch.cat(parts, dim=-1)

    def _rows(self, parts) -> torch.Tensor:
        return torch.cat(parts, dim=0)

    def _in_head_dtype(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.lm_head.weight.dtype)

    def _best(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.argmax(logits, dim=-1)

    def _best_rows(self, logits: torch.Tensor, width: int) -> tuple[list, list]:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        scores, best = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
        ids = best if self.draft_ids is None else self.draft_ids[best]
        return scores.tolist(), ids.tolist()

    def _host_lists(self, *arrays) -> list:
        return [a.tolist() for a in arrays]  # a CPU copy each: the first waits for the stream


# ---- Checkpoint files and the target's side --------------------------------------------------


def read_weights(path: Path, device) -> dict[str, torch.Tensor]:
    """All tensors of the directory's *.safetensors files (pickle checkpoints never load)."""
    from safetensors.torch import load_file

    files = safetensors_files(path)
    check_safetensors(files)
    weights = {}
    for f in files:
        weights.update(load_file(str(f), device=str(device)))
    return weights


def build_checked(args: DFlashConfig, weights: dict[str, torch.Tensor],
                  model_class: type = DFlashModel) -> DFlashModel:
    """The `model_class` model (DFlashModel's or a kind's) the weights describe, loaded; names
    any missing, wrong-shaped or unexpected weight as mlxspec.models.dflash.check_weights does."""
    with torch.device("meta"):  # shapes only: the checkpoint's tensors are assigned below
        model = model_class(args, own_embed="embed_tokens.weight" in weights,
                            own_head="lm_head.weight" in weights)
    check_weight_shapes(args, {name: p.shape for name, p in model.state_dict().items()}, weights)
    model.load_state_dict(weights, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def final_norm_of(model):
    inner = getattr(model, "model", model)
    return getattr(inner, "norm", None)


def load_dflash_drafter(path, *, model, tokenizer=None, block_size: int | None = None,
                        draft_vocab: bool = True, tree_budget: int | None = None,
                        tree_width: int = 4, window: int | None = None):
    """Load a DFlash checkpoint for a transformers target `model` (see the MLX loader); the
    drafter runs on the target's device, in the target's dtype. `tree_budget`: draft a DDTree of
    up to this many nodes from each block's `tree_width` best tokens per slot."""
    path, args, options = read_checkpoint(path, target_sizes(model), block_size=block_size,
                                          draft_vocab=draft_vocab, tree_budget=tree_budget,
                                          tree_width=tree_width, window=window)
    drafter_model, parts = load_checked_model(path, args, model)
    return TorchDFlashDrafter(drafter_model, **parts, **options)


def load_checked_model(path, args, model, model_class: type = DFlashModel):
    """A block drafter's torch model (`model_class`, DFlashModel by default) with its checked
    weights on the target's device and in its dtype, and the target's parts it drafts with
    (drafters.dflash.load_checked_model on MLX)."""
    device = model_device(model)
    drafter_model = build_checked(args, read_weights(path, device), model_class)
    drafter_model.to(device=device, dtype=next(model.parameters()).dtype)
    embed = getattr(drafter_model, "embed_tokens", None)
    head = getattr(drafter_model, "lm_head", None)
    if head is None and embed is not None and args.tie_word_embeddings:
        head = _WeightHead(embed.weight)
    return drafter_model, dict(
        embed_tokens=embed if embed is not None else model.get_input_embeddings(),
        lm_head=head if head is not None else model.get_output_embeddings(),
        final_norm=final_norm_of(model),
        target_layers=len(decoder_layers(model)),
    )


class _WeightHead(nn.Module):
    """An LM head from a weight matrix: a tied embedding's, or a head's draft-vocabulary rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)
