"""The parts of an mlx-lm target that drafters and trainers borrow: its token embedding, LM head
and final norm, its sizes, and the checksum that tells targets of equal sizes apart.

mlx-lm models nest these differently (model, model.model, language_model...); every drafter
and trainer reads them through here. The torch backend's twins are in backends/torch/target.py.
"""

import mlx.core as mx
import mlx.nn as nn

from .hidden_states import decoder_layers
from ...target_sizes import TargetSizes


def target_inner(model):
    """The module holding embed_tokens and the final norm (model, model.model, language_model...)."""
    for outer in (model, getattr(model, "language_model", None)):
        for inner in (outer, getattr(outer, "model", None)):
            if inner is not None and hasattr(inner, "embed_tokens"):
                return inner
    raise ValueError(f"cannot find the token embedding of {type(model).__module__}")


def target_embedding(model):
    return target_inner(model).embed_tokens


# Names mlx-lm models give their token embedding where it is not an `embed_tokens` beside the
# final norm: gpt2/gpt_bigcode's `wte`, mamba's `embeddings`, ...
_EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings",
                    "embedding")


def input_embedding(model):
    """The module that embeds the model's input tokens, wherever it nests (target_inner's
    `embed_tokens`, else an embedding module under one of the names above); None when none
    is found."""
    try:
        return target_embedding(model)
    except ValueError:
        pass
    found = {name.rsplit(".", 1)[-1]: module for name, module in model.named_modules()
             if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))}
    return next((found[name] for name in _EMBEDDING_NAMES if name in found), None)


def target_head(model):
    """The target's LM head module, or its tied embedding used as one."""
    for inner in (model, getattr(model, "language_model", None)):
        head = getattr(inner, "lm_head", None) if inner is not None else None
        if head is not None:
            return head
    return target_embedding(model).as_linear


def target_final_norm(model):
    return getattr(target_inner(model), "norm", None)


def target_sizes(model) -> TargetSizes:
    """(hidden size, vocab size, decoder layers) of an mlx-lm model."""
    embed = target_embedding(model)
    hidden = getattr(getattr(model, "args", None), "hidden_size", None) or embed.weight.shape[1]
    return TargetSizes(int(hidden), int(embed.weight.shape[0]), len(decoder_layers(model)))


def embedding_checksum(model) -> float:
    """Sum of the first 8 embedding rows (dequantized): tells targets of equal shape apart."""
    embed = target_embedding(model)
    rows = embed.weight[:8]
    if hasattr(embed, "scales"):
        rows = mx.dequantize(rows, embed.scales[:8], embed.get("biases")[:8] if "biases" in embed
                             else None, group_size=embed.group_size, bits=embed.bits)
    return float(rows.astype(mx.float32).sum().item())


def head_rows(head, ids: mx.array) -> nn.Module:
    """A linear layer computing `head`'s logits for `ids` only: rows of a Linear, of a tied
    Embedding (its `as_linear`) or of their quantized forms (packed rows slice exactly)."""
    owner = getattr(head, "__self__", head)
    if "scales" in owner:
        rows = nn.QuantizedLinear(owner.group_size, 1, bias=False, group_size=owner.group_size,
                                  bits=owner.bits, mode=getattr(owner, "mode", "affine"))
        rows.scales = owner["scales"][ids]
        if "biases" in owner:
            rows.biases = owner["biases"][ids]
        elif "biases" in rows:
            del rows["biases"]
    else:
        rows = nn.Linear(1, 1, bias=False)
    rows.weight = owner["weight"][ids]
    if "bias" in owner:
        rows.bias = owner["bias"][ids]
    mx.eval(rows.parameters())
    return rows


def dtype_of(module) -> mx.Dtype:
    """The dtype a layer (or a tied embedding's `as_linear`) computes in."""
    owner = getattr(module, "__self__", module)  # Embedding.as_linear is a bound method
    scales = getattr(owner, "scales", None)  # quantized layers compute in their scales' dtype
    return (scales if scales is not None else owner.weight).dtype
