"""Tiny random models of every architecture mlx-lm has, for surveys and property tests.

Not a test file: `CONFIGS` holds one small Hugging Face-style config (what `ModelArgs.from_dict`
reads from a config.json) per mlx-lm model_type that builds and runs on the CPU; `build` makes a
seeded random model of one, its logits scaled so greedy decoding has clear winners; `window` says
the smallest sliding-attention window of a model's caches; `SKIPPED` says why each remaining
module of mlx_lm/models is left out. Every sliding-window architecture gets a window of 8
positions (`WINDOW`) and, where it mixes layer kinds, at least one sliding and one full layer.

    import mlxspec                      # first: it preloads OpenBLAS before mlx
    from architectures import CONFIGS, build, window
    model = build("gemma3_text")
"""

import copy
import os

import mlx.core as mx

VOCAB = 64
WINDOW = 8
MAX_POS = 1024
# Logits scaled until their spread (std over the vocabulary, averaged over positions) is about
# this: random tiny models are often near-uniform, and a greedy comparison between two
# implementations means little where the top two logits are within rounding of each other.
TARGET_STD = 3.0

# Sizes most dense configs share: 32 wide, 4 query heads of 8 over 2 KV heads.
_DENSE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
    max_position_embeddings=MAX_POS, rope_theta=10000.0, tie_word_embeddings=False,
)


def _dense(model_type, **over):
    return {"model_type": model_type, **_DENSE, **over}


_SWA = ["sliding_attention", "full_attention"]
_YARN = {"type": "yarn", "factor": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
         "mscale_all_dim": 1.0, "original_max_position_embeddings": MAX_POS}

# DeepSeek-V3-style MLA + MoE sizes (deepseek_v3, kimi_vl, kimi_k25, ...).
_DSV3 = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=8, routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=None, attention_bias=False, tie_word_embeddings=False,
)

_HYBRID_LINEAR = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4,
)

_QWEN3_MOE_TEXT = dict(
    _DENSE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    mlp_only_layers=[], moe_intermediate_size=16, norm_topk_prob=True)

# Keyed by mlx_lm/models module name, which is the config's model_type except for
# bailing_moe_v3 (reached as model_type bailing_hybrid with a BailingMoeV3ForCausalLM
# architecture, as mlx_lm.utils remaps it).
CONFIGS: dict[str, dict] = {
    # ---------------------------------------------------------------- plain dense transformers
    "llama": _dense("llama", num_hidden_layers=4, sliding_window=WINDOW,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                 "full_attention"]),
    "apertus": _dense("apertus", mlp_bias=True, attention_bias=False, post_norm=False,
                      qk_norm=True),
    "cohere": _dense("cohere", num_key_value_heads=4, logit_scale=0.0625, use_qk_norm=True),
    "ernie4_5": _dense("ernie4_5", use_bias=False),
    "exaone": {"model_type": "exaone", "vocab_size": VOCAB, "hidden_size": 32,
               "num_layers": 2, "intermediate_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "rope_theta": 10000.0, "layer_norm_epsilon": 1e-5,
               "max_position_embeddings": MAX_POS, "tie_word_embeddings": False},
    "gemma": _dense("gemma"),
    "gemma2": _dense("gemma2", query_pre_attn_scalar=8, final_logit_softcapping=30.0,
                     attn_logit_softcapping=50.0),
    "glm": _dense("glm"),
    "glm4": _dense("glm4", attention_bias=False, partial_rotary_factor=0.5),
    "gpt2": {"model_type": "gpt2", "n_ctx": MAX_POS, "n_embd": 32, "n_head": 4, "n_layer": 2,
             "n_positions": MAX_POS, "layer_norm_epsilon": 1e-5, "vocab_size": VOCAB},
    "gpt_bigcode": {"model_type": "gpt_bigcode", "n_embd": 32, "n_layer": 2, "n_inner": 64,
                    "n_head": 4, "n_positions": MAX_POS, "layer_norm_epsilon": 1e-5,
                    "vocab_size": VOCAB},
    "gpt_neox": {"model_type": "gpt_neox", "max_position_embeddings": MAX_POS,
                 "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                 "layer_norm_eps": 1e-5, "vocab_size": VOCAB, "rotary_emb_base": 10000,
                 "rotary_pct": 0.5},
    "gptj": {"model_type": "gptj", "n_embd": 32, "vocab_size": VOCAB, "n_positions": MAX_POS,
             "n_head": 4, "rotary_dim": 4, "n_layer": 2, "layer_norm_epsilon": 1e-5},
    "granite": _dense("granite", logits_scaling=1.0, attention_multiplier=0.125,
                      embedding_multiplier=1.0, residual_multiplier=0.5, attention_bias=False,
                      mlp_bias=False),
    "helium": _dense("helium", attention_bias=False, mlp_bias=False),
    "hunyuan_v1_dense": _dense("hunyuan_v1_dense", attention_bias=False, use_qk_norm=True,
                               rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    "internlm2": _dense("internlm2", bias=False),
    "internlm3": _dense("internlm3", bias=False, qkv_bias=False),
    # Its MLP width is 256 * round(8/3 * n_embd / 256): 0 below 64 wide.
    "lille-130m": {"model_type": "lille-130m", "block_size": MAX_POS, "layer_norm_eps": 1e-5,
                   "n_embd": 64, "n_head": 4, "n_kv_heads": 2, "n_layer": 2,
                   "rope_theta": 10000.0, "vocab_size": VOCAB},
    "mimo": _dense("mimo"),
    "minicpm": _dense("minicpm", dim_model_base=32, scale_depth=1.0, scale_emb=1.0),
    "minicpm3": _dense("minicpm3", num_key_value_heads=4, dim_model_base=32, q_lora_rank=16,
                       qk_nope_head_dim=8, qk_rope_head_dim=8, kv_lora_rank=16, scale_depth=1.0,
                       scale_emb=1.0, rope_scaling={"type": "longrope", "long_factor": [1.0] * 4,
                                                    "short_factor": [1.0] * 4,
                                                    "original_max_position_embeddings": MAX_POS}),
    "nanbeige": _dense("nanbeige"),
    "nanochat": {"model_type": "nanochat", "hidden_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": VOCAB,
                 "max_position_embeddings": MAX_POS, "intermediate_size": 128},
    "nemotron": _dense("nemotron", hidden_act="relu2", norm_eps=1e-5,
                       partial_rotary_factor=0.5),
    # One block of each kind: attention + FFN, no-op attention, linear replacements.
    "nemotron-nas": {"model_type": "nemotron-nas", "hidden_size": 32, "num_hidden_layers": 3,
                     "num_attention_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
                     "max_position_embeddings": MAX_POS, "block_configs": [
                         {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.5}},
                         {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
                         {"attention": {"replace_with_linear": True},
                          "ffn": {"replace_with_linear": True}}]},
    "olmo2": _dense("olmo2", attention_bias=False),
    "openelm": {"model_type": "openelm", "head_dim": 8, "num_transformer_layers": 2,
                "model_dim": 32, "vocab_size": VOCAB, "ffn_dim_divisor": 8,
                "num_query_heads": [4, 4], "num_kv_heads": [2, 2], "ffn_multipliers": [1.0, 2.0],
                "normalize_qk_projections": True, "rope_freq_constant": 10000,
                "rope_max_length": MAX_POS},
    "phi": {"model_type": "phi", "max_position_embeddings": MAX_POS, "vocab_size": VOCAB,
            "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 4, "partial_rotary_factor": 0.5, "intermediate_size": 64,
            "layer_norm_eps": 1e-5, "rope_theta": 10000.0},
    "phi3": _dense("phi3", original_max_position_embeddings=MAX_POS),
    "plamo": _dense("plamo", n_shared_head=2),
    "qwen": {"model_type": "qwen", "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 2, "kv_channels": 8, "max_position_embeddings": MAX_POS,
             "layer_norm_epsilon": 1e-6, "intermediate_size": 128, "no_bias": True,
             "vocab_size": VOCAB},
    "qwen2": _dense("qwen2"),
    "qwen3": _dense("qwen3"),
    "seed_oss": _dense("seed_oss"),
    "smollm3": _dense("smollm3", num_hidden_layers=4, no_rope_layer_interval=2),
    "stablelm": _dense("stablelm", use_qkv_bias=True, partial_rotary_factor=0.5,
                       layer_norm_eps=1e-5),
    "starcoder2": _dense("starcoder2", norm_epsilon=1e-5),
    "talkie": {"model_type": "talkie", "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "head_dim": 8, "intermediate_size": 64,
               "vocab_size": VOCAB, "rope_theta": 10000.0, "max_position_embeddings": MAX_POS},
    "telechat3": _dense("telechat3"),
    "youtu_llm": {"model_type": "youtu_llm", "vocab_size": VOCAB, "hidden_size": 32,
                  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                  "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8,
                  "max_position_embeddings": MAX_POS, "tie_word_embeddings": False},
    "afm7": {"model_type": "afm7", "vocab_size": VOCAB, "hidden_dim": 32, "num_layers": 3,
             "num_kv_reuse_layers": 1, "num_heads": 4, "num_kv_heads": 2},
    "nemotron_h": {"model_type": "nemotron_h", "vocab_size": VOCAB, "hidden_size": 32,
                   "intermediate_size": 64, "max_position_embeddings": MAX_POS,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
                   "mamba_num_heads": 4, "mamba_head_dim": 8, "mamba_proj_bias": False,
                   "ssm_state_size": 8, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
                   "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "hybrid_override_pattern": ["M", "*", "-", "M"]},
    # --------------------------------------------------------------- sliding-window attention
    "cohere2": _dense("cohere2", num_hidden_layers=4, sliding_window=WINDOW,
                      sliding_window_pattern=2, logit_scale=0.0625),
    "exaone4": _dense("exaone4", num_hidden_layers=4, rope_scaling=None,
                      sliding_window=WINDOW, sliding_window_pattern="LG"),
    "gemma3_text": _dense("gemma3_text", num_hidden_layers=4, sliding_window=WINDOW,
                          sliding_window_pattern=2, query_pre_attn_scalar=8),
    "gemma3": {"model_type": "gemma3", "vocab_size": VOCAB,
               "text_config": dict(_DENSE, model_type="gemma3_text", num_hidden_layers=4,
                                   sliding_window=WINDOW, sliding_window_pattern=2,
                                   query_pre_attn_scalar=8)},
    "gemma3n": {"model_type": "gemma3n", "vocab_size": VOCAB, "text_config": {
        "model_type": "gemma3n_text", "hidden_size": 32, "num_hidden_layers": 4,
        "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "num_key_value_heads": 2, "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": VOCAB, "sliding_window": WINDOW,
        "max_position_embeddings": MAX_POS, "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.0] * 4, "hidden_size_per_layer_input": 8,
        "altup_num_inputs": 2, "altup_coef_clip": 120.0, "altup_correct_scale": True,
        "altup_active_idx": 0, "laurel_rank": 8}},
    "gemma4_text": {"model_type": "gemma4_text", "hidden_size": 32, "num_hidden_layers": 4,
                    "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8,
                    "global_head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
                    "vocab_size_per_layer_input": VOCAB, "num_key_value_heads": 2,
                    "num_global_key_value_heads": 1, "num_kv_shared_layers": 2,
                    "hidden_size_per_layer_input": 8, "sliding_window": WINDOW,
                    "sliding_window_pattern": 2, "max_position_embeddings": MAX_POS,
                    "final_logit_softcapping": 30.0,
                    "layer_types": ["sliding_attention", "full_attention"] * 2},
    "gemma4": {"model_type": "gemma4", "vocab_size": VOCAB, "text_config": {
        "model_type": "gemma4_text", "hidden_size": 32, "num_hidden_layers": 4,
        "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8, "global_head_dim": 16,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB,
        "num_key_value_heads": 2, "num_global_key_value_heads": 1, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "sliding_window": WINDOW, "sliding_window_pattern": 2,
        "max_position_embeddings": MAX_POS, "final_logit_softcapping": 30.0,
        "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
        "moe_intermediate_size": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}},
    "gpt_oss": _dense("gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                      sliding_window=WINDOW, layer_types=_SWA),
    "olmo3": _dense("olmo3", num_hidden_layers=4, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "ministral3": _dense("ministral3", num_hidden_layers=2, sliding_window=WINDOW,
                         layer_types=_SWA, rope_parameters={"rope_theta": 10000.0,
                                                            "rope_type": "default",
                                                            "llama_4_scaling_beta": 0.1,
                                                            "original_max_position_embeddings":
                                                            MAX_POS}),
    # The wrapper has no make_cache: mlx-lm gives its sliding layers plain KVCaches (window()
    # is None) while they still mask to the window.
    "mistral3": {"model_type": "mistral3", "text_config": _dense(
        "ministral3", sliding_window=WINDOW, layer_types=_SWA,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                         "llama_4_scaling_beta": 0.1,
                         "original_max_position_embeddings": MAX_POS})},
    "mellum": _dense("mellum", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     norm_topk_prob=True, sliding_window=WINDOW, layer_types=_SWA,
                     rope_parameters={"full_attention": {"rope_theta": 10000.0,
                                                         "rope_type": "default"},
                                      "sliding_attention": {"rope_theta": 10000.0,
                                                            "rope_type": "default"}}),
    "afmoe": _dense("afmoe", num_hidden_layers=3, moe_intermediate_size=16, num_experts=4,
                    num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1,
                    sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "baichuan_m1": _dense("baichuan_m1", sliding_window=WINDOW, sliding_window_layers=[0],
                          conv_window=2),
    "exaone_moe": _dense("exaone_moe", num_hidden_layers=3, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, num_shared_experts=1, n_group=1,
                         topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                         sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention",
                                      "sliding_attention"],
                         is_moe_layer=[False, True, True]),
    "gear": _dense("gear", num_hidden_layers=3, sliding_window=WINDOW,
                   layer_types=["conv_mixer", "sliding_attention", "full_attention"]),
    # The second loop's caches are RotatingKVCaches of loop_window_size.
    "iquestloopcoder": _dense("iquestloopcoder", loop_num=2, loop_window_size=WINDOW),
    "laguna": _dense("laguna", num_hidden_layers=3, sliding_window=WINDOW,
                     partial_rotary_factor=0.5, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, shared_expert_intermediate_size=16,
                     layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                     mlp_layer_types=["dense", "sparse", "sparse"],
                     num_attention_heads_per_layer=[4, 4, 4],
                     rope_parameters={"full_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.5},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 1.0}}),
    "mimo_v2_flash": {"model_type": "mimo_v2_flash", "num_experts_per_tok": 2,
                      "hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "sliding_window_size": WINDOW, "vocab_size": VOCAB, "hidden_size": 32,
                      "intermediate_size": 64, "moe_intermediate_size": 16,
                      "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4,
                      "routed_scaling_factor": None, "topk_method": "noaux_tc",
                      "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1,
                      "topk_group": 1, "max_position_embeddings": MAX_POS,
                      "layernorm_epsilon": 1e-5, "rope_theta": 10000.0,
                      "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "head_dim": 16, "v_head_dim": 8,
                      "swa_head_dim": 16, "swa_v_head_dim": 8, "partial_rotary_factor": 0.5},
    "muse_glimmer": _dense("muse_glimmer", num_hidden_layers=2, sliding_window=WINDOW,
                           layer_types=_SWA),
    "plamo3": {"model_type": "plamo3", "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "max_position_embeddings": MAX_POS, "sliding_window": WINDOW,
               "sliding_window_pattern": 2, "intermediate_size": 64, "vocab_size": VOCAB,
               "tie_word_embeddings": False},
    "recurrent_gemma": {"model_type": "recurrent_gemma", "attention_bias": False,
                        "conv1d_width": 4, "hidden_size": 32, "intermediate_size": 64,
                        "logits_soft_cap": 30.0, "num_attention_heads": 4,
                        "num_hidden_layers": 3, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
                        "rope_theta": 10000.0, "attention_window_size": WINDOW,
                        "vocab_size": VOCAB, "lru_width": 32,
                        "block_types": ["recurrent", "attention", "recurrent"]},
    "spark2_5": _dense("spark2_5", sliding_window=WINDOW, layer_types=_SWA,
                       rope_parameters={"full_attention": {"rope_theta": 10000.0},
                                        "sliding_attention": {"rope_theta": 10000.0}}),
    "step3p5": {"model_type": "step3p5", "hidden_size": 32, "num_hidden_layers": 3,
                "vocab_size": VOCAB, "num_attention_heads": 4, "num_attention_groups": 2,
                "head_dim": 8, "intermediate_size": 64, "max_position_embeddings": MAX_POS,
                "sliding_window": WINDOW,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                "partial_rotary_factors": [0.5, 1.0, 1.0],
                "attention_other_setting": {"num_attention_heads": 4, "num_attention_groups": 2},
                "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 16,
                "share_expert_dim": 16, "moe_layers_enum": "1,2"},
    # Its own LayerCache keeps a window of `sliding_window` rows (no compressed layers here).
    "deepseek_v41": {"model_type": "deepseek_v41", "vocab_size": VOCAB, "hidden_size": 32,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
                     "q_lora_rank": 16, "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16,
                     "moe_intermediate_size": 16, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "sliding_window": WINDOW,
                     "compress_ratios": [0, 0], "max_position_embeddings": MAX_POS,
                     "hc_mult": 2, "hc_sinkhorn_iters": 4, "index_n_heads": 2,
                     "index_head_dim": 8, "index_topk": 4},
    # ------------------------------------------------------------------ mixtures of experts
    "Klear": _dense("Klear", attention_bias=False, mlp_only_layers=[0], num_experts=4,
                    num_experts_per_tok=2, decoder_sparse_step=1, n_shared_experts=1,
                    moe_intermediate_size=16, norm_topk_prob=True),
    "bailing_moe": _dense("bailing_moe", moe_intermediate_size=16, num_experts=4,
                          num_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2,
                          first_k_dense_replace=1),
    "dbrx": {"model_type": "dbrx", "vocab_size": VOCAB, "d_model": 32, "n_layers": 2,
             "n_heads": 4, "max_seq_len": MAX_POS,
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000}},
    "deepseek": _dense("deepseek", num_key_value_heads=4, moe_intermediate_size=16,
                       n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                       first_k_dense_replace=1, moe_layer_freq=1),
    "deepseek_v2": dict(_DSV3, model_type="deepseek_v2", topk_method="greedy",
                        scoring_func="softmax", n_group=1, topk_group=1, rope_scaling=_YARN),
    "deepseek_v3": dict(_DSV3, model_type="deepseek_v3"),
    "deepseek_v32": dict(_DSV3, model_type="deepseek_v32", index_n_heads=2, index_head_dim=16,
                         index_topk=4),
    "glm_moe_dsa": dict(_DSV3, model_type="glm_moe_dsa", index_n_heads=2, index_head_dim=16,
                        index_topk=4, rope_parameters={"rope_theta": 10000.0,
                                                       "rope_type": "default"}),
    "kimi_vl": {"model_type": "kimi_vl", "text_config": dict(_DSV3, model_type="deepseek_v3")},
    "kimi_k25": {"model_type": "kimi_k25",
                 "text_config": dict(_DSV3, model_type="deepseek_v3")},
    "glm4_moe_lite": dict(_DSV3, model_type="glm4_moe_lite", partial_rotary_factor=1.0,
                          n_group=1, num_nextn_predict_layers=0),
    "mistral4": dict(_DSV3, model_type="mistral4", rope_interleave=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": MAX_POS}),
    "solar_open": _dense("solar_open", moe_intermediate_size=16, n_shared_experts=1,
                         n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
                         first_k_dense_replace=1, norm_topk_prob=True,
                         partial_rotary_factor=1.0, n_group=1, topk_group=1),
    "dots1": _dense("dots1", first_k_dense_replace=1, moe_intermediate_size=16,
                    n_routed_experts=4, n_shared_experts=1, norm_topk_prob=True,
                    num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1),
    "ernie4_5_moe": _dense("ernie4_5_moe", use_bias=False, moe_num_experts=4, moe_k=2,
                           moe_intermediate_size=16, moe_num_shared_experts=1,
                           moe_layer_start_index=1, moe_layer_interval=1),
    "glm4_moe": _dense("glm4_moe", moe_intermediate_size=16, norm_topk_prob=True, n_group=1,
                       topk_group=1, n_shared_experts=1, n_routed_experts=4,
                       routed_scaling_factor=1.0, num_experts_per_tok=2,
                       first_k_dense_replace=1, rope_scaling=None, use_qk_norm=True,
                       attention_bias=False, partial_rotary_factor=0.5),
    "granitemoe": _dense("granitemoe", logits_scaling=1.0, attention_multiplier=0.125,
                         embedding_multiplier=1.0, residual_multiplier=0.5,
                         attention_bias=False, num_local_experts=4, num_experts_per_tok=2),
    "hunyuan": _dense("hunyuan", attention_bias=False, moe_topk=2, num_experts=4,
                      num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
                      rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
                      use_cla=True, cla_share_factor=2),
    "llama4_text": _dense("llama4_text", intermediate_size_mlp=64, use_qk_norm=True,
                          no_rope_layers=[1, 0]),
    "llama4": {"model_type": "llama4", "text_config": _dense(
        "llama4", num_hidden_layers=4, intermediate_size_mlp=64, attention_chunk_size=WINDOW,
        interleave_moe_layer_step=2, num_local_experts=2, num_experts_per_tok=1,
        use_qk_norm=True, rope_scaling=None, attention_bias=False)},
    "minimax": _dense("minimax", num_experts_per_tok=2, num_local_experts=4,
                      shared_intermediate_size=0, rotary_dim=4),
    "minimax_m3_vl": {"model_type": "minimax_m3_vl", "text_config": _dense(
        "minimax_m3", intermediate_size=16, dense_intermediate_size=64,
        shared_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        partial_rotary_factor=0.5, moe_layer_freq=[0, 1])},
    "mixtral": _dense("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "olmoe": _dense("olmoe", num_experts=4, num_experts_per_tok=2),
    "phimoe": _dense("phimoe", num_local_experts=4, num_experts_per_tok=2,
                     rope_scaling=None),
    "phixtral": {"model_type": "phixtral", "num_vocab": VOCAB, "model_dim": 32,
                 "num_heads": 4, "num_layers": 2, "rotary_dim": 4, "num_experts_per_tok": 2,
                 "num_local_experts": 4},
    "qwen2_moe": _dense("qwen2_moe", num_experts_per_tok=2, num_experts=4,
                        moe_intermediate_size=16, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(_QWEN3_MOE_TEXT),
    "longcat_flash": {"model_type": "longcat_flash", "attention_method": "MLA",
                      "zero_expert_type": "identity", "hidden_size": 32, "ffn_hidden_size": 64,
                      "moe_topk": 2, "expert_ffn_hidden_size": 16, "n_routed_experts": 4,
                      "zero_expert_num": 2, "num_layers": 2, "vocab_size": VOCAB,
                      "max_position_embeddings": MAX_POS, "num_attention_heads": 4,
                      "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                      "qk_nope_head_dim": 8, "v_head_dim": 8, "routed_scaling_factor": 1.0,
                      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "mla_scale_q_lora": True,
                      "mla_scale_kv_lora": True, "attention_bias": False},
    "longcat_flash_ngram": {"model_type": "longcat_flash_ngram", "hidden_size": 32,
                            "ffn_hidden_size": 64, "moe_topk": 2, "expert_ffn_hidden_size": 16,
                            "n_routed_experts": 4, "zero_expert_num": 2, "num_layers": 2,
                            "vocab_size": VOCAB, "max_position_embeddings": MAX_POS,
                            "num_attention_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                            "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                            "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5,
                            "rope_theta": 10000.0, "mla_scale_q_lora": True,
                            "mla_scale_kv_lora": True, "emb_neighbor_num": 2,
                            "emb_split_num": 2, "ngram_vocab_size_ratio": 2},
    # ---------------------------------------- vision-language wrappers (their text model)
    "pixtral": {"model_type": "pixtral", "text_config": _dense("llama")},
    "qwen2_vl": {"model_type": "qwen2_vl", "text_config": _dense("qwen2")},
    "qwen3_vl": {"model_type": "qwen3_vl", "text_config": _dense("qwen3")},
    "qwen3_vl_moe": {"model_type": "qwen3_vl_moe", "text_config": dict(_QWEN3_MOE_TEXT)},
    "lfm2-vl": {"model_type": "lfm2-vl", "text_config": {
        "model_type": "lfm2", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": MAX_POS,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 32,
        "block_ff_dim": 64, "block_multiple_of": 8, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"]}},
    # ------------------------------------- recurrent / state-space / linear-attention hybrids
    "lfm2": {"model_type": "lfm2", "vocab_size": VOCAB, "hidden_size": 32,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": MAX_POS, "norm_eps": 1e-5, "conv_bias": False,
             "conv_L_cache": 3, "block_dim": 32, "block_ff_dim": 64, "block_multiple_of": 8,
             "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
             "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_moe": {"model_type": "lfm2_moe", "vocab_size": VOCAB, "hidden_size": 32,
                 "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 4,
                 "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                 "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": MAX_POS, "use_expert_bias": True,
                 "num_dense_layers": 1, "norm_eps": 1e-5, "conv_bias": False,
                 "conv_L_cache": 3,
                 "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "mamba": {"model_type": "mamba", "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 64, "state_size": 8, "num_hidden_layers": 2,
              "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 4},
    "mamba2": {"model_type": "mamba2", "num_heads": 8, "head_dim": 8, "vocab_size": VOCAB,
               "hidden_size": 32, "intermediate_size": 64, "state_size": 8,
               "num_hidden_layers": 2, "layer_norm_epsilon": 1e-5, "conv_kernel": 4,
               "n_groups": 1, "use_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": False, "time_step_limit": [0.0, float("inf")],
               "time_step_rank": "auto"},
    "jamba": {"model_type": "jamba", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8,
              "mamba_expand": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "rms_norm_eps": 1e-5, "max_position_embeddings": MAX_POS, "vocab_size": VOCAB,
              "tie_word_embeddings": False},
    "falcon_h1": {"model_type": "falcon_h1", "hidden_size": 32, "head_dim": 8,
                  "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "num_hidden_layers": 2, "mamba_d_conv": 4, "mamba_d_head": 8,
                  "mamba_d_ssm": 32, "mamba_d_state": 8, "mamba_n_groups": 1,
                  "mamba_n_heads": 4, "mamba_chunk_size": 16, "vocab_size": VOCAB,
                  "max_position_embeddings": MAX_POS, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
    "granitemoehybrid": {"model_type": "granitemoehybrid", "vocab_size": VOCAB,
                         "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                         "max_position_embeddings": MAX_POS, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "attention_bias": False,
                         "embedding_multiplier": 1.0, "attention_multiplier": 0.125,
                         "logits_scaling": 1.0, "residual_multiplier": 0.5,
                         "num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 32, "mamba_n_heads": 4,
                         "mamba_d_head": 8, "mamba_proj_bias": False, "mamba_d_state": 8,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "layer_types": ["mamba", "attention", "mamba", "attention"],
                         "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "plamo2": {"model_type": "plamo2", "hidden_size": 32, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size_per_head": 8,
               "max_position_embeddings": MAX_POS, "attention_window_size": MAX_POS,
               "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_num_heads": 4, "mamba_step": 2,
               "mamba_chunk_size": 16, "intermediate_size": 64, "vocab_size": VOCAB},
    "qwen3_next": _dense("qwen3_next", num_hidden_layers=4, num_experts=4,
                         num_experts_per_tok=2, decoder_sparse_step=1,
                         shared_expert_intermediate_size=32, mlp_only_layers=[0],
                         moe_intermediate_size=16, partial_rotary_factor=0.5,
                         full_attention_interval=2, **_HYBRID_LINEAR),
    "qwen3_5": {"model_type": "qwen3_5", "text_config": _dense(
        "qwen3_5", num_hidden_layers=4, partial_rotary_factor=0.5, full_attention_interval=2,
        **_HYBRID_LINEAR)},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": _dense(
        "qwen3_5_moe", num_hidden_layers=4, partial_rotary_factor=0.5,
        full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=32, moe_intermediate_size=16, **_HYBRID_LINEAR)},
    "olmo_hybrid": _dense("olmo_hybrid", num_hidden_layers=4, linear_allow_neg_eigval=True,
                          attention_bias=False,
                          layer_types=["linear_attention", "full_attention"] * 2,
                          **_HYBRID_LINEAR),
    "kimi_linear": _dense("kimi_linear", num_hidden_layers=3, model_max_length=MAX_POS,
                          num_experts=4, num_experts_per_token=2, num_shared_experts=1,
                          moe_intermediate_size=16, first_k_dense_replace=1, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                          linear_attn_config={"num_heads": 4, "head_dim": 8,
                                              "kda_layers": [1, 3], "full_attn_layers": [2],
                                              "short_conv_kernel_size": 4}),
    "kimi_k3": {"model_type": "kimi_k3", "text_config": {
        "model_type": "kimi_linear", "vocab_size": VOCAB, "hidden_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": MAX_POS,
        "linear_attn_config": {"num_heads": 4, "head_dim": 8, "kda_layers": [1, 3],
                               "full_attn_layers": [2], "short_conv_kernel_size": 4},
        "kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
        "v_head_dim": 8, "num_experts": 4, "num_experts_per_token": 2,
        "num_shared_experts": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1}},
    "bailing_moe_linear": _dense("bailing_moe_linear", num_hidden_layers=4,
                                 moe_intermediate_size=16, num_experts=4,
                                 num_shared_experts=1, norm_topk_prob=True,
                                 num_experts_per_tok=2, first_k_dense_replace=1,
                                 layer_group_size=2, group_norm_size=1),
    "bailing_hybrid": _dense("bailing_hybrid", num_hidden_layers=4, moe_intermediate_size=16,
                             num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                             n_group=1, topk_group=1, first_k_dense_replace=1,
                             layer_group_size=2, group_norm_size=1, routed_scaling_factor=1.0,
                             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=8),
    "bailing_moe_v3": _dense("bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"],
                             num_hidden_layers=4, moe_intermediate_size=16,
                             moe_shared_expert_intermediate_size=16, num_experts=4,
                             num_experts_per_tok=2, num_shared_experts=1, n_group=1,
                             topk_group=1, first_k_dense_replace=1, layer_group_size=2,
                             routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=16,
                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                             short_conv_kernel_size=4),
    "rwkv7": {"model_type": "rwkv7", "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 64, "norm_eps": 1e-5, "head_dim": 8,
              "num_hidden_layers": 2, "a_low_rank_dim": 8, "v_low_rank_dim": 8,
              "gate_low_rank_dim": 8, "decay_low_rank_dim": 8},
}

# Modules of mlx_lm/models that are not architectures (shared layers, caches, kernels).
HELPERS = {"__init__", "activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla",
           "pipeline", "rope_utils", "ssm", "switch_layers"}

SKIPPED: dict[str, str] = {
    "phi3small": "its forward writes -inf at hard-coded token ids 100256-100351: below a "
                 "100352-token vocabulary that is an out-of-bounds write (segfaults here)",
    "muse_spark": "its attention runs mlx_lm.kernels (qk_norm_rope, qk_norm, "
                  "rms_norm_sigmoid_gate): Metal kernels with no CPU path",
    "bitnet": "BitLinear layers run only through a Metal kernel (mx.fast.metal_kernel); "
              "no CPU path",
    "olmo": "imports the external ai2-olmo package (hf_olmo), not installed here; "
            "the module exits on import",
    "prism_hadamard_qwen35": "a 2-bit Hadamard-rotated quantized pack: needs its packed module "
                             "manifest and quantized weights, no random float build",
}


def model_types() -> list[str]:
    """Every architecture module of the installed mlx_lm/models (file names, helpers left out)."""
    import mlx_lm.models

    folder = os.path.dirname(mlx_lm.models.__file__)
    return sorted(f[:-3] for f in os.listdir(folder)
                  if f.endswith(".py") and f[:-3] not in HELPERS)


def _classes(config: dict):
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def _logit_spread(model) -> float:
    """Mean over positions of the logits' std over the vocabulary, on a fixed random prompt."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([[(7 * i + 3) % (VOCAB - 1) for i in range(24)]])
    logits = model(tokens, cache=make_prompt_cache(model)).astype(mx.float32)
    return mx.std(logits[0], axis=-1).mean().item()


def _head_candidates(model):
    """Paths of the parameters that scale the logits, likeliest first: an untied output head,
    then a final norm, then the token embedding (tied heads)."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    heads, norms, embeds = [], [], []
    for path, value in params.items():
        owner = path.split(".")[-2].lower() if "." in path else ""
        name = path.lower()
        if value.ndim == 2 and value.shape[0] == VOCAB and not path.endswith(("bias", "scales")):
            if any(k in name for k in ("lm_head", "embed_out", "output.", "head.weight",
                                       "logits")) and "per_layer" not in name:
                heads.append(path)
            elif any(k in name for k in ("embed", "wte", "word_embeddings", "tok_embeddings",
                                         "embedding")) and "per_layer" not in name:
                embeds.append(path)
        elif value.ndim == 1 and "layers." not in name and "blocks." not in name and \
                any(k in owner for k in ("norm", "ln_f", "final")):
            norms.append(path)
    return heads + norms + embeds


def _sharpen(model, target: float = TARGET_STD):
    """Scale the logits' producer until their spread is about `target` (never down): each
    candidate of _head_candidates in turn, kept if it got there, else put back."""
    from mlx.utils import tree_flatten, tree_unflatten

    spread = _logit_spread(model)
    if not spread == spread or spread >= target / 2:  # NaN, or already sharp enough
        return spread
    for path in _head_candidates(model):
        original = dict(tree_flatten(model.parameters()))[path]
        for _ in range(4):
            value = dict(tree_flatten(model.parameters()))[path]
            model.update(tree_unflatten([(path, value * (target / max(spread, 1e-6)))]))
            new = _logit_spread(model)
            if not new == new:
                break
            spread = new
            if abs(spread / target - 1) < 0.25:
                return spread
        if abs(spread / target - 1) < 0.5:
            return spread
        model.update(tree_unflatten([(path, original)]))
        spread = _logit_spread(model)
    return spread


def _fill_zero_matrices(model) -> list[str]:
    """Random values for the matrices a checkpoint would fill but the constructor leaves at
    zero: talkie's bare `lm_head` (all-equal logits), MoE routers (every expert tied, top-k
    picked by index), recurrent gates and convolutions, rwkv7's token-shift mixes, ..."""
    from mlx.utils import tree_flatten, tree_unflatten

    filled = []
    for path, value in tree_flatten(model.parameters()):
        if value.ndim >= 2 and mx.issubdtype(value.dtype, mx.floating) and \
                not mx.any(value).item():
            scale = value.shape[-1] ** -0.5
            filled.append((path, (mx.random.normal(value.shape) * scale).astype(value.dtype)))
    if filled:
        model.update(tree_unflatten(filled))
    return [path for path, _ in filled]


def build(model_type: str, seed: int = 0):
    """A seeded random mlx-lm model of `model_type` from CONFIGS, logits sharpened, evaluated."""
    if model_type not in CONFIGS:
        raise KeyError(f"{model_type}: not in CONFIGS"
                       + (f" (skipped: {SKIPPED[model_type]})" if model_type in SKIPPED else ""))
    config = copy.deepcopy(CONFIGS[model_type])
    mx.random.seed(seed)
    model_class, args_class = _classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    _fill_zero_matrices(model)
    _sharpen(model)
    mx.eval(model.parameters())
    return model


def _leaf_caches(caches):
    for c in caches:
        inner = getattr(c, "caches", None)
        if isinstance(inner, (list, tuple)):
            yield from _leaf_caches(inner)
        else:
            yield c


def window(model) -> "int | None":
    """The smallest sliding window among the model's caches (a RotatingKVCache's max_size, or
    a custom window cache's window_size); None when no cache forgets old positions."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    sizes = []
    for c in _leaf_caches(make_prompt_cache(model)):
        if isinstance(c, RotatingKVCache):
            sizes.append(c.max_size)
        elif isinstance(getattr(c, "window_size", None), int):
            sizes.append(c.window_size)
    return min(sizes) if sizes else None


def uncovered() -> list[str]:
    """Architecture modules in neither CONFIGS nor SKIPPED (should be empty)."""
    return [m for m in model_types() if m not in CONFIGS and m not in SKIPPED]
