"""GGUF conversion on tiny files written here: every quant type, every supported
architecture, the tokenizer, and the refusals."""

import os
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from mlxspec.converters import convert, convert_gguf, resolve_source_kind

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
ROPE_THETA = 50000.0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Offsets of the fp16 super-block scales in each K-quant block (ggml-common.h).
_KQUANT_F16_OFFSETS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2),
                       QT.Q5_K: (0, 2), QT.Q6_K: (208,)}

# One type per tensor, so a file exercises most block formats at once.
TYPES = {
    "token_embd": QT.Q4_K,
    "output": QT.Q8_0,
    "blk.0.attn_q": QT.Q4_K,
    "blk.0.attn_k": QT.Q5_0,
    "blk.0.attn_v": QT.Q8_0,
    "blk.0.attn_output": QT.Q4_0,
    "blk.0.ffn_gate": QT.Q4_1,
    "blk.0.ffn_up": QT.Q5_1,
    "blk.0.ffn_down": QT.Q6_K,
    "blk.1.attn_q": QT.Q8_0,
    "blk.1.attn_k": QT.Q6_K,
    "blk.1.attn_v": QT.Q2_K,
    "blk.1.attn_output": QT.F16,
    "blk.1.ffn_gate": QT.BF16,
    "blk.1.ffn_up": QT.Q3_K,
    "blk.1.ffn_down": QT.Q5_K,
}


def tiny_vocab():
    """A byte-level BPE vocabulary: specials, the 256 byte symbols, a few merges."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_chars = [chr(c) for c in cs]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"),
              ("o", "n"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at")]
    tokens = specials + byte_chars + ["".join(m) for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, [" ".join(m) for m in merges], types


def llamacpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation (HF -> GGUF row order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_raw(shape, qtype, rng):
    """Raw bytes of a tensor of ``shape`` in ``qtype``, with its HF-layout fp32 value."""
    rows, cols = shape
    w = rng.normal(0, 0.05, size=shape).astype(np.float32)
    if qtype == QT.F32:
        return w, w
    if qtype == QT.F16:
        raw = w.astype(np.float16)
        return raw, raw.astype(np.float32)
    if qtype in _KQUANT_F16_OFFSETS:
        # gguf cannot quantize K types: build valid blocks from random bytes.
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for off in _KQUANT_F16_OFFSETS[qtype]:
            d = rng.uniform(1e-4, 2e-3, size=(rows, cols // block)).astype(np.float16)
            raw[..., off:off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
        raw = raw.reshape(rows, -1)
    else:
        raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def write_tiny_gguf(path, arch="llama", types=TYPES, tied=False, seed=0, extra=None):
    """Write a 2-layer model; return {HF name: expected fp32 weight}."""
    rng = np.random.default_rng(seed)
    tokens, merges, token_types = tiny_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(token_types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    shapes = {"token_embd": (vocab, HIDDEN), "output_norm": (HIDDEN,)}
    if not tied:
        shapes["output"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}"
        shapes.update({
            f"{b}.attn_q": (HEADS * HEAD_DIM, HIDDEN),
            f"{b}.attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{b}.attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{b}.attn_output": (HIDDEN, HEADS * HEAD_DIM),
            f"{b}.ffn_gate": (INTER, HIDDEN),
            f"{b}.ffn_up": (INTER, HIDDEN),
            f"{b}.ffn_down": (HIDDEN, INTER),
            f"{b}.attn_norm": (HIDDEN,),
            f"{b}.ffn_norm": (HIDDEN,),
        })
        if arch == "qwen2":
            for p, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                shapes[f"{b}.attn_{p}.bias"] = (n * HEAD_DIM,)
        if arch == "qwen3":
            shapes[f"{b}.attn_q_norm"] = (HEAD_DIM,)
            shapes[f"{b}.attn_k_norm"] = (HEAD_DIM,)

    expected = {}
    for name, shape in shapes.items():
        qtype = types.get(name, QT.F32) if len(shape) == 2 else QT.F32
        if len(shape) == 1:
            raw = (1.0 + rng.normal(0, 0.1, size=shape)).astype(np.float32)
            value = raw
        else:
            raw, value = random_raw(shape, qtype, rng)
        parts = name.split(".")
        n_head = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(parts[2]) if parts[0] == "blk" else None
        if arch == "llama" and n_head:
            raw = llamacpp_permute(raw, n_head)
        gname = name if name.endswith(".bias") else f"{name}.weight"
        if qtype in (QT.F32, QT.F16):
            w.add_tensor(gname, raw)
        else:
            w.add_tensor(gname, raw, raw_dtype=qtype)
        expected[gname] = value
    for gname, array in (extra or {}).items():
        w.add_tensor(gname, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    from mlxspec.converters.gguf import hf_name

    return {hf_name(k): v for k, v in expected.items()}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    expected = write_tiny_gguf(d / "tiny.gguf")
    out = convert_gguf(d / "tiny.gguf", d / "mlx", progress=False)
    return d / "tiny.gguf", out, expected


def _load_weights(out):
    weights = {}
    for f in sorted(Path(out).glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def test_every_quant_type_matches_gguf_dequantize(tiny_llama):
    _, out, expected = tiny_llama
    weights = _load_weights(out)
    assert set(weights) == set(expected)
    for name, value in expected.items():
        got = np.array(weights[name])
        assert got.dtype == np.float32, name
        assert got.shape == value.shape, name
        np.testing.assert_allclose(got, value, rtol=0, atol=1e-7, err_msg=name)


def test_permutation_is_undone_against_llamacpp(tiny_llama):
    # Re-applying llama.cpp's own permutation to our Q/K must give the file's rows.
    path, out, _ = tiny_llama
    weights = _load_weights(out)
    reader = gguf.GGUFReader(str(path))
    ours = {
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", HEADS),
        "blk.1.attn_q.weight": ("model.layers.1.self_attn.q_proj.weight", HEADS),
        "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", KV_HEADS),
        "blk.1.attn_k.weight": ("model.layers.1.self_attn.k_proj.weight", KV_HEADS),
    }
    for t in reader.tensors:
        if t.name in ours:
            name, n_head = ours[t.name]
            raw = gguf.quants.dequantize(t.data, t.tensor_type)
            w = np.array(weights[name])
            np.testing.assert_array_equal(llamacpp_permute(w, n_head), raw)
            assert not np.array_equal(w, raw)


def test_tiny_config_and_load(tiny_llama):
    import json

    from mlx_lm import load

    _, out, _ = tiny_llama
    config = json.load(open(out / "config.json"))
    assert config["model_type"] == "llama"
    assert config["rope_theta"] == ROPE_THETA
    assert config["num_key_value_heads"] == KV_HEADS
    assert config["tie_word_embeddings"] is False
    assert config["eos_token_id"] == 2
    model, tokenizer = load(str(out))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True)
    assert ids[0] == 1 and tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert mx.isfinite(logits).all().item()
    assert tokenizer.eos_token_ids == {2}


def test_tiny_tokenizer_matches_transformers_builder(tiny_llama):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokens, merges, types = tiny_vocab()
    ref, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": "smollm",
        "tokens": tokens, "merges": merges, "token_type": types})
    ours = load_tokenizer(tiny_llama[1])
    for s in ["the cat", "the theater in the cat", "<|im_start|>user\nat the<|im_end|>", "  a\n\nb ", "é ü"]:
        assert ours.encode(s) == ref.encode(s).ids, s


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_vocab_via_transformers_builder(tmp_path, add_bos):
    """Non-BPE GGUF vocabularies (Llama 2 style) go through transformers' builder."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxspec.converters.gguf_tokenizer import build_tokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    pieces += ["▁", "▁t", "he", "▁the", "▁c", "at", "▁cat", "a", "c", "e", "h", "t"]
    meta = {
        "general.architecture": "llama", "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(1, 13)],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 12,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": add_bos,
    }
    build_tokenizer(meta).save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    ids = tok.encode("the cat")
    assert ids == [1, 262, 265] if add_bos else ids == [262, 265]
    assert tok.decode(ids, skip_special_tokens=True) == "the cat"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_architectures_are_not_permuted(tmp_path, arch):
    from mlx_lm import load

    types = {k: v for k, v in TYPES.items() if k != "blk.0.attn_q"}
    types["blk.0.attn_q"] = QT.Q8_0
    expected = write_tiny_gguf(tmp_path / "t.gguf", arch=arch, types=types, tied=True)
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "mlx", progress=False)
    weights = _load_weights(out)
    assert set(weights) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(np.array(weights[name]), value, rtol=0, atol=1e-7, err_msg=name)
    model, tokenizer = load(str(out))
    assert model.args.tie_word_embeddings
    assert mx.isfinite(model(mx.array([[5, 6, 7]]))).all().item()


def test_keep_quantized_is_exact_for_native_types(tmp_path, tiny_llama):
    import json

    from mlx_lm import load

    path, dense_dir, _ = tiny_llama
    out = convert_gguf(path, tmp_path / "q", keep_quantized=True, progress=False)
    config = json.load(open(out / "config.json"))
    assert config["quantization"]["group_size"] == 32
    weights = _load_weights(out)
    # Q8_0 / Q4_0 / Q4_1 stay packed, K-quants and the rest are dense.
    assert "model.layers.0.self_attn.v_proj.scales" in weights        # Q8_0
    assert "model.layers.0.self_attn.o_proj.scales" in weights        # Q4_0
    assert "model.layers.1.self_attn.q_proj.scales" in weights        # Q8_0, permuted
    assert "model.layers.0.self_attn.q_proj.scales" not in weights    # Q4_K
    dense, _ = load(str(dense_dir))
    quant, _ = load(str(out))
    assert type(quant.model.layers[1].self_attn.q_proj).__name__ == "QuantizedLinear"
    ids = mx.array([[3, 40, 80, 120, 200, 5]])
    np.testing.assert_allclose(np.array(quant(ids)), np.array(dense(ids)), atol=1e-4, rtol=1e-4)


def test_requantize_gguf_through_convert(tmp_path, tiny_llama):
    import json

    from mlx_lm import load

    # The options the CLI passes for every source.
    out = convert(tiny_llama[0], tmp_path / "q", dtype=None, quantize=True, q_bits=4,
                  q_group_size=64, overwrite=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["group_size"] == 64
    model, _ = load(str(out))
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert mx.isfinite(model(mx.array([[5, 6, 7]]))).all().item()
    assert sorted(os.listdir(tmp_path)) == ["q"]
    with pytest.raises(ValueError, match="keep_quantized"):
        convert(tiny_llama[0], tmp_path / "q2", quantize=True, keep_quantized=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes(tmp_path, tiny_llama, dtype):
    path, _, expected = tiny_llama
    out = convert_gguf(path, tmp_path / dtype, dtype=dtype, progress=False)
    weights = _load_weights(out)
    w = weights["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype == getattr(mx, dtype)
    np.testing.assert_allclose(np.array(w.astype(mx.float32)),
                               expected["model.layers.0.self_attn.q_proj.weight"], atol=1e-2)


def test_mx_load_decodes_q4_k_wrongly(tmp_path):
    """Documents why the converter dequantizes with the gguf package."""
    raw, value = random_raw((64, 256), QT.Q4_K, np.random.default_rng(1))
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("x.weight", raw, raw_dtype=QT.Q4_K)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    theirs = np.array(mx.load(str(tmp_path / "k.gguf"))["x.weight"].astype(mx.float32))
    assert theirs.shape == value.shape
    # fp16 rounding would stay below ~1e-3 relative; mx.load is off by far more.
    assert np.abs(theirs - value).max() > 0.1 * np.abs(value).max()
    # ... and mx.load cannot read Q5_0 at all.
    raw5 = gguf.quants.quantize(value, QT.Q5_0)
    w = gguf.GGUFWriter(str(tmp_path / "q5.gguf"), "llama")
    w.add_tensor("x.weight", raw5, raw_dtype=QT.Q5_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(RuntimeError):
        mx.load(str(tmp_path / "q5.gguf"))


# --- refusals -----------------------------------------------------------------


def _partials(parent):
    return [p for p in os.listdir(parent) if ".partial-" in p or ".old-" in p]


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        convert(tmp_path / "g.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not _partials(tmp_path)


def test_undequantizable_tensor_type(tmp_path):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.int32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.attn_norm\.weight \(I32\)"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not _partials(tmp_path)


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, extra={"blk.0.mystery.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        resolve_source_kind(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out")


def test_existing_out_dir(tmp_path, tiny_llama):
    path = tiny_llama[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_gguf(path, out, progress=False)
    assert (out / "old.txt").read_text() == "keep me"
    convert_gguf(path, out, overwrite=True, progress=False)
    assert not (out / "old.txt").exists() and (out / "config.json").is_file()
    assert not _partials(tmp_path)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_conversion_leaves_nothing(tmp_path, monkeypatch, tiny_llama, error):
    import mlxspec.converters.gguf as mod

    real, calls = mod.dequantize, []

    def flaky(t):
        calls.append(t.name)
        if len(calls) == 5:
            raise error("boom")
        return real(t)

    monkeypatch.setattr(mod, "dequantize", flaky)
    with pytest.raises(error):
        convert_gguf(tiny_llama[0], tmp_path / "out", progress=False)
    assert len(calls) == 5
    assert not (tmp_path / "out").exists()
    assert not _partials(tmp_path)
