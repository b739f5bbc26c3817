"""The real default model: SmolLM2-135M-Instruct, Q4_1 GGUF (llama arch, permuted Q/K).

Uses the session fixture ``smollm_dir`` (conftest), which converts the GGUF once
into $MLXSPEC_CACHE with ``mlxspec.converters.convert``.
"""

import json
import time
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlxspec.converters import convert_gguf
from mlxspec.loading import default_gguf_path

pytestmark = pytest.mark.slow

N_HEADS, N_KV_HEADS = 9, 3

TEXTS = [
    "Hello world!",
    "What is the capital of France?",
    "In 2024, 1234567 + 89 = 1234656.",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "  leading and trailing spaces   ",
    "Ünïcödé, 日本語, emoji 🤗 and tabs\tand\r\nnewlines",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>x<file_sep>y<|endoftext|>",
]


def llamacpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation (HF -> GGUF row order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf(name):
    name = name.replace("token_embd", "model.embed_tokens").replace("output_norm", "model.norm")
    name = name.replace("blk.", "model.layers.")
    for a, b in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                 ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                 ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                 ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                 ("ffn_down", "mlp.down_proj")]:
        name = name.replace(f".{a}.", f".{b}.")
    return name


def _weights(model_dir):
    weights = {}
    for f in sorted(Path(model_dir).glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def test_every_weight_equals_gguf_dequantize(smollm_dir):
    weights = _weights(smollm_dir)
    reader = gguf.GGUFReader(str(default_gguf_path()))
    assert len(weights) == len(reader.tensors) == 272
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        ours = np.array(weights[_hf(t.name)])
        assert ours.dtype == np.float32
        if ".attn_q." in t.name:
            ours = llamacpp_permute(ours, N_HEADS)
        elif ".attn_k." in t.name:
            ours = llamacpp_permute(ours, N_KV_HEADS)
        np.testing.assert_array_equal(ours, ref, err_msg=t.name)


def test_config(smollm_dir):
    config = json.loads((Path(smollm_dir) / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["eos_token_id"] == 2


def _greedy(model, tokenizer, question, max_tokens=12):
    from mlx_lm import generate

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def test_mlx_lm_load_and_generate(smollm_dir):
    from mlx_lm import load

    model, tokenizer = load(str(smollm_dir))
    assert tokenizer.eos_token_ids == {2}
    assert "Paris" in _greedy(model, tokenizer, "What is the capital of France?")


def _transformers_reference():
    """The tokenizer transformers builds from the same GGUF metadata.

    With torch installed this is exactly ``AutoTokenizer.from_pretrained(dir,
    gguf_file=...)``; without torch that entry point cannot import, so the same
    builder is called on the metadata read by the gguf package.
    """
    path = default_gguf_path()
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer("llama", tokenizer_dict)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=meta["tokenizer.chat_template"]
    )


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    ours = load_tokenizer(Path(smollm_dir))
    ref = _transformers_reference()
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=True), text
        assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # SmolLM2 splits digits one by one (Digits pre-tokenizer in its tokenizer.json).
    digits = ours.encode("12345")
    assert len(digits) == 5


def test_fresh_conversion_is_fast_and_matches_cache(smollm_dir, tmp_path):
    start = time.perf_counter()
    out = convert_gguf(default_gguf_path(), tmp_path / "smollm2", progress=False)
    elapsed = time.perf_counter() - start
    print(f"SmolLM2-135M Q4_1 GGUF -> fp32 mlx-lm dir: {elapsed:.1f} s")
    assert elapsed < 60
    fresh, cached = _weights(out), _weights(smollm_dir)
    assert fresh.keys() == cached.keys()
    for k in fresh:
        assert mx.array_equal(fresh[k], cached[k]).item(), k


def test_keep_quantized_is_exact(smollm_dir, tmp_path):
    from mlx_lm import load

    out = convert_gguf(default_gguf_path(), tmp_path / "q", keep_quantized=True, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8  # Q8_0 embedding
    quant, tokenizer = load(str(out))
    dense, _ = load(str(smollm_dir))
    ids = mx.array([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    np.testing.assert_allclose(np.array(quant(ids)), np.array(dense(ids)), rtol=1e-4, atol=1e-3)
    assert "Paris" in _greedy(quant, tokenizer, "What is the capital of France?")
