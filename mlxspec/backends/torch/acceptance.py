"""Acceptance rules in torch: the same rules as mlxspec.backends.mlx.acceptance, tensor for tensor.

Nothing here reads a value back to the host (indexing by a device scalar goes through gather /
index_select), so drafting, verification and acceptance cost one sync per step.
"""

import torch

from ...sampling import SamplingConfig
from .sampling import categorical, processed_logprobs


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of leading True values of a 1-D bool tensor, as a 0-d int64 tensor."""
    return torch.cumprod(mask.to(torch.int64), dim=0).sum()


def _row(matrix: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """matrix[index] for a 0-d device index, without a host sync."""
    return matrix.index_select(0, index.reshape(1))[0]


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (K+1, V), drafts (K,) -> (accepted count, next token).

    Drafts are kept while they equal the target's argmax; the next token is the target's argmax
    after the last kept draft, so the output is exactly greedy decoding of the target.
    """
    targets = torch.argmax(logits, dim=-1)
    accepted = _leading_true(drafts == targets[:-1])
    return accepted, _row(targets, accepted)


def accept_sampled(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), as mlxspec.backends.mlx.acceptance.

    Rule: accept draft x_i with probability min(1, q_i(x_i) / p_i(x_i)); at the first rejection
    draw from normalise(max(0, q_i - p_i)); if all K are accepted draw a bonus token from q_K.
    A deterministic drafter has one-hot p: accept with probability q_i(x_i), else draw from q_i
    with x_i removed.
    """
    num_draft = drafts.shape[0]
    q = processed_logprobs(logits, sampling).exp()  # (K+1, V)
    rows = torch.arange(num_draft, device=q.device)
    q_of_draft = q[rows, drafts]  # (K,)
    if draft_probs is None:
        p = torch.zeros_like(q[:-1])
        p[rows, drafts] = 1.0
    else:
        p = draft_probs.float()
    p_of_draft = p[rows, drafts]
    ratio = q_of_draft / p_of_draft.clamp_min(1e-30)
    uniform = torch.rand(num_draft, device=q.device, dtype=torch.float32)
    accepted = _leading_true(uniform < ratio)

    # Row i < K is the residual after rejecting draft i; row K is q itself (the bonus token).
    residual = torch.cat([(q[:-1] - p).clamp_min(0.0), q[-1:]], dim=0)
    return accepted, categorical(normalised(_row(residual, accepted), _row(q, accepted)))


def normalised(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of `residual` scaled to sum to 1; a row with no mass left keeps `fallback`'s
    (rejection has probability 0 when the residual is empty; the division is guarded anyway)."""
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), fallback)
