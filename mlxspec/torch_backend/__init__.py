"""The torch backend: the same loop (mlxspec.engine.speculative_tokens) over transformers models.

Only reached through `mlxspec.load(..., backend="torch")` (or a transformers model handed to
`stream_generate`); importing this package imports torch, and nothing on the MLX path imports it.
Targets are transformers causal LMs with a cropped DynamicCache; acceptance, the processed
distribution q, the draft-model drafter and DFlash are torch twins of the MLX ones; prompt lookup
works on host token lists and is shared.
"""

import torch

from .dflash import TorchDFlashDrafter, load_dflash_drafter
from .draft_model import TorchDraftModelDrafter
from .loading import load, load_causal_lm, resolve_device, resolve_dtype
from .target import TorchPromptCache, TorchTarget, context_length, model_device

__all__ = [
    "TorchDFlashDrafter",
    "TorchDraftModelDrafter",
    "TorchPromptCache",
    "TorchTarget",
    "context_length",
    "load",
    "load_dflash_drafter",
    "load_draft_model_drafter",
    "peak_memory_gb",
    "seed",
]


def load_draft_model_drafter(path, *, model, tokenizer, **options) -> TorchDraftModelDrafter:
    """The draft-model drafter for a transformers target `model` (see the drafter registry): a
    model with the target's tokenizer, on the target's device and in its dtype."""
    from ..drafters.draft_model import check_same_tokenizer
    from ..loading import check_model_dir, resolve_model_dir

    draft_dir = resolve_model_dir(path, **options)
    check_model_dir(draft_dir)
    draft_model, draft_tokenizer = load(draft_dir, device=model_device(model), dtype=model.dtype)
    check_same_tokenizer(tokenizer, draft_tokenizer, vocab_size(model), vocab_size(draft_model))
    return TorchDraftModelDrafter(draft_model)


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
