"""Host values onto the device without waiting for the device's queued work."""

from typing import Sequence

import torch


def host_tokens(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host token ids as a device tensor without stalling on queued GPU work: a plain
    `torch.tensor(..., device="cuda")` waits for the stream (an implicit sync per step); a pinned
    buffer copied asynchronously does not (the caching host allocator keeps it alive)."""
    tensor = torch.tensor(list(values), dtype=torch.long)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
