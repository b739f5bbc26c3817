"""The array primitives (`xp`) through which the drafters' shared host sides (drafters.paired,
drafters.draft_model) make and stack tensors, in torch; drafters.paired.MLXArrays is MLX's.
"""

import torch

from .transfer import host_tokens


class TorchArrays:
    """The array primitives the shared host sides use, in torch on one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def ids(self, tokens: list[int]) -> torch.Tensor:
        return host_tokens(tokens, self.device)[None]

    argmax = staticmethod(torch.argmax)
    stack = staticmethod(torch.stack)

    @staticmethod
    def cat(tensors, axis: int = 0) -> torch.Tensor:
        return torch.cat(tensors, dim=axis)

    def eye(self, n: int) -> torch.Tensor:
        return torch.eye(n, dtype=torch.bool, device=self.device)

    def ones(self, rows: int, columns: int) -> torch.Tensor:
        return torch.ones((rows, columns), dtype=torch.bool, device=self.device)

    def full(self, n: int, value: int) -> torch.Tensor:
        return torch.full((n,), value, device=self.device)

    @staticmethod
    def top(x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.argsort(x, descending=True, stable=True)[:k]

    @staticmethod
    def read(tensors) -> list[list]:
        return [t.tolist() for t in tensors]  # the first waits for the proposal; the rest copy
