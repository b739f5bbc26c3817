"""Medusa drafting: heads on the target's last hidden state propose the next few tokens at once.

Head i ranks the token i+2 past the last committed position, from that position's hidden state
alone (models/medusa.py), so every draft of a step comes from the same pass's hidden state and
costs only the heads: no draft model, no autoregressive drafting. The hidden state is the target
pass's own (its last layer, captured, then its final norm): the verify pass that commits tokens
hands over the hidden state of the last of them, which conditions the next step's drafts.

A chain takes each head's best token (greedy) or a sample of its processed distribution, which
is reported as p (exact min(1, q/p) acceptance). A tree (`tree_budget`) takes each head's
`tree_width` best tokens and grows the `tree_budget` most probable branches (DDTree's best-first
construction over independent per-depth candidates, rather than the Medusa paper's fixed tree
of choices calibrated on Vicuna-7B), verified in one pass with the exact multi-candidate rule
(never Medusa's typical acceptance, which is not lossless).
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..engine import EMPTY_DRAFT, Draft, Drafter, Verdict
from ..backends.mlx.hidden_states import decoder_layers
from ..models.medusa import check_checkpoint, load_heads
from ..sampling import SamplingConfig
from ..backends.mlx.sampling import processed_logprobs
from ..backends.mlx.target_parts import target_embedding, target_final_norm, target_head, target_sizes
from ..tree import check_tree
from .ddtree import best_first_draft


class MedusaDrafter(Drafter):
    """Drafts from Medusa heads (models/medusa.py) on the target's last committed hidden state:
    up to one token per head as a chain, or a tree of the heads' best tokens."""

    name = "medusa"

    def __init__(self, heads, target, *, tree_budget: int | None = None, tree_width: int = 4):
        self.heads = heads
        self.norm = target_final_norm(target)
        self.capture_layers = (len(decoder_layers(target)) - 1,)
        self.max_draft = self.default_num_draft = heads.num_heads
        self.tree_budget, self.tree_width = check_tree(tree_budget, tree_width)
        self.draft_trees(self.tree_budget)
        self._hidden = None  # (1, H): the last committed position's normed hidden state

    def _keep_last(self, features) -> None:
        if features is None:
            raise ValueError("the medusa drafter needs target hidden states: build the target "
                             "with capture_layers=drafter.capture_layers")
        if features.shape[0] == 0:  # a one-token prompt: no position conditions a draft yet
            self._hidden = None
            return
        last = features[-1:]
        self._hidden = self.norm(last) if self.norm is not None else last

    def begin(self, prompt, features=None):
        self._keep_last(features)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self._keep_last(verdict.features)

    def head_logits(self, count: int) -> mx.array:
        """The first `count` heads' logits (count, V) for the tokens after the pending one."""
        return self.heads(self._hidden.astype(self.heads.dtype), count)[:, 0].astype(mx.float32)

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        if k < 1 or self._hidden is None:
            return EMPTY_DRAFT
        logits = self.head_logits(min(k, self.heads.num_heads))
        if self.tree_budget is not None:  # k is the node budget; depth is one per head
            logprobs = (nn.log_softmax(logits, axis=-1) if sampling.greedy
                        else processed_logprobs(logits, sampling))
            return best_first_draft(logprobs, self.tree_width, k)
        if sampling.greedy:
            return Draft(tokens=mx.argmax(logits, axis=-1).astype(mx.int32))
        logp = processed_logprobs(logits, sampling)
        return Draft(tokens=mx.random.categorical(logp).astype(mx.int32), probs=mx.exp(logp))


def check_medusa_checkpoint(path, model) -> None:
    hidden, vocab, _ = target_sizes(model)
    check_checkpoint(Path(path), hidden, vocab)


def load_medusa_drafter(path, *, model, tokenizer=None, tree_budget: int | None = None,
                        tree_width: int = 4) -> MedusaDrafter:
    """Medusa heads for mlx-lm target `model` from checkpoint directory `path` (config.json +
    medusa_lm_head.safetensors, the published layout); `tree_budget`: a tree of up to that many
    nodes, `tree_width` best tokens per head, instead of a chain."""
    check_tree(tree_budget, tree_width)
    hidden, vocab, _ = target_sizes(model)
    heads = load_heads(Path(path), hidden, vocab, target_head(model), dtype=compute_dtype(model))
    return MedusaDrafter(heads, model, tree_budget=tree_budget, tree_width=tree_width)



def compute_dtype(model):
    """The target's floating dtype (a quantized target's scales'): heads stored in bf16 to ship
    small run in the dtype of the hidden states they read."""
    embedding = target_embedding(model)
    return getattr(embedding, "scales", embedding.weight).dtype
