"""Rebuild a Hugging Face tokenizer from a GGUF file's ``tokenizer.*`` metadata.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, the merges,
token types, special ids and the chat template under llama.cpp's keys. Byte-level
BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen, SmolLM, ...)
are rebuilt here directly with the ``tokenizers`` library, which takes well under
a second and needs no torch. Other vocabulary types (sentencepiece ``llama``,
``t5``, ...) go through transformers' own GGUF tokenizer builders.
"""

from typing import Any, Dict, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors

# llama.cpp token types (llama_token_type / gguf.TokenType)
_CONTROL = 3
_USER_DEFINED = 4

_GPT2_SPLIT = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    # What the original SmolLM / StarCoder tokenizer.json files do.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level()]
    )


# tokenizer.ggml.pre -> (pre-tokenizer factory, normalizer factory or None),
# matching the tokenizer.json of the model each name comes from.
_PRE_TOKENIZERS = {
    "default": (_byte_level, None),
    "gpt-2": (_byte_level, None),
    "gpt2": (_byte_level, None),
    "smollm": (_digits_then_byte_level, None),
    "starcoder": (_digits_then_byte_level, None),
    "llama3": (lambda: _split(_LLAMA3_SPLIT), None),
    "llama-v3": (lambda: _split(_LLAMA3_SPLIT), None),
    "llama-bpe": (lambda: _split(_LLAMA3_SPLIT), None),
    "smaug-bpe": (lambda: _split(_LLAMA3_SPLIT), None),
    "qwen2": (lambda: _split(_QWEN2_SPLIT), normalizers.NFC),
    "deepseek-r1-qwen": (lambda: _split(_QWEN2_SPLIT), normalizers.NFC),
}


def _byte_level_bpe(meta: Dict[str, Any]) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        import warnings

        warnings.warn(
            f"Unknown GGUF pre-tokenizer {pre!r}; using GPT-2's byte-level split. "
            "Check the encodings against the original tokenizer."
        )
        pre = "default"
    make_pre, make_norm = _PRE_TOKENIZERS[pre]
    tok.pre_tokenizer = make_pre()
    if make_norm is not None:
        tok.normalizer = make_norm()
    tok.decoder = decoders.ByteLevel()
    return tok


def _via_transformers(meta: Dict[str, Any]) -> Tokenizer:
    """Non-BPE vocabularies: reuse transformers' GGUF builders (no torch needed)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }
    tok, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    return tok


def _special(meta: Dict[str, Any], key: str) -> Optional[str]:
    idx = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    if idx is None or not 0 <= int(idx) < len(tokens):
        return None
    return tokens[int(idx)]


def _post_processor(add_bos, add_eos, bos, eos, meta):
    """BOS/EOS insertion as tokenizer.json expresses it (Llama-style)."""
    ids = {}
    single, pair = ["$A:0"], ["$A:0", "$B:1"]
    if add_bos and bos is not None:
        single.insert(0, f"{bos}:0")
        pair = [f"{bos}:0", "$A:0", f"{bos}:1", "$B:1"]
        ids[bos] = int(meta["tokenizer.ggml.bos_token_id"])
    if add_eos and eos is not None:
        single.append(f"{eos}:0")
        pair.insert(pair.index("$A:0") + 1, f"{eos}:0")
        pair.append(f"{eos}:1")
        ids[eos] = int(meta["tokenizer.ggml.eos_token_id"])
    if not ids:
        return None
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(ids.items())
    )


def _chat_template(meta: Dict[str, Any]):
    default = meta.get("tokenizer.chat_template")
    named = {
        k[len("tokenizer.chat_template.") :]: v
        for k, v in meta.items()
        if k.startswith("tokenizer.chat_template.")
    }
    if not named:
        return default
    templates = dict(named)
    if default is not None:
        templates["default"] = default
    return templates


def build_tokenizer(meta: Dict[str, Any]):
    """A ``transformers`` fast tokenizer equivalent to the GGUF's tokenizer.

    ``meta`` maps GGUF metadata keys to plain Python values.
    """
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta or kind is None:
        raise ValueError("The GGUF file has no tokenizer (tokenizer.ggml.* metadata).")
    if kind == "gpt2":
        tok = _byte_level_bpe(meta)
    else:
        try:
            tok = _via_transformers(meta)
        except Exception as e:
            raise ValueError(
                f"Cannot rebuild the GGUF tokenizer of type {kind!r}: {e}"
            ) from e

    # Control tokens are special (never split, skipped when decoding); user
    # defined ones (e.g. <think>, <tool_call>) are matched whole but decoded.
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    bos, eos = _special(meta, "bos_token_id"), _special(meta, "eos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    post = _post_processor(bool(add_bos), bool(add_eos), bos, eos, meta)
    if post is not None:
        tok.post_processor = post
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    kwargs = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": _special(meta, "unknown_token_id"),
        "pad_token": _special(meta, "padding_token_id"),
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    template = _chat_template(meta)
    if template is not None:
        kwargs["chat_template"] = template
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    if ctx:
        kwargs["model_max_length"] = int(ctx)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=False,
        add_bos_token=bool(add_bos),
        add_eos_token=bool(add_eos),
        **kwargs,
    )
