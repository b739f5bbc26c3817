"""The torch backend: the same loop (mlxspec.engine.speculative_tokens) over transformers models.

Only reached through `mlxspec.load(..., backend="torch")` (or a transformers model handed to
`stream_generate`), by way of its record in mlxspec.backends; importing this package imports
torch, and nothing on the MLX path imports it.
Targets are transformers causal LMs with a cropped DynamicCache; acceptance, the processed
distribution q and DFlash's backbone are torch twins of the MLX ones; the draft-model, DFlash2 and
DSpark drafters are torch tensor math (DFlash2's and DSpark's only what they add to the backbone)
under the MLX ones' host side; prompt lookup works on host token lists and is shared.
"""

import torch

from .dflash import TorchDFlashDrafter, load_dflash_drafter
from .draft_model import TorchDraftModelDrafter
from .loading import load, load_causal_lm, loader, resolve_device, resolve_dtype
from .target import TorchPromptCache, TorchTarget, context_length, model_device

__all__ = [
    "TorchDFlashDrafter",
    "TorchDraftModelDrafter",
    "TorchPromptCache",
    "TorchTarget",
    "context_length",
    "describe",
    "load",
    "load_dflash_drafter",
    "loader",
    "peak_memory_gb",
    "run_steps",
    "seed",
    "vocab_size",
]


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def seed(value: int) -> None:
    torch.manual_seed(value)  # every device's generator


def peak_memory_gb(model) -> float:
    """Peak memory of the model's CUDA device (0 on the CPU, which torch does not track)."""
    device = model_device(model)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return 0.0


def describe(model) -> str:
    return f"torch: {model.device}, {str(model.dtype).replace('torch.', '')}"


def run_steps(steps):
    """Each step of a torch-backend loop with OpenBLAS on one thread (see
    `_blas.openblas_single_thread`); restored between steps, so the caller's MLX code is not."""
    from ..._blas import openblas_single_thread

    while True:
        with openblas_single_thread():
            item = next(steps, None)
        if item is None:
            return
        yield item
