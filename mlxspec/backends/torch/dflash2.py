"""DFlash2 in torch: models.dflash2's convolutions and candidate selector over the torch DFlash
backbone (backends.torch.dflash), same math, same z-lab checkpoint names, under the shared host
side (drafters.dflash2.DFlash2Drafting). Only what DFlash2 adds lives here."""

import torch
import torch.nn.functional as F
from torch import nn

from ...drafters.dflash import read_checkpoint
from ...drafters.dflash2 import DFlash2Drafting
from ...models.dflash2 import DFlash2Config
from .dflash import DecoderLayer, DFlashModel, TorchDFlashDrafter, load_checked_model
from .sampling import categorical, temperature_rows
from .target import target_sizes


def grouped_convolve(y: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """models.dflash2.grouped_convolve: y (B, L, H), taps dynamic (B, L, K, G), base (K, H)."""
    B, L, H = y.shape
    groups = H // group_size
    blocks = y.reshape(B, L, groups, group_size)
    out = torch.zeros_like(blocks)
    for k in range(min(base.shape[0], L)):  # a tap past slot 0 reads only zeros
        values = blocks if k == 0 else F.pad(blocks[:, : L - k], (0, 0, 0, 0, k, 0))
        out = out + base[k].to(y.dtype).reshape(1, 1, groups, group_size) * values
        out = out + dynamic[:, :, k, :, None] * values
    return out.reshape(B, L, H)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def prepare(self, x: torch.Tensor):
        B, L, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, -1)
        return (grouped_convolve(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size),
                dynamic[:, :, 1])

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_convolve(x, dynamic, self.base_kernel[1], self.group_size)


class DecoderLayer2(DecoderLayer):
    def __init__(self, args: DFlash2Config, layer_type: str):
        super().__init__(args, layer_type)
        conv = (args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(*conv)
        self.mlp_conv = GroupedDynamicCausalConv(*conv)

    def around(self, x, attend):
        n, taps = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(attend(n), taps)
        m, taps = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), taps)


class CandidateSelector(nn.Module):
    """models.dflash2.CandidateSelector: the walk over each slot's top-k by pair scores."""

    def __init__(self, args: DFlash2Config):
        super().__init__()
        self.top_k = args.selector_top_k
        rank = args.selector_rank
        self.hidden_projection = nn.Linear(args.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(args.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(args.vocab_size, rank))

    def candidates(self, logits: torch.Tensor):
        unary, ids = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        return ids, unary

    def scores(self, projected, unary, ids, predecessors) -> torch.Tensor:
        edge = self.predecessor_codebook[predecessors] * projected  # (B, R)
        return unary + (self.successor_codebook[ids] @ edge[:, :, None])[..., 0]

    def walk(self, hidden, logits, anchors, temps: list[float]):
        """(drafts (B, n), (candidate ids, q) (B, n, k) each or None), as on MLX."""
        ids, unary = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        sampled = any(t > 0 for t in temps)
        if sampled:  # a greedy walk moves nothing from the host
            inverse, greedy_rows = temperature_rows(temps, hidden.device)
        predecessor, path, qs = anchors, [], []
        for t in range(hidden.shape[1]):
            scores = self.scores(projected[:, t], unary[:, t], ids[:, t], predecessor)
            index = torch.argmax(scores, dim=-1)
            if sampled:
                q = torch.softmax(scores.float() * inverse, dim=-1)
                index = torch.where(greedy_rows, index, categorical(q))
                qs.append(q)
            predecessor = torch.gather(ids[:, t], -1, index[:, None])[:, 0]
            path.append(predecessor)
        drafts = torch.stack(path, dim=1)
        return drafts, ((ids, torch.stack(qs, dim=1)) if qs else None)

    def pair_logprobs(self, hidden, logits, anchor):
        """models.dflash2.CandidateSelector.pair_logprobs: ids, first (k,), pairs (n-1, k, k)."""
        ids, unary = self.candidates(logits)
        ids, unary, projected = ids[0], unary[0], self.hidden_projection(hidden)[0]
        first = self.scores(projected[:1], unary[:1], ids[:1], anchor)[0]
        edge = self.predecessor_codebook[ids[:-1]] * projected[1:, None, :]
        pairs = unary[1:, None, :] + edge @ self.successor_codebook[ids[1:]].transpose(-1, -2)
        return (ids, torch.log_softmax(first.float(), dim=-1),
                torch.log_softmax(pairs.float(), dim=-1))

    def forced_q(self, hidden, logits, anchors, drafts, temp: float):
        """(candidate ids, q) (B, n, k) of the walk that drew `drafts` (B, n)."""
        ids, unary = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        before = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)
        B, n = before.shape
        scores = self.scores(projected.reshape(B * n, -1), unary.reshape(B * n, -1),
                             ids.reshape(B * n, -1), before.reshape(-1)).reshape(B, n, -1)
        return ids, torch.softmax(scores.float() / temp, dim=-1)


class DFlash2Model(DFlashModel):
    layer_class = DecoderLayer2

    def __init__(self, args: DFlash2Config, *, own_embed: bool = False, own_head: bool = False):
        super().__init__(args, own_embed=own_embed, own_head=own_head)
        self.candidate_selector = CandidateSelector(args)


class TorchDFlash2Drafter(DFlash2Drafting, TorchDFlashDrafter):
    """DFlash2 on torch: one sequence at a time, its chain read back only by the loop."""

    def _proposal_probs(self, ids, q, vocab_size: int):
        dense = q.new_zeros((q.shape[0], vocab_size))
        return dense.scatter(-1, ids, q)


def load_dflash2_drafter(path, *, model, tokenizer=None, block_size: int | None = None,
                         tree_budget: int | None = None, tree_width: int = 4,
                         window: int | None = None) -> TorchDFlash2Drafter:
    """Load a DFlash2 checkpoint for a transformers target `model` (see the MLX loader); the
    drafter runs on the target's device, in the target's dtype."""
    path, args, options = read_checkpoint(path, target_sizes(model), block_size=block_size,
                                          draft_vocab=False, tree_budget=tree_budget,
                                          tree_width=tree_width, window=window,
                                          config_class=DFlash2Config)
    drafter_model, parts = load_checked_model(path, args, model, DFlash2Model)
    return TorchDFlash2Drafter(drafter_model, **options, **parts)
