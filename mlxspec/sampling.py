"""Sampling settings: what defines the processed distribution q that every path samples from
(each backend computes q itself: mlxspec.backends.mlx.sampling, mlxspec.backends.torch.sampling)."""

import math
from dataclasses import dataclass
from numbers import Integral, Real


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
