"""Hybrid-attention checkpoints (Qwen3-Next, Qwen3.5, Nemotron-H) in their published Hugging Face
layout, converted to MLX and checked against transformers running the same checkpoint.

The checkpoints are tiny random models built with transformers' own classes and written with
``save_pretrained``: that is the published layout (``linear_attn.in_proj_qkvz``, per-expert
``mlp.experts.N.*``, ``conv1d.weight`` as (channels, 1, kernel), ``A_log``, ``dt_bias``,
zero-centred norms, ``model.language_model.*`` and ``model.visual.*`` for Qwen3.5,
``backbone.*`` for Nemotron-H), not mlx-lm's sanitized names. Qwen3.5-MoE is published with
its experts fused (``mlp.experts.gate_up_proj``), transformers' in-memory layout, while
transformers 5.24's save_pretrained writes them one by one: both are cases. The published
checkpoints also carry multi-token-prediction weights (``mtp.*``), added here. Two cases
rewrite config.json the way the hub's files spell it (written by older transformers or NVIDIA's
remote code) instead of the way transformers 5 saves it. Weights are re-drawn at a scale where every block matters, so
a norm convention, a convolution layout or an attention period that is wrong moves the logits
far beyond the tolerance.

Measured on the 2-core CPU machine (float32 both sides): max |MLX - transformers| logits 1.4e-6
(Nemotron-H) .. 1.7e-5 (Qwen3.5), the largest |logit| 3.7 .. 4.7; asserted < 1e-4 times the
largest |logit| (~4e-4). The whole module takes ~10 s.
"""

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch", reason="the reference needs torch (pip install .[reference])")
transformers = pytest.importorskip("transformers", reason="the reference needs transformers")

from test_convert_hf import _save_tokenizer  # noqa: E402

import mlxspec  # noqa: E402
from mlxspec.cli.main import main  # noqa: E402
from mlxspec.converters import convert, convert_hf  # noqa: E402

pytestmark = pytest.mark.reference

IDS = [[1, 40, 80, 120, 200, 5, 7, 9, 260, 3, 80, 120]]
PROMPT = "the cat the cat in the hat the cat the cat in the"
RTOL = 1e-4

# The Gated DeltaNet models: linear attention everywhere but every second layer (mlx-lm's default
# period is 4, so a period that is not carried over shows).
QWEN_TEXT = dict(
    vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6,
    full_attention_interval=2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
ROPE = {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5}
# Qwen3.5 as published: interleaved multimodal rope (text positions are equal on every axis).
MROPE = {**ROPE, "mrope_section": [1, 1, 0], "mrope_interleaved": True}
MTP = ("mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.input_layernorm.weight")


def _qwen3_next(experts=4):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    moe = dict(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, decoder_sparse_step=1, norm_topk_prob=True)
    return Qwen3NextForCausalLM(Qwen3NextConfig(**QWEN_TEXT, **moe, rope_parameters=ROPE))


def _qwen3_5(vision=True):
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    if not vision:
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN_TEXT, rope_parameters=MROPE))
    tiny_vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                       out_hidden_size=32, patch_size=4, num_position_embeddings=16)
    config = Qwen3_5Config(text_config={**QWEN_TEXT, "rope_parameters": MROPE},
                           vision_config=tiny_vision, tie_word_embeddings=False)
    return Qwen3_5ForConditionalGeneration(config)


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = {k: v for k, v in QWEN_TEXT.items() if k != "intermediate_size"}
    text.update(rope_parameters=MROPE, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, shared_expert_intermediate_size=16)
    tiny_vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                       out_hidden_size=32, patch_size=4, num_position_embeddings=16)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=tiny_vision,
                              tie_word_embeddings=False)
    return Qwen3_5MoeForConditionalGeneration(config)


def _nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=272, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
        n_groups=2, conv_kernel=4, chunk_size=8, hybrid_override_pattern="M*-ME",
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=1.5,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = NemotronHForCausalLM(config)
    # transformers 5.24 clamps the Mamba-2 time step below at time_step_min (1e-3), ignoring the
    # config's time_step_limit [0, inf], which NVIDIA's own modeling code and mlx-lm both apply:
    # the reference follows the checkpoint's config (else logits differ by up to ~1e-3 here).
    for layer in model.model.layers:
        if hasattr(layer.mixer, "time_step_limit"):
            layer.mixer.time_step_limit = tuple(config.time_step_limit)
    return model


def _qwen3_next_config_as_published(config):
    """config.json as Qwen/Qwen3-Next-80B-A3B-Instruct's (transformers 4.57): top-level rope keys
    and full_attention_interval, no rope_parameters or layer_types."""
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None,
                  partial_rotary_factor=rope["partial_rotary_factor"],
                  full_attention_interval=2, torch_dtype="float32")
    return config


def _nemotron_h_config_as_published(config):
    """config.json as nvidia's Nemotron-H checkpoints (remote code): the pattern as a string,
    num_hidden_layers, a bare Infinity in time_step_limit."""
    chars = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    types = config.pop("layers_block_type")
    config.update(hybrid_override_pattern="".join(chars[t] for t in types),
                  num_hidden_layers=len(types), time_step_limit=[0.0, float("inf")])
    return config


def _save_pretrained(model, path):
    model.save_pretrained(str(path))


def _save_fused_experts(model, path):
    """Qwen3.5-MoE as Qwen publishes it: experts fused (``mlp.experts.gate_up_proj``, (experts,
    2 * intermediate, hidden)), which is transformers' in-memory layout; its save_pretrained
    writes them one by one (the other case)."""
    from safetensors.torch import save_file

    _save_pretrained(model, path)  # config.json and generation_config.json
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


# name: (build, write, rewrite config.json, add mtp.* tensors)
CASES = {
    "qwen3_next": (_qwen3_next, _save_pretrained, None, True),
    "qwen3_next-published-config": (
        _qwen3_next, _save_pretrained, _qwen3_next_config_as_published, True),
    "qwen3_next-dense": (lambda: _qwen3_next(experts=0), _save_pretrained, None, False),
    "qwen3_5": (_qwen3_5, _save_pretrained, None, True),
    "qwen3_5-text-only": (lambda: _qwen3_5(vision=False), _save_pretrained, None, False),
    "qwen3_5_moe": (_qwen3_5_moe, _save_fused_experts, None, True),
    "qwen3_5_moe-experts-one-by-one": (_qwen3_5_moe, _save_pretrained, None, False),
    "nemotron_h": (_nemotron_h, _save_pretrained, None, False),
    "nemotron_h-published-config": (
        _nemotron_h, _save_pretrained, _nemotron_h_config_as_published, False),
}


def _randomize(model, seed):
    """Weights at a scale where every part of every block shows in the logits."""
    g = torch.Generator().manual_seed(seed)

    def normal(p, std):
        return torch.randn(p.shape, generator=g, dtype=p.dtype) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif name.endswith(("embed_tokens.weight", "embeddings.weight")):
                p.copy_(normal(p, 1.0))
            elif p.ndim >= 2:  # linear (out, in), experts (E, out, in), conv1d (channels, 1, k)
                p.copy_(normal(p, p.shape[-1] ** -0.5))
            else:  # norms (zero-centred or not), biases, dt_bias, D: off their initial values
                p.add_(normal(p, 0.3))


def _reference_logits(model):
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def _add_mtp(path, hidden):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for name in MTP:
        shape = (hidden, 2 * hidden) if name == "mtp.fc.weight" else (hidden,)
        weights[name] = torch.randn(shape, generator=g)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread(one_torch_thread):
    """torch on one thread while this module runs (conftest.one_torch_thread)."""


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(published-layout directory, transformers' logits on IDS)."""
    build, write, rewrite_config, mtp = CASES[request.param]
    torch.manual_seed(0)
    model = build()
    _randomize(model, seed=1)
    path = tmp_path_factory.mktemp("hf") / request.param
    write(model, path)
    if mtp:
        _add_mtp(path, QWEN_TEXT["hidden_size"])
    if rewrite_config:
        config = rewrite_config(json.loads((path / "config.json").read_text()))
        (path / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(path)
    return path, _reference_logits(model)


def _names(path):
    from safetensors import safe_open

    names = set()
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            names.update(st.keys())
    return names


def _mlx_logits(path):
    model, _ = mlxspec.load(path)
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def _assert_close(logits, reference):
    scale = np.abs(reference).max()
    assert scale > 1.0  # the random model is far from uniform: the comparison means something
    np.testing.assert_allclose(logits, reference, rtol=0, atol=RTOL * scale)


def test_published_layout_is_what_the_test_writes(checkpoint):
    """Guard on the fixture itself: transformers wrote the hub's names and shapes, not mlx-lm's."""
    path, _ = checkpoint
    names = _names(path)
    layout = " ".join(sorted(names))
    if "qwen3_next" in path.name:
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
        assert "model.layers.0.linear_attn.in_proj_ba.weight" in names
        if "dense" not in path.name:
            assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
            assert "model.layers.1.mlp.shared_expert_gate.weight" in names
    if path.name.startswith("qwen3_5") and "text-only" not in path.name:
        assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
        assert any(n.startswith("model.visual.") for n in names)
    if path.name == "qwen3_5_moe":
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    if path.name == "qwen3_5_moe-experts-one-by-one":
        assert "model.language_model.layers.0.mlp.experts.3.gate_proj.weight" in names
    if "nemotron_h" in path.name:
        assert "backbone.layers.0.mixer.in_proj.weight" in names
        assert "backbone.layers.4.mixer.experts.0.up_proj.weight" in names
    assert "switch_mlp" not in layout and "language_model.model." not in layout
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as st:
        conv = next(k for k in st.keys() if k.endswith("conv1d.weight"))  # noqa: SIM118
        assert st.get_slice(conv).get_shape()[1] == 1  # (channels, 1, kernel)


def test_converted_logits_match_transformers(checkpoint, tmp_path):
    """API conversion, then mlxspec.load: the logits transformers computes on the checkpoint.
    Converting the converted directory again changes nothing: mlx-lm's sanitize ran once on the
    published names, and leaves its own names and shapes alone when the output is loaded."""
    path, reference = checkpoint
    out = convert(path, tmp_path / "mlx")
    names = _names(out)
    assert not any(n.startswith(("mtp.", "model.visual.")) for n in names)
    assert not any(".experts.0." in n for n in names)  # experts stacked (switch_mlp)
    config = json.loads((out / "config.json").read_text())
    assert "vision_config" not in config
    logits = _mlx_logits(out)
    _assert_close(logits, reference)

    again = convert_hf(out, tmp_path / "again")
    np.testing.assert_array_equal(_mlx_logits(again), logits)
    # The Hugging Face directory itself loads the same way (mlxspec.load / --model DIR).
    np.testing.assert_array_equal(_mlx_logits(path), logits)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keeps_the_decay_in_float32(checkpoint, tmp_path, dtype):
    """`--dtype bfloat16/float16` casts the weights but not A_log (mlx-lm's qwen3_next, unlike its
    qwen3_5 and nemotron_h, does not keep it in float32 itself)."""
    path, reference = checkpoint
    if path.name not in ("qwen3_next", "qwen3_next-dense", "qwen3_5_moe", "nemotron_h"):
        pytest.skip("Gated DeltaNet with and without experts, and Mamba-2")
    out = convert(path, tmp_path / "half", dtype=dtype)
    model, _ = mlxspec.load(out)
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    decays = [k for k in params if k.endswith("A_log")]
    assert decays and all(params[k].dtype == mx.float32 for k in decays)
    head = next(k for k in params if k.endswith("lm_head.weight"))
    assert params[head].dtype == getattr(mx, dtype)
    if mx.default_device() == mx.cpu and any("switch_mlp" in k for k in params):
        return  # MLX's CPU gather_mm (the experts) is float32-only
    logits = np.array(model(mx.array(IDS)).astype(mx.float32))
    assert np.corrcoef(logits.ravel(), reference.ravel())[0, 1] > 0.99


def _generate(*args):
    result = CliRunner().invoke(main, ["generate", "--no-chat-template", "-n", "16", *args])
    assert result.exit_code == 0, result.output
    return result


def test_cli_convert_then_lossless_lookup(checkpoint, tmp_path):
    """`mlxspec convert` on the published layout, then generation on the result: prompt lookup
    (verify passes with drafts, recurrent state rolled back on rejection) gives the tokens plain
    decoding gives."""
    path, _ = checkpoint
    out = tmp_path / "cli"
    result = CliRunner().invoke(main, ["convert", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"Wrote {out}" in result.output
    plain = _generate("--model", str(out), "-p", PROMPT)
    spec = _generate("--model", str(out), "-p", PROMPT, "--drafter", "lookup", "--fixed-k",
                     "--verbose")
    assert spec.stdout == plain.stdout
    assert int(re.search(r"drafted: (\d+)", spec.stderr)[1]) > 0, spec.stderr


def test_torch_backend_refuses_a_converted_hybrid_in_one_line(checkpoint, tmp_path):
    """A converted directory holds mlx-lm's names and shapes, which transformers would partly
    leave as initialised (random) or fail on with a traceback: one line naming what to load."""
    path, _ = checkpoint
    out = tmp_path / "converted"
    assert CliRunner().invoke(main, ["convert", str(path), "-o", str(out)]).exit_code == 0
    result = CliRunner().invoke(main, ["generate", "--no-chat-template", "-n", "4", "-p", PROMPT,
                                       "--model", str(out), "--backend", "torch"])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "Hugging Face checkpoint directory" in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "LOAD REPORT" not in result.output, result.output


def _broken_copy(src, dst, edit_weights=None, edit_config=None):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if edit_weights:
        weights = load_file(str(dst / "model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _drop(name):
    return lambda w: w.pop(name)


def _reshape(name):
    def edit(w):
        w[name] = np.zeros((w[name].shape[0], 1, w[name].shape[-1] + 1), w[name].dtype)

    return edit


def _layer_types(config):
    (config.get("text_config") or config)["layer_types"] = [
        "linear_attention", "full_attention", "full_attention", "linear_attention"]


BROKEN = {
    # mlx-lm's sanitize stacks the experts and looks each one up.
    "qwen3_next": ("missing-expert", dict(edit_weights=_drop(
        "model.layers.2.mlp.experts.3.up_proj.weight")),
        "missing 'model.layers.2.mlp.experts.3.up_proj.weight'"),
    "qwen3_5": ("wrong-conv-shape", dict(edit_weights=_reshape(
        "model.language_model.layers.0.linear_attn.conv1d.weight")),
        "language_model.model.layers.0.linear_attn.conv1d.weight"),
    "qwen3_5_moe-experts-one-by-one": ("missing-expert", dict(edit_weights=_drop(
        "model.language_model.layers.1.mlp.experts.2.down_proj.weight")),
        "missing 'model.language_model.layers.1.mlp.experts.2.down_proj.weight'"),
    "nemotron_h": ("missing-A_log", dict(edit_weights=_drop("backbone.layers.3.mixer.A_log")),
                   "backbone.layers.3.mixer.A_log"),
    "qwen3_5-text-only": ("aperiodic-layer-types", dict(edit_config=_layer_types),
                          "is not one attention layer every n layers"),
}


def test_broken_checkpoint_is_one_line_and_nothing_is_written(checkpoint, tmp_path):
    path, _ = checkpoint
    if path.name not in BROKEN:
        pytest.skip("one kind of damage per model family")
    kind, edits, expected = BROKEN[path.name]
    src = _broken_copy(path, tmp_path / kind, **edits)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        convert(src, out)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    result = CliRunner().invoke(main, ["convert", str(src), "-o", str(out)])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and expected in result.output, result.output
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
    # Loading the directory without converting it fails the same way.
    result = CliRunner().invoke(main, ["generate", "--model", str(src), "-p", "the", "-n", "2"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and expected in result.output, result.output


GGUF_HYBRIDS = {"qwen3next": "Qwen3-Next", "qwen35": "Qwen3.5", "qwen35moe": "Qwen3.5",
                "nemotron_h": "Nemotron-H", "nemotron_h_moe": "Nemotron-H"}


@pytest.mark.parametrize("arch", list(GGUF_HYBRIDS))
def test_hybrid_gguf_is_refused_in_one_line(arch, tmp_path, monkeypatch):
    """gguf 0.19 names these architectures' tensors, but their layout is what llama.cpp's
    converter makes of them (not undone here): converting or loading such a file fails in one
    line naming the architecture and pointing at the Hugging Face checkpoint."""
    import gguf

    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for tensor in gguf.MODEL_TENSORS[model_arch][:12]:  # the names llama.cpp writes
        name = gguf.TENSOR_NAMES[tensor].format(bid=0)
        w.add_tensor(f"{name}.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        convert(path, out)
    message = str(err.value)
    assert f"architecture {arch!r}" in message and GGUF_HYBRIDS[arch] in message
    assert "Hugging Face checkpoint" in message and "\n" not in message
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    for args in (["convert", str(path), "-o", str(out)],
                 ["generate", "--model", str(path), "-p", "the", "-n", "2"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and result.output == f"Error: {message}\n", result.output
    assert not out.exists() and not [p for p in tmp_path.rglob("*") if "partial" in p.name]
