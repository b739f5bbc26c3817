"""Tiny random mlx-lm models built by the tests, for properties that need no real weights."""

import mlx.core as mx
from mlx_lm.models import llama


def tiny_llama(vocab: int = 32, hidden: int = 32, layers: int = 2, seed: int = 0, sharpness=1.0):
    """A random llama; `sharpness` scales the LM head so its distributions are far from uniform."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * sharpness
    mx.eval(model.parameters())
    return model


HYBRID_SIZES = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                    max_position_embeddings=256, full_attention_interval=2)


def tiny_qwen3_next(vocab: int = 32, seed: int = 0, **sizes):
    """mlx-lm's Qwen3-Next: Gated DeltaNet layers (ArraysCache) between attention layers."""
    from mlx_lm.models import qwen3_next

    mx.random.seed(seed)
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", vocab_size=vocab, num_experts=0, num_experts_per_tok=0,
        decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[],
        moe_intermediate_size=0, rope_theta=10000.0, partial_rotary_factor=0.25,
        **{**HYBRID_SIZES, **sizes})
    model = qwen3_next.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_qwen3_5(vocab: int = 32, seed: int = 0):
    """mlx-lm's Qwen3.5 (its text model inside the multimodal wrapper), same layer pattern."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(
        dict(model_type="qwen3_5", vocab_size=vocab, **HYBRID_SIZES)))
    mx.eval(model.parameters())
    return model


def tiny_nemotron_h(vocab: int = 32, seed: int = 0):
    """mlx-lm's Nemotron-H: Mamba-2 layers (ArraysCache: convolution and SSM state), attention
    and MLP layers, in the pattern M * - M."""
    from mlx_lm.models import nemotron_h

    mx.random.seed(seed)
    args = nemotron_h.ModelArgs(
        model_type="nemotron_h", vocab_size=vocab, hidden_size=32, intermediate_size=64,
        max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=False, mamba_num_heads=4, mamba_head_dim=8, mamba_proj_bias=False,
        ssm_state_size=8, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "M"])
    model = nemotron_h.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_lfm2(vocab: int = 32, seed: int = 0):
    """mlx-lm's LFM2: gated short-convolution layers (ArraysCache: a convolution window only)
    between attention layers."""
    from mlx_lm.models import lfm2

    mx.random.seed(seed)
    args = lfm2.ModelArgs(
        model_type="lfm2", vocab_size=vocab, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=32, block_multiple_of=8,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=64,
        layer_types=["conv", "full_attention", "conv", "full_attention"])
    model = lfm2.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gemma3(vocab: int = 32, window: int = 4, seed: int = 0, sharpness: float = 1.0):
    """mlx-lm's Gemma 3 text model: sliding-window layers (RotatingKVCache in mlx-lm, of
    `window` positions) beside full-attention ones, in the pattern S F S F."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    args = gemma3_text.ModelArgs.from_dict(dict(
        model_type="gemma3_text", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab,
        sliding_window=window, sliding_window_pattern=2, max_position_embeddings=512,
        rms_norm_eps=1e-6))
    model = gemma3_text.Model(args)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * sharpness  # tied head
    mx.eval(model.parameters())
    return model


def tiny_gpt_oss(vocab: int = 32, window: int = 4, seed: int = 0, sharpness: float = 1.0):
    """mlx-lm's gpt-oss: sliding and full attention layers alternating, attention sinks, a
    mixture of 4 experts (2 per token)."""
    from mlx_lm.models import gpt_oss

    mx.random.seed(seed)
    args = gpt_oss.ModelArgs(
        model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=vocab, hidden_size=32, intermediate_size=32, head_dim=8,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=window, rope_theta=10000)
    model = gpt_oss.Model(args)
    model.lm_head.weight = model.lm_head.weight * sharpness
    mx.eval(model.parameters())
    return model
