"""Safetensors checkpoint conversion: tiny llama checkpoints written here, local,
sharded and from a hand-made Hub cache in offline mode."""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_convert_gguf import CHAT_TEMPLATE, tiny_vocab

from mlxspec.converters import convert, convert_hf, resolve_source_kind

ROPE_THETA = 500000.0
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    # transformers 5 style: no top-level rope_theta (mlx-lm would use 10000).
    "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
    "max_position_embeddings": 512,
    "vocab_size": 272,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}
IDS = [[1, 40, 80, 120, 200, 5, 7, 9, 260, 3]]


def _tiny_weights(seed=0):
    rng = np.random.default_rng(seed)
    c = CONFIG
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def w(*shape, scale=0.1):
        return (rng.normal(0, scale, size=shape)).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(c["vocab_size"], h, scale=1.0),
               "model.norm.weight": 1 + w(h),
               "lm_head.weight": w(c["vocab_size"], h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        weights.update({
            f"{p}.self_attn.q_proj.weight": w(q, h), f"{p}.self_attn.k_proj.weight": w(kv, h),
            f"{p}.self_attn.v_proj.weight": w(kv, h), f"{p}.self_attn.o_proj.weight": w(h, q),
            f"{p}.mlp.gate_proj.weight": w(i, h), f"{p}.mlp.up_proj.weight": w(i, h),
            f"{p}.mlp.down_proj.weight": w(h, i),
            f"{p}.input_layernorm.weight": 1 + w(h), f"{p}.post_attention_layernorm.weight": 1 + w(h),
            # transformers checkpoints of older days carry this buffer; mlx-lm drops it.
            f"{p}.self_attn.rotary_emb.inv_freq": w(hd // 2),
        })
    return weights


def _save_tokenizer(path):
    from mlxspec.converters.gguf_tokenizer import build_tokenizer

    tokens, merges, types = tiny_vocab()
    build_tokenizer({
        "general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }).save_pretrained(str(path))


def write_tiny_hf(path, shards=1):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    weights = _tiny_weights()
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(weights)
        index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
                 "weight_map": {}}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: weights[k] for k in names[s::shards]}
            save_file(part, str(path / fname), metadata={"format": "pt"})
            index["weight_map"].update({k: fname for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return write_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture(scope="module")
def reference_logits(tiny_hf):
    """The unconverted checkpoint run by mlx-lm, with the rope_theta it really has."""
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_hf, model_config={"rope_theta": ROPE_THETA})
    return np.array(model(mx.array(IDS)))


def _logits(out):
    from mlx_lm import load

    model, tokenizer = load(str(out))
    assert tokenizer.eos_token_ids >= {2}
    return model, np.array(model(mx.array(IDS)).astype(mx.float32))


def test_round_trip_keeps_weights(tiny_hf, reference_logits, tmp_path):
    out = convert_hf(tiny_hf, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == ROPE_THETA  # the trap: written at the top level
    _, logits = _logits(out)
    np.testing.assert_array_equal(logits, reference_logits)
    # The trap is real: mlx-lm on the source config would use rope_theta 10000.
    from mlx_lm.utils import load_model

    naive, _ = load_model(tiny_hf)
    assert not np.allclose(np.array(naive(mx.array(IDS))), reference_logits, atol=1e-3)


def test_sharded_source_float16(tmp_path, reference_logits):
    src = write_tiny_hf(tmp_path / "sharded", shards=3)
    out = convert(src, tmp_path / "out", dtype="float16")
    model, logits = _logits(out)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float16
    np.testing.assert_allclose(logits, reference_logits, atol=0.05, rtol=0.02)
    assert (out / "generation_config.json").is_file()


def test_quantize(tiny_hf, reference_logits, tmp_path):
    out = convert_hf(tiny_hf, tmp_path / "q", quantize=True, q_bits=4, q_group_size=64)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    model, logits = _logits(out)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    # Exactly what quantizing the unconverted model in memory gives ...
    from mlx_lm.utils import load_model, quantize_model

    ref, _ = load_model(tiny_hf, model_config={"rope_theta": ROPE_THETA})
    ref, _ = quantize_model(ref, {}, 64, 4)
    np.testing.assert_allclose(logits, np.array(ref(mx.array(IDS))), atol=1e-5, rtol=1e-5)
    # ... and still close to the float model (random weights quantize poorly).
    assert np.corrcoef(logits.ravel(), reference_logits.ravel())[0, 1] > 0.95


def test_tokenizer_and_chat_template_survive(tiny_hf, tmp_path):
    from mlx_lm import load

    out = convert_hf(tiny_hf, tmp_path / "out", dtype="float32")
    _, tokenizer = load(str(out))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True)
    assert tokenizer.decode(ids) == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"


def test_pickle_only_checkpoint_is_refused(tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    # Not even a valid pickle: the refusal must come before anything reads it.
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(ValueError, match="pickle"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_safetensors_with_other_names_are_explained(tmp_path):
    src = tmp_path / "odd"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    save_file({"x": np.zeros(2, np.float32)}, str(src / "consolidated.safetensors"))
    with pytest.raises(ValueError, match="model\\*.safetensors"):
        convert_hf(src, tmp_path / "out")


def test_existing_out_dir_refused_before_work(tiny_hf, tmp_path, monkeypatch):
    import mlx_lm.utils

    (tmp_path / "out").mkdir()

    def no_loading(*a, **k):
        raise AssertionError("loaded the model before checking out_dir")

    monkeypatch.setattr(mlx_lm.utils, "load_model", no_loading)
    with pytest.raises(FileExistsError):
        convert_hf(tiny_hf, tmp_path / "out")


def _hub_cache(cache, repo_id, src):
    """Lay ``src`` out the way huggingface_hub caches a snapshot."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in Path(src).iterdir():
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / f.name)
    return snap


def test_repo_id_from_offline_hub_cache(tiny_hf, reference_logits, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    _hub_cache(cache, "org/tiny-llama", tiny_hf)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source_kind("org/tiny-llama") == "hf-repo"
    out = convert("org/tiny-llama", tmp_path / "out")
    _, logits = _logits(out)
    np.testing.assert_array_equal(logits, reference_logits)


def test_unknown_repo_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        convert("org/does-not-exist", tmp_path / "out")
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "out").exists()


def test_source_kinds(tmp_path, tiny_hf):
    assert resolve_source_kind(tiny_hf) == "hf-dir"
    assert resolve_source_kind("Qwen/Qwen2.5-0.5B-Instruct") == "hf-repo"
    for missing in ["./no/such/dir", str(tmp_path / "nope"), "a/b/c"]:
        with pytest.raises(FileNotFoundError):
            convert(missing, tmp_path / "out")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError):
        convert(tmp_path / "file.txt", tmp_path / "out")


@pytest.mark.parametrize(
    "content,problem",
    [
        ('{\n"model_type": "llama",\n}',
         "is not valid JSON (line 3 column 1: Expecting property name enclosed in double quotes)"),
        ("[]", "holds a JSON list, not an object ({...})"),
    ],
    ids=["not-json", "not-an-object"],
)
def test_corrupt_config_json_named(tiny_hf, tmp_path, content, problem):
    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    (src / "config.json").write_text(content)
    for call in (convert, convert_hf):
        with pytest.raises(ValueError) as err:
            call(src, tmp_path / "out")
        assert str(err.value) == f"{src / 'config.json'} {problem}: fix or replace the file"
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors_named(tiny_hf, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"corrupted safetensors file {weights}: .*truncated"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
