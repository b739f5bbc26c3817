"""DSpark in torch: models.dspark's Markov and confidence heads and its walk over the torch DFlash
backbone (backends.torch.dflash, interleaved RoPE for LFM2.5's layout), same math, same
checkpoint names, under the shared host side (drafters.dspark.DSparkDrafting). Only what DSpark
adds lives here."""

import torch
from torch import nn

from ...drafters.dflash import read_checkpoint
from ...drafters.dspark import DSparkDrafting
from ...file_checks import check_safetensors, safetensors_files
from ...models.dspark import DSparkConfig
from .dflash import DFlashModel, TorchDFlashDrafter, load_checked_model
from .sampling import categorical, temperature_rows
from .target import target_sizes


class MarkovHead(nn.Module):
    """The bigram bias W1[x_{k-1}] W2^T."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features)[..., 0].float())


class DSparkModel(DFlashModel):
    """models.dspark.DSparkModel in torch: DFlash's backbone, then the walk over its block."""

    def __init__(self, args: DSparkConfig, *, own_embed: bool = False, own_head: bool = False):
        super().__init__(args, own_embed=own_embed, own_head=own_head)
        if args.markov_rank:
            self.markov_head = MarkovHead(args.vocab_size, args.markov_rank)
        if args.enable_confidence_head:
            self.confidence_head = ConfidenceHead(args.confidence_width)

    def confidence_input(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        if not self.args.confidence_head_with_markov:
            return hidden
        before = self.markov_head.markov_w1(previous).to(hidden.dtype)
        return torch.cat([hidden, before], dim=-1)

    @staticmethod
    def prefix_survival(confidence: torch.Tensor) -> list[float]:
        return torch.cumprod(confidence, dim=0).tolist() if confidence.numel() else []

    def walk(self, hidden, logits, anchors, temps: list[float], forced=None):
        """(drafts (B, n), q (B, n, V) or None, confidences (B, n) or None), as on MLX."""
        markov = getattr(self, "markov_head", None)
        confidence = getattr(self, "confidence_head", None)
        sampled = any(t > 0 for t in temps)
        if sampled:  # a greedy walk moves nothing from the host
            inverse, greedy_rows = temperature_rows(temps, hidden.device)
        previous, drafts, qs, confidences = anchors, [], [], []
        for k in range(hidden.shape[1]):
            step = logits[:, k]
            if markov is not None:
                step = step + markov(previous).to(step.dtype)
            if confidence is not None:
                confidences.append(confidence(self.confidence_input(hidden[:, k], previous)))
            token = torch.argmax(step, dim=-1)
            if sampled:
                q = torch.softmax(step.float() * inverse, dim=-1)
                qs.append(q)
                token = torch.where(greedy_rows, token, categorical(q))
            previous = token if forced is None else forced[:, k]
            drafts.append(previous)
        return (torch.stack(drafts, dim=1), torch.stack(qs, dim=1) if qs else None,
                torch.stack(confidences, dim=1) if confidences else None)


class TorchDSparkDrafter(DSparkDrafting, TorchDFlashDrafter):
    """DSpark on torch: one sequence at a time; the confidence head sets K as on MLX."""

    propose = torch.inference_mode()(DSparkDrafting.propose)


def load_dspark_drafter(path, *, model, tokenizer=None, window: int | None = None,
                        confidence_k: bool = True) -> TorchDSparkDrafter:
    """Load a DSpark checkpoint (either published layout) for a transformers target `model`
    (see the MLX loader); the drafter runs on the target's device, in the target's dtype."""
    path, args, _ = read_checkpoint(path, target_sizes(model), block_size=None,
                                    draft_vocab=False, tree_budget=None, tree_width=4,
                                    window=window, config_class=DSparkConfig)
    args.read_head_width(check_safetensors(safetensors_files(path)))
    drafter_model, parts = load_checked_model(path, args, model, DSparkModel)
    return TorchDSparkDrafter(drafter_model, confidence_k=confidence_k, **parts)
