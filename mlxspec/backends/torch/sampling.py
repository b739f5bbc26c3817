"""The processed distribution q and sampling in torch, with mlxspec.sampling's exact semantics.

Same order as mlx-lm's filters: normalise, top-p, min-p, top-k on the raw log-probabilities,
temperature last. Draws use the exponential race (argmax p / E, E ~ Exp(1)), which never reads a
value back to the host, so sampling stays inside the step's one sync.
"""

import math

import torch

from ...sampling import SamplingConfig


def apply_top_p(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """mlx-lm's apply_top_p: drop the tokens below the smallest set holding top_p of the mass."""
    sorted_logprobs = torch.sort(logprobs, dim=-1).values  # ascending
    sorted_probs = sorted_logprobs.float().exp()
    # Mass strictly above each sorted position: a reverse, exclusive cumulative sum.
    mass_from = torch.flip(torch.cumsum(torch.flip(sorted_probs, [-1]), dim=-1), [-1])
    mass_above = mass_from - sorted_probs
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(dim=-1, keepdim=True)
    threshold = torch.gather(sorted_logprobs, -1, num_dropped)
    return torch.where(logprobs < threshold, -math.inf, logprobs)


def apply_min_p(logprobs: torch.Tensor, min_p: float) -> torch.Tensor:
    """mlx-lm's apply_min_p (min_tokens_to_keep=1): drop tokens below min_p x the top one."""
    top = logprobs.max(dim=-1, keepdim=True).values
    return torch.where(logprobs < top + math.log(min_p), -math.inf, logprobs)


def apply_top_k(logprobs: torch.Tensor, top_k: int) -> torch.Tensor:
    """mlx-lm's apply_top_k: keep exactly the top_k largest entries."""
    keep = torch.topk(logprobs, top_k, dim=-1).indices
    out = torch.full_like(logprobs, -math.inf)
    return out.scatter(-1, keep, torch.gather(logprobs, -1, keep))


def processed_logprobs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log of q: the target's distribution after truncation and temperature, (..., V)."""
    logprobs = logits.float()
    logprobs = logprobs - torch.logsumexp(logprobs, dim=-1, keepdim=True)
    if sampling.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p > 0.0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if 0 < sampling.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    scaled = logprobs * (1.0 / sampling.temp)
    return scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)


def reported_logprobs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """mlxspec.backends.mlx.sampling.reported_logprobs: q when sampling, the raw log-softmax when greedy."""
    if not sampling.greedy:
        return processed_logprobs(logits, sampling)
    return torch.log_softmax(logits.float(), dim=-1)


def categorical(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of (unnormalised, non-negative) probs: argmax of p / E, E ~ Exp(1)."""
    uniform = torch.rand(probs.shape, device=probs.device, dtype=torch.float32)
    # u < 1 so E > 0: zero-probability tokens score 0 and are never drawn.
    exponential = -torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.argmax(probs.float() / exponential, dim=-1)


def sample_token(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """One token per row of logits: argmax when greedy, else a draw from q."""
    if sampling.greedy:
        return torch.argmax(logits, dim=-1)
    return categorical(processed_logprobs(logits, sampling).exp())


def temperature_rows(temps: list[float], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' 1 / T (B, 1) (1 where greedy) and which rows are greedy (B,)."""
    inverse = torch.tensor([[1.0 / t if t > 0 else 1.0] for t in temps], dtype=torch.float32)
    return inverse.to(device), torch.tensor([t <= 0 for t in temps]).to(device)


def allowed_logits(logits: torch.Tensor, masks) -> torch.Tensor:
    """logits (K+1, V) with each row's tokens outside its grammar mask at -inf, as the MLX
    backend's allowed_logits: `masks` (K+1, words) int32 bit masks on the host."""
    words = torch.as_tensor(masks, dtype=torch.int32).to(logits.device)
    ids = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int32)
    bits = (words[:, (ids // 32).long()] >> (ids % 32)) & 1
    return logits.masked_fill(bits == 0, float("-inf"))
