"""Every MTP layout models/mtp.py reads, beyond the two targets of test_mtp: Qwen3-Next's MoE
module (experts one by one), Qwen3.5-MoE's (experts fused, as Qwen publishes them), GLM-4.5's
(DeepSeek's layout over GLM's layer, through GLM's own sanitize) and MiMo's (two modules,
[hidden; embedding], attention biases). Each module is a random layer of the family's mlx-lm
class, written under its published names and conventions (norms zero-centred for Qwen, experts
unstacked); the built module must hold exactly that layer's weights. MiMo also decodes
losslessly with its two modules cycling."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mtp_models import GLM_SIZES, _randomize, unstacked

from mlxspec.drafters.mtp import MTPDrafter
from mlxspec.engine import SpecStats, speculative_tokens
from mlxspec.backends.mlx.target import MLXTarget
from mlxspec.models.mtp import build_mtp_model
from mlxspec.sampling import SamplingConfig

H, VOCAB = 32, 16
SMALL = dict(hidden_size=H, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
             max_position_embeddings=256, tie_word_embeddings=False)
QWEN = dict(SMALL, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=1)


def published_experts(layer: dict, fused: bool) -> dict:
    """mlx-lm's stacked switch_mlp -> one tensor per expert, or Qwen's fused gate_up_proj."""
    out = {}
    for name, value in layer.items():
        if not fused or ".switch_mlp." not in name:
            out.update(unstacked(name, value))
            continue
        prefix, rest = name.split(".switch_mlp.")
        if rest.startswith("gate_proj"):
            up = layer[name.replace("gate_proj", "up_proj")]
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
        elif rest.startswith("down_proj"):
            out[f"{prefix}.experts.down_proj"] = value
    return out


def module_parts(prefix: str, names: dict, seed: int) -> tuple[dict, dict]:
    """The module's own tensors under their published `names` (part -> name) and the values
    the built module must hold (norms near 1, as stored by mlx)."""
    mx.random.seed(seed)
    held = {"fc.weight": mx.random.normal((H, 2 * H)) / (2 * H) ** 0.5}
    for part in ("norm_embedding", "norm_hidden", "norm"):
        held[f"{part}.weight"] = 1.0 + 0.3 * mx.random.normal((H,))
    return {f"{prefix}{names[k.split('.')[0]]}.weight": v for k, v in held.items()}, held


QWEN_NAMES = {"fc": "fc", "norm_embedding": "pre_fc_norm_embedding",
              "norm_hidden": "pre_fc_norm_hidden", "norm": "norm"}


def qwen_case(model_type: str, fused: bool):
    if model_type == "qwen3_next":
        from mlx_lm.models import qwen3_next

        args = qwen3_next.ModelArgs(model_type="qwen3_next", rope_theta=1e4,
                                    partial_rotary_factor=0.25, mlp_only_layers=[], **QWEN)
        model = qwen3_next.Model(args)
        layer = qwen3_next.Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)
        config = {"model_type": "qwen3_next", **QWEN, "mtp_num_hidden_layers": 1}
    else:
        from mlx_lm.models import qwen3_5_moe

        text = {"model_type": "qwen3_5_moe_text", **QWEN, "mtp_num_hidden_layers": 1}
        model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(
            {"model_type": "qwen3_5_moe", "text_config": text}))
        from mlx_lm.models.qwen3_5 import DecoderLayer

        text_args = model.language_model.args
        layer = DecoderLayer(text_args, text_args.full_attention_interval - 1)
        config = {"model_type": "qwen3_5_moe", "text_config": text}
    _randomize(layer, 1)
    weights = dict(tree_flatten(layer.parameters()))
    tensors = {}
    for name, value in published_experts(weights, fused).items():
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
            value = value - 1.0  # published (1 + w) norms are stored as w
        tensors[f"mtp.layers.0.{name}"] = value
    parts, held = module_parts("mtp.", QWEN_NAMES, 2)
    tensors.update({k: v - 1.0 if v.ndim == 1 else v for k, v in parts.items()})
    return model, config, tensors, [(weights, held)]


def glm_case():
    from mlx_lm.models import glm4_moe

    settings = dict(GLM_SIZES, vocab_size=VOCAB)
    args = glm4_moe.ModelArgs(model_type="glm4_moe", **settings)
    model = glm4_moe.Model(args)
    layer = glm4_moe.DecoderLayer(args, args.num_hidden_layers)
    _randomize(layer, 1)
    weights = dict(tree_flatten(layer.parameters()))
    prefix = f"model.layers.{args.num_hidden_layers}."
    tensors = {prefix + k: v for k, v in published_experts(weights, fused=False).items()}
    names = {"fc": "eh_proj", "norm_embedding": "enorm", "norm_hidden": "hnorm",
             "norm": "shared_head.norm"}
    parts, held = module_parts(prefix, names, 2)
    tensors.update(parts)
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight  # the copies it ships
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight
    config = {"model_type": "glm4_moe", **settings, "num_nextn_predict_layers": 1}
    return model, config, tensors, [(weights, held)]


def mimo_case():
    from mlx_lm.models import mimo

    args = mimo.ModelArgs(model_type="mimo", num_nextn_predict_layers=2, **SMALL)
    model = mimo.Model(args)
    _randomize(model, 0, norm_spread=0.0, sharpness=3.0)
    tensors, expected = {}, []
    names = {"fc": "input_proj", "norm_embedding": "token_layernorm",
             "norm_hidden": "hidden_layernorm", "norm": "final_layernorm"}
    for i in range(2):
        layer = mimo.TransformerBlock(args)
        _randomize(layer, 1 + i)
        weights = dict(tree_flatten(layer.parameters()))
        prefix = f"model.mtp_layers.{i}."
        tensors.update({prefix + k: v for k, v in weights.items()})
        parts, held = module_parts(prefix, names, 10 + i)
        tensors.update(parts)
        expected.append((weights, held))
    config = {"model_type": "mimo", **SMALL, "num_nextn_predict_layers": 2}
    return model, config, tensors, expected


CASES = {
    "qwen3_next-experts-one-by-one": lambda: qwen_case("qwen3_next", fused=False),
    "qwen3_5_moe-experts-fused": lambda: qwen_case("qwen3_5_moe", fused=True),
    "glm4_moe": glm_case,
    "mimo-two-modules": mimo_case,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_layout_loads_exactly_its_weights(case):
    model, config, tensors, expected = CASES[case]()
    mtp = build_mtp_model(model, config, tensors)
    assert len(mtp.mtp) == len(expected)
    for module, (layer, held) in zip(mtp.mtp, expected):
        got = dict(tree_flatten(module.parameters()))
        want = {**{f"layers.0.{k}": v for k, v in layer.items()}, **held}
        assert set(got) == set(want)
        for name, value in want.items():
            assert mx.allclose(got[name], value, atol=1e-6).item(), (case, name)
    assert mtp.mtp[0].hidden_first == (case.startswith("mimo"))


def test_a_tensor_missing_is_named():
    model, config, tensors, _ = mimo_case()
    tensors.pop("model.mtp_layers.1.self_attn.q_proj.bias")
    with pytest.raises(ValueError, match="do not fit the target.*q_proj.bias"):
        build_mtp_model(model, config, tensors)


def test_mimo_two_modules_decode_losslessly():
    model, config, tensors, _ = mimo_case()
    drafter = MTPDrafter(build_mtp_model(model, config, tensors), num_target_layers=2,
                         hidden_size=H, target_vocab=VOCAB)
    assert drafter.num_modules == 2
    prompt = [1, 5, 3, 7, 2, 9, 4, 12, 5, 3]
    stats = SpecStats()
    out = [t for t, _ in speculative_tokens(
        MLXTarget(model, capture_layers=drafter.capture_layers, speculative=True), drafter,
        prompt, sampling=SamplingConfig(temp=0.0), max_tokens=30, num_draft=3, stats=stats)]
    cache = MLXTarget(model).cache
    logits, plain = model(mx.array(prompt)[None], cache=cache), []
    for _ in range(30):
        plain.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([plain[-1]])[None], cache=cache)
    assert out == plain and stats.drafted >= 30
