"""Acceptance rules in MLX. Both keep the output distribution exactly the target's.

All functions are lazy: they return device arrays so that drafting, verification and acceptance
form one graph evaluated once per step.
"""

import mlx.core as mx

from ...sampling import SamplingConfig
from .sampling import processed_logprobs, sample_token


def _leading_true(mask: mx.array) -> mx.array:
    """Number of leading True values of a 1-D bool array, as a scalar."""
    return mx.cumprod(mask.astype(mx.int32)).sum()


def accept_greedy(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """logits (K+1, V), drafts (K,) -> (accepted count, next token).

    Drafts are kept while they equal the target's argmax; the next token is the target's argmax
    after the last kept draft, so the output is exactly greedy decoding of the target.
    """
    targets = mx.argmax(logits, axis=-1)
    accepted = _leading_true(drafts == targets[:-1])
    return accepted, targets[accepted]


def accept_sampled(
    logits: mx.array,
    drafts: mx.array,
    draft_probs: mx.array | None,
    sampling: SamplingConfig,
) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Rule: accept draft x_i with probability min(1, q_i(x_i) / p_i(x_i)); at the first rejection
    draw from normalise(max(0, q_i - p_i)); if all K are accepted draw a bonus token from q_K.
    A deterministic drafter has one-hot p: accept with probability q_i(x_i), else draw from q_i
    with x_i removed. q is the target's processed distribution (temperature and truncations).
    """
    num_draft = drafts.shape[0]
    q = mx.exp(processed_logprobs(logits, sampling))  # (K+1, V)
    rows = mx.arange(num_draft)
    q_of_draft = q[rows, drafts]  # (K,)
    if draft_probs is None:
        p = mx.zeros_like(q[:-1])
        p[rows, drafts] = 1.0
    else:
        p = draft_probs.astype(mx.float32)
    p_of_draft = p[rows, drafts]
    ratio = q_of_draft / mx.maximum(p_of_draft, 1e-30)
    accepted = _leading_true(mx.random.uniform(shape=(num_draft,)) < ratio)

    # Row i < K is the residual after rejecting draft i; row K is q itself (the bonus token).
    residual = mx.concatenate([mx.maximum(q[:-1] - p, 0.0), q[-1:]], axis=0)
    row = residual[accepted]
    mass = row.sum()
    # Rejection has probability 0 when the residual is empty; guard the division anyway.
    row = mx.where(mass > 0, row / mx.maximum(mass, 1e-30), q[accepted])
    next_token = mx.random.categorical(mx.log(row))
    return accepted, next_token


def accept_chain(logits: mx.array, drafts: mx.array, probs, sampling: SamplingConfig
                 ) -> tuple[mx.array, mx.array]:
    """logits (K+1, V) of [pending, K drafts] -> (accepted count, next token) under `sampling`:
    no drafts, the next token sampled; greedy, accept_greedy; else accept_sampled with the
    drafts' distributions `probs` (None: one-hot)."""
    if drafts.size == 0:
        return mx.array(0), sample_token(logits[-1], sampling)
    if sampling.greedy:
        return accept_greedy(logits, drafts)
    return accept_sampled(logits, drafts, probs, sampling)
