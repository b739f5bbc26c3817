"""Sampling settings and the processed distribution q that every path samples from.

Speculative acceptance needs q itself (not just a sample), so the truncations are applied to
log-probabilities with mlx-lm's own filters, in mlx-lm's order (top-p, min-p, top-k on the raw
log-probabilities, temperature last). Plain decoding samples from the same q, so "lossless" has
one meaning for every drafter.
"""

import math
from dataclasses import dataclass
from numbers import Integral, Real

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingConfig:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        for name in ("temp", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):  # nan and inf pass every comparison below unnoticed
                raise ValueError(f"{name} must be a finite number, got {value}")
        for name, value in (("top_k", self.top_k), ("seed", self.seed)):
            if not is_integer(value) and not (name == "seed" and value is None):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def is_integer(value) -> bool:
    """An int or numpy integer, not a bool or a float that happens to be whole."""
    return isinstance(value, Integral) and not isinstance(value, bool)


MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer; torch.manual_seed too


def check_seed(seed: int) -> None:
    """A seed both backends take: -1 or 2**64 would fail inside them, once the work began."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be between 0 and 2**64 - 1 ({MAX_SEED}), got {seed}")


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
