"""Tiny random targets that ship MTP modules, written in their published Hugging Face layout.

Built from mlx-lm's own classes (the target, and the MTP module's decoder layer as its index
makes it), then written under the names and conventions the published checkpoints use, so
the real converter and loader run: Qwen3.5's `model.language_model.*` with zero-centred norms
and (C, 1, K) convolutions beside top-level `mtp.*`; DeepSeek-V3's per-expert `mlp.experts.N.*`
and unsplit MLA `kv_b_proj`, with its MTP module at `model.layers.{num_hidden_layers}`.
Every MTP norm is drawn away from its neutral value, so a convention that is wrong shows.
"""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

QWEN_SIZES = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                  max_position_embeddings=256, full_attention_interval=2,
                  tie_word_embeddings=False,
                  # as Qwen3.5 publishes it: interleaved multimodal rope, half of head_dim
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0],
                                   "mrope_interleaved": True})

DEEPSEEK_SIZES = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                      moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4,
                      n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                      routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=None,
                      qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8,
                      topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                      n_group=1, topk_group=1, moe_layer_freq=1, first_k_dense_replace=1,
                      max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                      rope_scaling=None, attention_bias=False, tie_word_embeddings=False)


def _randomize(module, key: int, *, norm_spread: float = 0.3, sharpness: float = 1.0):
    """Draw every parameter: matrices N(0, 1/fan_in) (the MoE router too, which mlx-lm starts at
    zero), norms 1 + N(0, norm_spread), other vectors small; the head scaled by `sharpness`."""
    mx.random.seed(key)
    params = {}
    for name, value in tree_flatten(module.parameters()):
        if value.ndim >= 2:
            new = mx.random.normal(value.shape) / (value.shape[-1] ** 0.5)
            if name.endswith(("lm_head.weight", "embed_tokens.weight")):
                new = new * sharpness * (value.shape[-1] ** 0.5 if "embed" in name else 1)
        elif name.endswith("norm.weight") or "layernorm" in name:
            new = 1.0 + norm_spread * mx.random.normal(value.shape)
        elif name.endswith("A_log"):
            new = value
        else:
            new = 0.1 * mx.random.normal(value.shape)
        params[name] = new.astype(value.dtype)
    module.update(tree_unflatten(list(params.items())))
    mx.eval(module.parameters())


def _copy_tokenizer(tokenizer_dir: Path | None, out: Path) -> None:
    if tokenizer_dir is None:
        return
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)


_QWEN_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                      ".q_norm.weight", ".k_norm.weight", "model.norm.weight", "mtp.norm.weight",
                      "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def write_qwen3_5(out, *, vocab: int = 49152, seed: int = 0, mtp: bool = True,
                  tokenizer_dir=None, sharpness: float = 1.0, **sizes) -> Path:
    """A tiny dense Qwen3.5 (Gated DeltaNet + attention) as Qwen publishes it, with one MTP
    module of one full-attention layer (15 `mtp.*` tensors) unless `mtp` is False; `sizes`
    override QWEN_SIZES."""
    from mlx_lm.models import qwen3_5

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = dict(model_type="qwen3_5_text", vocab_size=vocab, **{**QWEN_SIZES, **sizes},
                mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    mx.random.seed(seed)  # mlx-lm's own A_log draws, kept: the same files for the same seed
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({**text, "model_type": "qwen3_5"}))
    _randomize(model, seed, norm_spread=0.0, sharpness=sharpness)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        name = name.replace("language_model.model.", "model.language_model.")
        name = name.replace("language_model.lm_head", "lm_head")
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)  # mlx-lm's (C, K, 1) -> published (C, 1, K)
        weights[name] = value
    if mtp:
        text_args = model.language_model.args
        layer = qwen3_5.DecoderLayer(text_args, text_args.full_attention_interval - 1)
        _randomize(layer, seed + 1)
        for name, value in tree_flatten(layer.parameters()):
            weights[f"mtp.layers.0.{name}"] = value
        h = text["hidden_size"]
        mx.random.seed(seed + 2)
        weights["mtp.fc.weight"] = mx.random.normal((h, 2 * h)) / (2 * h) ** 0.5
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            weights[f"mtp.{name}.weight"] = 1.0 + 0.3 * mx.random.normal((h,))
    for name in weights:  # published: (1 + w) norms stored as w
        if name.endswith(_QWEN_ZERO_CENTRED) and weights[name].ndim == 1:
            weights[name] = weights[name] - 1.0
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "tie_word_embeddings": False, "text_config": text}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(tokenizer_dir, out)
    return out


def unstacked(name: str, value: mx.array) -> dict[str, mx.array]:
    """mlx-lm's stacked experts (switch_mlp) one by one, as checkpoints store them."""
    if ".switch_mlp." not in name:
        return {name: value}
    prefix, rest = name.split(".switch_mlp.")
    return {f"{prefix}.experts.{e}.{rest}": value[e] for e in range(value.shape[0])}


def _deepseek_published(name: str, value: mx.array) -> dict[str, mx.array]:
    """One mlx-lm deepseek_v3 tensor -> its published name(s): experts one by one, MLA's
    kv_b_proj whole (mlx-lm splits it into embed_q and unembed_out)."""
    if name.endswith(("self_attn.embed_q.weight", "self_attn.unembed_out.weight")):
        return {}  # joined back into kv_b_proj by the caller
    return unstacked(name, value)


def _v3_module_parts(weights: dict, prefix: str, hidden: int, seed: int) -> None:
    """A DeepSeek-layout module's own tensors around its layer: eh_proj, the three norms drawn
    away from 1, and the copies of the target's head and embedding it ships."""
    mx.random.seed(seed)
    weights[prefix + "eh_proj.weight"] = mx.random.normal((hidden, 2 * hidden)) / (2 * hidden) ** 0.5
    for name in ("enorm", "hnorm", "shared_head.norm"):
        weights[prefix + f"{name}.weight"] = 1.0 + 0.3 * mx.random.normal((hidden,))
    weights[prefix + "shared_head.head.weight"] = weights["lm_head.weight"]
    weights[prefix + "embed_tokens.weight"] = weights["model.embed_tokens.weight"]


def _kv_b_proj(attention) -> mx.array:
    """(heads * (nope + v), kv_lora): mlx-lm's embed_q (heads, kv_lora, nope) and unembed_out
    (heads, v, kv_lora) joined back as the published projection."""
    wk = attention.embed_q.weight.swapaxes(-1, -2)  # (heads, nope, kv_lora)
    wv = attention.unembed_out.weight
    joined = mx.concatenate([wk, wv], axis=1)
    return joined.reshape(-1, joined.shape[-1])


def write_deepseek_v3(out, *, vocab: int = 49152, seed: int = 0, mtp: bool = True,
                      tokenizer_dir=None, sharpness: float = 1.0, **sizes) -> Path:
    """A tiny DeepSeek-V3 (MLA attention; layer 0 dense, layer 1 MoE) as DeepSeek publishes it,
    with its MTP module at `model.layers.2` (MoE, with enorm, hnorm, eh_proj, shared_head and
    the copy of the embedding) unless `mtp` is False."""
    from mlx_lm.models import deepseek_v3

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {**DEEPSEEK_SIZES, **sizes}
    config = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                  vocab_size=vocab, num_nextn_predict_layers=1 if mtp else 0, **settings)
    args = deepseek_v3.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = deepseek_v3.Model(args)
    _randomize(model, seed, norm_spread=0.0, sharpness=sharpness)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        weights.update(_deepseek_published(name, value))
    for i, layer in enumerate(model.model.layers):
        weights[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = _kv_b_proj(layer.self_attn)
    if mtp:
        n = args.num_hidden_layers
        layer = deepseek_v3.DeepseekV3DecoderLayer(args, n)
        _randomize(layer, seed + 1)
        prefix = f"model.layers.{n}."
        for name, value in tree_flatten(layer.parameters()):
            weights.update(_deepseek_published(prefix + name, value))
        weights[prefix + "self_attn.kv_b_proj.weight"] = _kv_b_proj(layer.self_attn)
        _v3_module_parts(weights, prefix, settings["hidden_size"], seed + 2)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(tokenizer_dir, out)
    return out


GLM_SIZES = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                 moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                 routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
                 first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6,
                 rope_theta=10000.0, rope_scaling=None, use_qk_norm=True, attention_bias=True,
                 partial_rotary_factor=0.5, tie_word_embeddings=False)


def write_glm4_moe(out, *, vocab: int, seed: int = 0, sharpness: float = 1.0) -> Path:
    """A tiny GLM-4.5 (GQA with q/k norms and biases, partial rotary; layer 1 MoE) with its MTP
    module at `model.layers.2`, laid out as DeepSeek-V3's."""
    from mlx_lm.models import glm4_moe

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=vocab,
                  num_nextn_predict_layers=1, **GLM_SIZES)
    args = glm4_moe.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model, layer = glm4_moe.Model(args), glm4_moe.DecoderLayer(args, args.num_hidden_layers)
    _randomize(model, seed, norm_spread=0.0, sharpness=sharpness)
    _randomize(layer, seed + 1)
    prefix = f"model.layers.{args.num_hidden_layers}."
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        weights.update(unstacked(name, value))
    for name, value in tree_flatten(layer.parameters()):
        weights.update(unstacked(prefix + name, value))
    _v3_module_parts(weights, prefix, args.hidden_size, seed + 2)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
