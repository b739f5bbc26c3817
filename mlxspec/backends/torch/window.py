"""A drafter window on torch (`--drafter-window N`): mlxspec.backends.mlx.window.window_mask's
rule as a mask only (torch's attention reads every key either way), shared by the EAGLE-3 and
MTP twins. Pair i sits at position i + 1, as mlxspec.drafters.paired counts."""

import torch


def window_mask(past: int, positions: torch.Tensor, mask: torch.Tensor,
                window: int) -> torch.Tensor:
    """`mask` (L, past + L) narrowed so entry e at position p_e sees only entries at positions
    in (p_e - window, p_e]. `positions` (L,): the new entries'; in a tree (entries not in
    position order) the cached entries of earlier depths count as just behind the lowest."""
    behind = torch.arange(1, past + 1, device=positions.device).clamp(
        max=int(positions.min()) - 1)
    keys = torch.cat([behind, positions])
    return mask & (positions[:, None] - keys[None] < window)
