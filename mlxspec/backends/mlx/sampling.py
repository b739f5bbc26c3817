"""The processed distribution q that every path samples from, in MLX.

Speculative acceptance needs q itself (not just a sample), so the truncations are applied to
log-probabilities with mlx-lm's own filters, in mlx-lm's order (top-p, min-p, top-k on the raw
log-probabilities, temperature last). Plain decoding samples from the same q, so "lossless" has
one meaning for every drafter.
"""

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ...sampling import SamplingConfig


def processed_logprobs(logits: mx.array, sampling: SamplingConfig) -> mx.array:
    """Log of q: the target's distribution after truncation and temperature. (..., V) -> (..., V)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if sampling.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p > 0.0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if 0 < sampling.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    scaled = logprobs * (1.0 / sampling.temp)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def reported_logprobs(logits: mx.array, sampling: SamplingConfig) -> mx.array:
    """The distribution a request's logprobs describe: q when sampling; when greedy (q one-hot)
    the raw log-softmax, temperature 1 and no truncation, as OpenAI reports greedy requests."""
    if not sampling.greedy:
        return processed_logprobs(logits, sampling)
    logprobs = logits.astype(mx.float32)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def sample_token(logits: mx.array, sampling: SamplingConfig) -> mx.array:
    """One token per row of logits: argmax when greedy, else a draw from q."""
    if sampling.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(processed_logprobs(logits, sampling))


def allowed_logits(logits: mx.array, masks) -> mx.array:
    """logits (K+1, V) with each row's tokens outside its grammar mask at -inf: greedy choice
    and the acceptance rule then read the constrained distribution. `masks`: (K+1, words)
    int32 bit masks on the host (mlxspec.constraint.Matcher.masks), bit t of word t // 32 for
    token t, unpacked here."""
    words = mx.array(masks, dtype=mx.int32)
    ids = mx.arange(logits.shape[-1], dtype=mx.int32)
    bits = mx.right_shift(words[:, ids // 32], ids % 32) & 1
    return mx.where(bits.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))
