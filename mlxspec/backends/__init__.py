"""The backends that run a target: MLX (mlx-lm models) and torch (transformers models, the
`torch` extra), with one loop (mlxspec.engine) over either.

Everything that differs between them is a field of `Backend`. Code elsewhere asks
`backend_for(model)` (the model's own type decides) or `backend_named(name)` (`--backend`,
`load(..., backend=...)`) rather than comparing names; a backend's modules are imported when it
is first asked for, so the MLX path never imports torch.
"""

import sys
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Iterator

from ..extras import require
from ..target_sizes import TargetSizes

BACKENDS = ("mlx", "torch")


@dataclass(frozen=True)
class Backend:
    """What the API, the CLI and the drafters need of a backend beyond the shared loop."""

    name: str
    # (device, dtype) -> (model directory -> (model, tokenizer)); a device that is not there
    # fails here, before a model is resolved or converted.
    loader: Callable[[Any, Any], Callable]
    target: type
    prompt_cache: type
    seed: Callable[[int], None]
    peak_memory_gb: Callable[[Any], float]
    context_length: Callable[[Any], "int | None"]
    vocab_size: Callable[[Any], int]
    target_sizes: Callable[[Any], TargetSizes]  # what drafter checkpoints are checked against
    embedding_checksum: Callable[[Any], float]  # tells shipped drafters' targets apart
    describe: Callable[[Any], str]  # where a model runs, for --verbose and bench reports
    run_steps: Callable[[Iterator], Iterator] = iter  # each step of the loop, run as it needs
    # (model, device) -> the trainers' steps and feature pass on this backend, over its own copy
    # of the target (torch: TorchTraining); None: the trainers' own MLX steps.
    training: "Callable[[Any, Any], Any] | None" = None
    # (model, capture_layers=) -> a target verifying many sequences at once (mlxspec.batch);
    # None: this backend runs one sequence at a time.
    batch_target: "type | None" = None
    devices: bool = False  # load(device=, torch_dtype=) and --device choose where it runs
    mlx_lm: bool = False  # runs mlx-lm models: split targets, mlx-lm as a bench peer


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return name


def backend_named(name: str) -> Backend:
    """The backend called `name`; its extra must be installed (say so before any model work)."""
    check_backend(name)
    if name == "torch":
        require_torch()
    return _BUILDERS[name]()


def backend_for(model, name: str | None = None) -> Backend:
    """The backend that runs `model`: its own type decides (a torch module, possible only once
    torch is imported, runs on torch; anything else on MLX). `name`, when given, is checked
    against it."""
    torch = sys.modules.get("torch")
    actual = "torch" if torch is not None and isinstance(model, torch.nn.Module) else "mlx"
    if name is not None and check_backend(name) != actual:
        raise ValueError(
            f"backend={name!r} but the model is a {actual} model; load it with "
            f"mlxspec.load(..., backend={name!r})"
        )
    return backend_named(actual)


def require_torch() -> None:
    """The torch backend needs the `torch` extra."""
    require(("torch", "transformers"), "the torch backend", "torch")


@cache
def _mlx() -> Backend:
    import mlx.core as mx

    from .._blas import blas_in_use
    from .mlx.target_parts import embedding_checksum, target_sizes
    from .mlx.loading import loader
    from .mlx.batch_target import MLXBatchTarget
    from .mlx.target import MLXTarget, PromptCache, context_length, stage_of, vocab_size

    def describe(model) -> str:
        stage = stage_of(model)
        return f"BLAS: {blas_in_use()}" + (f"; {stage.describe()}" if stage is not None else "")

    return Backend(
        "mlx", loader, MLXTarget, PromptCache, mx.random.seed,
        peak_memory_gb=lambda model: mx.get_peak_memory() / 1e9,
        context_length=context_length, vocab_size=vocab_size, target_sizes=target_sizes,
        embedding_checksum=embedding_checksum,
        describe=describe, batch_target=MLXBatchTarget, mlx_lm=True,
    )


@cache
def _torch() -> Backend:
    from . import torch as tb
    from .torch.target import embedding_checksum, target_sizes

    return Backend(
        "torch", tb.loader, tb.TorchTarget, tb.TorchPromptCache, tb.seed,
        peak_memory_gb=tb.peak_memory_gb, context_length=tb.context_length,
        vocab_size=tb.vocab_size, target_sizes=target_sizes,
        embedding_checksum=embedding_checksum, describe=tb.describe,
        run_steps=tb.run_steps, training=_torch_training, devices=True,
    )


def _torch_training(model, device=None):
    """The torch backend's `Backend.training`: imported when a run first needs it."""
    from .torch.dflash_training import TorchTraining

    return TorchTraining(model, device=device)


_BUILDERS = {"mlx": _mlx, "torch": _torch}
