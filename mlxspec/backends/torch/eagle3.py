"""EAGLE-3 on the torch backend: models.eagle3's drafter built from transformers' blocks, driven
by the MLX drafter's host side (drafters.eagle3.Eagle3Drafting) with torch tensor math.

Shared with MLX, not ported: the config (models.eagle3.Eagle3Config, both published layouts),
every checkpoint check in its order (drafters.eagle3_loading.read_checkpoint: config against
the target before any weight is read, names and shapes, d2t), and the drafter's bookkeeping
(committed pairs, cutting chain and tree entries, the chain, EAGLE-2's tree grown, re-ranked
and numbered). Weights load under the same names (`layers.0.*`).

The layer is transformers' Llama layer but for the width of q/k/v: LlamaRMSNorm, LlamaMLP,
LlamaRotaryEmbedding (every rope type transformers knows) and LlamaAttention (Qwen3Attention
for a qwen3 layer, which adds q_norm/k_norm) whose q/k/v projections are swapped for ones
reading 2H = [normed embedding; normed hidden]. Building transformers' attention rather than
writing one keeps head layout, GQA, q/k norms, RoPE application and the attention kernel
transformers' own; only the 2H-wide input is EAGLE-3's. The draft cache is a DynamicCache, cut
back with crop after verification. Every pass of more than one entry hands the attention an
explicit additive mask (causal after the cache, or a tree's ancestors), so nothing depends on
how a kernel aligns is_causal with a cache; SDPA is used whatever the target's attention is,
since flash-attention kernels take no such mask.
"""

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from ...drafters.eagle3 import Eagle3Drafting, check_tree_options
from ...drafters.eagle3_loading import read_checkpoint, use_target_parts
from ...drafters.paired import PairedDrafting
from ...models.eagle3 import Eagle3Config
from ...sampling import SamplingConfig
from .arrays import TorchArrays
from .dflash import _WeightHead, block_mask, read_weights
from .sampling import categorical, processed_logprobs
from .target import additive, cache_length, crop, decoder_layers, model_device, target_sizes
from .window import window_mask


def layer_config(args: Eagle3Config) -> LlamaConfig:
    """The transformers config of the drafter's decoder layer, as its blocks read it."""
    config = LlamaConfig(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads, head_dim=args.head_dim,
        rms_norm_eps=args.rms_norm_eps, vocab_size=args.vocab_size, num_hidden_layers=1,
        max_position_embeddings=args.max_position_embeddings, hidden_act="silu",
        attention_bias=args.attention_bias, mlp_bias=args.mlp_bias,
        rope_parameters=dict(args.rope),
    )
    config._attn_implementation = "sdpa"  # adds our 4D masks as given
    return config


def wide_attention(config: LlamaConfig, qk_norm: bool) -> nn.Module:
    """transformers' attention whose q/k/v projections read 2H inputs; o_proj writes H."""
    attention = (Qwen3Attention if qk_norm else LlamaAttention)(config, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        narrow = getattr(attention, name)
        setattr(attention, name, nn.Linear(2 * config.hidden_size, narrow.out_features,
                                           bias=narrow.bias is not None))
    return attention


class DecoderLayer(nn.Module):
    """models.eagle3.DecoderLayer: attention over [input_layernorm(embedding);
    hidden_norm(hidden)], residual `hidden` (normed with norm_before_residual), Llama's MLP."""

    def __init__(self, args: Eagle3Config, config: LlamaConfig):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.norm_before_residual = args.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.self_attn = wide_attention(config, args.qk_norm)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, rotation, mask, cache) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attended = self.self_attn(x, rotation, mask, cache)[0]
        h = (normed if self.norm_before_residual else hidden) + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    """models.eagle3.Eagle3Model in torch: the same parameter names, the same calls (which
    Eagle3Drafting makes). `own_embed`/`own_head`: the checkpoint carries embed_tokens/lm_head;
    else the target's are used (use_embedding, use_head), held outside this module's state."""

    def __init__(self, args: Eagle3Config, *, own_embed: bool = True, own_head: bool = True):
        super().__init__()
        self.args = args
        config = layer_config(args)
        H, eps = args.hidden_size, args.rms_norm_eps
        fc_in = args.num_aux_layers * args.target_hidden_size
        if args.norm_before_fc:
            self.input_norm = LlamaRMSNorm(fc_in, eps=eps)
        self.fc = nn.Linear(fc_in, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(args, config)])
        self.norm = LlamaRMSNorm(H, eps=eps)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        if own_head:
            self.lm_head = nn.Linear(H, args.draft_vocab_size, bias=False)
        with torch.device("cpu"):  # real frequencies even when built on "meta" for shapes
            self.rotary = LlamaRotaryEmbedding(config)
        self._borrowed = {}  # the target's embedding and head, when the checkpoint has none
        self.d2t = None  # target id = draft id + d2t[draft id]; None: the target's vocabulary

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def use_embedding(self, embedding) -> None:
        self._borrowed["embed"] = embedding

    def use_head(self, head) -> None:
        self._borrowed["head"] = head

    @staticmethod
    def make_cache() -> DynamicCache:
        return DynamicCache()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens if hasattr(self, "embed_tokens") else self._borrowed["embed"]
        return embed(tokens).to(self.dtype)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (..., num_aux * H_t) -> the drafter's hidden (..., H)."""
        x = features.to(self.dtype)
        if hasattr(self, "input_norm"):
            x = self.input_norm(x)
        return self.fc(x)

    def forward(self, tokens, hidden, cache, *, mask=None, positions=None) -> torch.Tensor:
        """models.eagle3.Eagle3Model.__call__: tokens (B, L) and hidden (B, L, H) -> the
        layer's output (B, L, H), L entries appended to `cache`. Pair i sits at position i+1;
        a tree's entries bring `positions` (L,) and a bool `mask` (L, cached + L). A drafter
        window (backends.torch.window.window_mask) masks what lies beyond it."""
        h = hidden.to(self.dtype)
        past, L = cache_length(cache), tokens.shape[1]
        window, tree = self.args.context_window, positions is not None
        if not tree:
            positions = torch.arange(past + 1, past + 1 + L, device=h.device)
            if L > 1 or window is not None:
                mask = block_mask(past, past, L, causal=True, window=None, device=h.device)
        if window is not None:
            mask = window_mask(past, positions, mask, window)
        rotation = self.rotary(h, positions[None])
        return self.layers[0](self.embed(tokens), h, rotation, additive(mask, self.dtype), cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (..., draft_vocab) of layer outputs (..., H)."""
        head = self.lm_head if hasattr(self, "lm_head") else self._borrowed["head"]
        return head(self.norm(hidden))

    def target_ids(self) -> torch.Tensor:
        """The target id of every draft-vocabulary row, (draft_vocab,)."""
        rows = torch.arange(self.args.draft_vocab_size, device=self.fc.weight.device)
        return rows if self.d2t is None else rows + self.d2t


class TorchPairedDrafting(PairedDrafting):
    """PairedDrafting's tensor math in torch (drafters.paired.MLXPairedDrafting's twin), under
    inference mode, on the model's device: shared by the EAGLE-3 and the MTP drafter."""

    backend = "torch"

    def __init__(self, model, **options):
        self.xp = TorchArrays(model_device(model))
        super().__init__(model, **options)

    begin = torch.inference_mode()(PairedDrafting.begin)
    commit = torch.inference_mode()(PairedDrafting.commit)
    propose = torch.inference_mode()(PairedDrafting.propose)
    chain_logits = torch.inference_mode()(PairedDrafting.chain_logits)
    tree_candidates = torch.inference_mode()(PairedDrafting.tree_candidates)

    def _cache_length(self) -> int:
        return cache_length(self.cache)

    def _cut(self, n: int) -> None:
        crop(self.cache, n)

    def _draw(self, logits: torch.Tensor, sampling: SamplingConfig):
        if sampling.greedy:
            return torch.argmax(logits), None
        p = processed_logprobs(logits, sampling).exp()
        return categorical(p), self._over_target_vocab(p)

    def _best_children(self, hidden: torch.Tensor, width: int, sampling: SamplingConfig):
        logits = self.model.logits(hidden).float()
        logprobs = (torch.log_softmax(logits, dim=-1) if sampling.greedy
                    else processed_logprobs(logits, sampling))
        rows = torch.argsort(logprobs, dim=-1, descending=True, stable=True)[:, :width]
        return logprobs.gather(-1, rows).clamp_max(0.0), self._target_id(rows)

    def _over_target_vocab(self, p: torch.Tensor) -> torch.Tensor:
        """(draft_vocab,) probabilities -> (target_vocab,), zero outside the draft vocabulary."""
        if self.hot_ids is None:
            return p
        return p.new_zeros(self.target_vocab).index_add(0, self.hot_ids, p)


class TorchEagle3Drafter(Eagle3Drafting, TorchPairedDrafting):
    """Eagle3Drafting with torch's tensor math."""


def _meta_model(args: Eagle3Config, own_embed: bool, own_head: bool):
    """The model, its parameters shapes only (the checkpoint's tensors are assigned later)."""
    with torch.device("meta"):
        model = Eagle3Model(args, own_embed=own_embed, own_head=own_head)
    return model, {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex
                or tensor.dtype == torch.bool)


def load_eagle3_drafter(path, *, model, tokenizer=None, tree_budget: int | None = None,
                        tree_width: int = 4, tree_depth: int = 6,
                        window: int | None = None) -> TorchEagle3Drafter:
    """Load an EAGLE-3 checkpoint directory (speculators or SpecForge/SGLang layout) for a
    transformers target `model`, checked against it before any weight loads, exactly as the
    MLX loader checks it; the drafter runs on the target's device, in the target's dtype.
    `tree_budget`: draft EAGLE-2's dynamic tree of up to this many nodes, `tree_width`
    children per node and `tree_depth` levels, instead of a chain. `window`: as the MLX
    loader's."""
    check_tree_options(tree_budget, tree_width, tree_depth)
    device, dtype, sizes = model_device(model), model.dtype, target_sizes(model)
    args, drafter, weights, d2t = read_checkpoint(
        path, sizes, read_tensors=lambda p: read_weights(p, device), build=_meta_model,
        is_integer=_is_integer, window=window)
    weights = {n: w.to(dtype) if w.is_floating_point() else w for n, w in weights.items()}
    drafter.load_state_dict(weights, strict=True, assign=True)
    drafter.rotary.to(device)
    drafter.d2t = None if d2t is None else d2t.to(device=device, dtype=torch.long)
    use_target_parts(args, drafter, own_embed="embed_tokens.weight" in weights,
                     own_head="lm_head.weight" in weights,
                     embedding=model.get_input_embeddings(), head=model.get_output_embeddings(),
                     as_head=lambda embedding: _WeightHead(embedding.weight))
    drafter.eval().requires_grad_(False)
    return TorchEagle3Drafter(drafter, num_target_layers=len(decoder_layers(model)),
                              target_vocab=sizes.vocab_size, tree_budget=tree_budget,
                              tree_width=tree_width, tree_depth=tree_depth)
