"""Convert a llama.cpp GGUF file into an mlx-lm model directory.

Every tensor is dequantized with the ``gguf`` package, which knows all block
formats (K-quants included); ``mx.load`` does not decode Q4_K correctly. The
result is a plain Hugging Face-layout checkpoint (config.json, safetensors,
tokenizer files) that ``mlx_lm.load`` reads without any special casing.
"""

import json
import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from .atomic import atomic_output_dir, check_output_dir

# Bump when the output of convert_gguf changes, so cached conversions expire.
FORMAT_VERSION = 1

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Hybrid-attention architectures gguf knows and the converter refuses. gguf names their tensors,
# but their layout is llama.cpp's convert_hf_to_gguf.py: it re-lays out the recurrent layers for
# ggml (A_log stored as -exp(A_log), norms shifted by one, Qwen3-Next's fused qkvz projection
# split and regrouped, Qwen3.5's value heads reordered from grouped to tiled, experts merged),
# and that code has changed over time without a version in the file. Undoing it here would be a
# second, unchecked copy of that code; the Hugging Face checkpoints convert (converters/hf.py).
HYBRID_ARCHITECTURES = {
    "qwen3next": "Qwen3-Next",
    "qwen35": "Qwen3.5",
    "qwen35moe": "Qwen3.5",
    "nemotron_h": "Nemotron-H",
    "nemotron_h_moe": "Nemotron-H",
}

# llama.cpp permutes the Q/K rows of llama-arch models (HF rotate-half rope ->
# interleaved rope). Qwen GGUFs are written without the permutation.
_PERMUTED = {"llama"}

_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Block formats that are exactly MLX affine quantization with group size 32.
_MLX_NATIVE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

MAX_SHARD_BYTES = 5 << 30


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of a GGUF tensor, or None if unknown."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        layer, kind, suffix = m.groups()
        if kind in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
        return None
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's per-head Q/K row permutation (numpy or mx arrays).

    Only the first axis moves, so it works equally on packed quantized rows
    and on their per-row scales and biases.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"Cannot un-permute {rows} rows over {n_head} heads.")
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _resolve_dtype(dtype) -> mx.Dtype:
    if dtype is None:
        return mx.float32
    if isinstance(dtype, mx.Dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.")
    return _DTYPES[dtype]


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def read_metadata(reader) -> Dict[str, Any]:
    """GGUF metadata as plain Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _dequantizable(qtype) -> bool:
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    block = gguf.GGML_QUANT_SIZES.get(qtype)
    if block is None:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, block[1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as fp32 numpy, in row-major (Hugging Face) shape.

    GGUF lists dimensions fastest-first (``ne``); the reader's ``data`` is
    already laid out row-major, so the expected shape is the reversed ``ne``.
    """
    import gguf

    out = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(out, dtype=np.float32).reshape(shape)


def to_mlx_quantized(tensor) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Repack a Q4_0 / Q4_1 / Q8_0 tensor as MLX ``(weight, scales, biases, bits)``.

    The three formats are affine with 32-element groups, so this is exact:
    Q4_0 is ``d * (q - 8)``, Q4_1 is ``d * q + m`` and Q8_0 is ``d * q`` with a
    signed q (shifted by 128 to MLX's unsigned codes). MLX packs codes
    little-endian into uint32 words, element 0 in the lowest bits.
    """
    kind = tensor.tensor_type.name
    if kind not in _MLX_NATIVE_BITS:
        raise ValueError(f"{tensor.name}: {kind} has no exact MLX equivalent.")
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[0]
    block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = raw.reshape(rows, -1, block)

    def f16(start):
        return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]

    d = f16(0).astype(np.float32)
    if kind == "Q8_0":
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        packed = np.ascontiguousarray(q.reshape(rows, -1)).view(np.uint32)
        return packed, d, -128.0 * d, 8
    qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    # ggml: element j is the low nibble of byte j, element j + 16 the high one.
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    packed = np.ascontiguousarray((q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8))
    biases = f16(2).astype(np.float32) if kind == "Q4_1" else -8.0 * d
    return packed.view(np.uint32), d, biases, 4


def _scalar(meta, key, default=None):
    v = meta.get(key, default)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ValueError(f"Per-layer values for {key} are not supported: {v}")
        v = v[0]
    return v


def _clean_float(v: float) -> float:
    # Metadata floats are float32: 9.999999747378752e-06 -> 1e-05.
    return float(str(np.float32(v)))


def _plan(reader, arch: str) -> Dict[str, str]:
    """GGUF name -> HF name for every tensor, refusing what we cannot convert."""
    plan, unknown, bad_types = {}, [], []
    ok_types = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        qtype = t.tensor_type
        if qtype not in ok_types:
            ok_types[qtype] = _dequantizable(qtype)
        if not ok_types[qtype]:
            type_name = getattr(qtype, "name", str(qtype))
            bad_types.append(f"{t.name} ({type_name})")
        plan[t.name] = name
    if "rope_freqs.weight" in unknown:
        raise ValueError(
            "This GGUF has a rope_freqs tensor (llama3-style rope scaling), "
            "which the converter does not support yet."
        )
    if unknown:
        raise ValueError(
            f"Unexpected tensors for a {arch} model: {', '.join(unknown[:8])}"
            + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        )
    if bad_types:
        raise ValueError(
            "Cannot dequantize these tensors (the gguf package has no "
            "dequantizer for their type): " + ", ".join(bad_types[:8])
        )
    if "token_embd.weight" not in plan:
        raise ValueError("The GGUF file has no token_embd.weight tensor.")
    return plan


def _rope_scaling(meta, arch) -> Optional[Dict[str, Any]]:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"type": "linear", "factor": _clean_float(factor)}
    if kind == "yarn" and factor:
        scaling = {"type": "yarn", "factor": _clean_float(factor)}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    raise ValueError(f"Unsupported rope scaling in GGUF metadata: {kind!r}.")


def build_config(meta: Dict[str, Any], reader, arch: str, dtype: mx.Dtype) -> Dict[str, Any]:
    """An HF-style config.json for mlx-lm from the GGUF metadata."""

    def get(key, default=None):
        return _scalar(meta, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(
            f"Partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) "
            "are not supported."
        )
    vocab = int(tensors["token_embd.weight"].shape[-1])
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _clean_float(get("rope.freq_base", _DEFAULT_ROPE_THETA[arch])),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": str(dtype).split(".")[-1],
    }
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if (v := meta.get(f"tokenizer.ggml.{key}")) is not None:
            config[key.replace("padding", "pad")] = int(v)
    return config


class _ShardWriter:
    """Write weights in safetensors shards of bounded size as they come."""

    def __init__(self, out: Path, max_bytes: int = MAX_SHARD_BYTES):
        self.out, self.max_bytes = out, max_bytes
        self.current, self.size, self.files, self.weight_map = {}, 0, [], {}
        self.total = 0

    def add(self, name: str, array: mx.array):
        if self.current and self.size + array.nbytes > self.max_bytes:
            self.flush()
        self.current[name] = array
        self.size += array.nbytes
        self.total += array.nbytes

    def flush(self):
        if not self.current:
            return
        path = self.out / f"model-part-{len(self.files):05d}.safetensors"
        mx.save_safetensors(str(path), self.current, metadata={"format": "mlx"})
        self.files.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def close(self):
        self.flush()
        n = len(self.files)
        for i, (path, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / final)
            self.weight_map.update({k: final for k in names})
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(self.weight_map.items())),
        }
        with open(self.out / "model.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=4)


def _write_tokenizer(meta: Dict[str, Any], out: Path):
    from .gguf_tokenizer import build_tokenizer

    tokenizer = build_tokenizer(meta)
    tokenizer.save_pretrained(str(out))
    # Name the generic class so older transformers can read the files too.
    path = out / "tokenizer_config.json"
    with open(path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)


def convert_gguf(
    gguf_path: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    dtype: Optional[str] = "float32",
    keep_quantized: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a GGUF file (llama, qwen2 or qwen3 architecture) to an mlx-lm directory.

    Args:
        gguf_path: The ``.gguf`` file.
        out_dir: The model directory to create.
        dtype: ``"float32"`` (default, also for ``None``; the fast path on
            CPU), ``"float16"`` or ``"bfloat16"`` for the dense weights.
        keep_quantized: Keep Q4_0, Q4_1 and Q8_0 tensors as MLX affine
            quantized weights (exact, group size 32) instead of dequantizing.
        overwrite: Replace ``out_dir`` if it exists.
        progress: Show a progress bar over tensors.

    Returns:
        The path of the converted model directory.
    """
    from tqdm import tqdm

    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    mx_dtype = _resolve_dtype(dtype)
    out_dir = check_output_dir(out_dir, overwrite)

    reader = _open(gguf_path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch in HYBRID_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {gguf_path.name}: "
            f"{HYBRID_ARCHITECTURES[arch]} GGUFs hold llama.cpp's re-laid-out recurrent layers, "
            "which this converter does not undo; convert the Hugging Face checkpoint instead "
            "(mlxspec convert ORG/NAME-or-DIRECTORY -o OUT)."
        )
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {gguf_path.name}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}."
        )
    plan = _plan(reader, arch)
    config = build_config(meta, reader, arch, mx_dtype)
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }

    quantized_bits = {}

    with atomic_output_dir(out_dir, overwrite) as tmp:
        _write_tokenizer(meta, tmp)
        writer = _ShardWriter(tmp)
        for t in tqdm(reader.tensors, desc="Converting", unit="tensor", disable=not progress):
            name = plan[t.name]
            kind = t.name.split(".")[-2]
            n_head = heads.get(kind) if arch in _PERMUTED else None
            if (
                keep_quantized
                and t.tensor_type.name in _MLX_NATIVE_BITS
                and t.name.endswith(".weight")
                and len(t.shape) == 2
            ):
                *parts, bits = to_mlx_quantized(t)
                stem = name.rsplit(".", 1)[0]
                for part, a in zip(("weight", "scales", "biases"), parts):
                    if n_head:
                        a = unpermute_rows(a, n_head)
                    a = mx.array(a)
                    if part != "weight":
                        a = a.astype(mx_dtype)
                    writer.add(f"{stem}.{part}", a)
                quantized_bits[stem] = bits
                continue
            w = dequantize(t)
            if n_head:
                w = unpermute_rows(w, n_head)
            a = mx.array(w).astype(mx_dtype)
            mx.eval(a)
            writer.add(name, a)
        writer.close()

        if quantized_bits:
            bits = max(set(quantized_bits.values()), key=list(quantized_bits.values()).count)
            q = {"group_size": 32, "bits": bits, "mode": "affine"}
            for stem, b in quantized_bits.items():
                if b != bits:
                    q[stem] = {"group_size": 32, "bits": b, "mode": "affine"}
            config["quantization"] = q

        from mlx_lm.utils import save_config

        save_config(config, config_path=tmp / "config.json")
    return out_dir
