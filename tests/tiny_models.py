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
