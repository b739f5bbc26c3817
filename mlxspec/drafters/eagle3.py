"""EAGLE-3 drafting for the shared loop: a chain of K autoregressive drafter steps, or a tree.

The chain, the tree and their bookkeeping are drafters/paired.py's, shared with MTP drafting;
this module sets them up from an EAGLE-3 checkpoint: the target layers it reads, its feature
width, its draft vocabulary (d2t), and its default chain length. Eagle3Drafting is the host
side for both backends; Eagle3Drafter adds MLX's tensor math,
mlxspec.backends.torch.eagle3.TorchEagle3Drafter torch's.
"""

from ..backends.mlx.hidden_states import decoder_layers
from .paired import (  # noqa: F401  (re-exported: the tree helpers' old home)
    MLXArrays,
    MLXPairedDrafting,
    PairedDrafting,
    best_nodes,
    candidate_parents,
    check_tree_options,
)


class Eagle3Drafting(PairedDrafting):
    """PairedDrafting set up from an EAGLE-3 model (models.eagle3.Eagle3Model or its torch
    twin): its aux layers' features, projected by its fc, and its draft vocabulary."""

    name = "eagle3"

    def __init__(self, model, *, num_target_layers: int, target_vocab: int, **tree_options):
        self.args = args = model.args
        maps_vocab = args.uses_draft_vocab or model.d2t is not None
        super().__init__(
            model, capture_layers=args.capture_layers(num_target_layers),
            feature_width=args.num_aux_layers * args.target_hidden_size,
            target_vocab=target_vocab, default_num_draft=int(args.num_speculative_tokens or 3),
            hot_ids=model.target_ids() if maps_vocab else None,
            draft_rows=args.draft_vocab_size, **tree_options)


class Eagle3Drafter(Eagle3Drafting, MLXPairedDrafting):
    """EAGLE-3 on MLX: a chain reads nothing back to the host."""


def load_eagle3_drafter(path, *, model, tokenizer=None, dtype=None, tree_budget: int | None = None,
                        tree_width: int = 4, tree_depth: int = 6,
                        window: int | None = None) -> Eagle3Drafter:
    """Load an EAGLE-3 checkpoint directory (speculators or SpecForge/SGLang layout) for target
    `model`, checked against it before any compute (see eagle3_loading.load_eagle3_model).
    `tokenizer` is accepted for symmetry with other drafters.
    `tree_budget`: draft EAGLE-2's dynamic tree of up to this many nodes, `tree_width` children
    per node and `tree_depth` levels, instead of a chain.
    `window`: each entry attends to at most this many drafter cache entries (its own
    included), so a step's cost stops growing with the context (drafts only: the output is
    the target's either way)."""
    from ..backends.mlx.target_parts import target_sizes
    from .eagle3_loading import load_eagle3_model

    check_tree_options(tree_budget, tree_width, tree_depth)
    drafter_model = load_eagle3_model(path, model=model, dtype=dtype, window=window)
    _, vocab, _ = target_sizes(model)
    return Eagle3Drafter(drafter_model, num_target_layers=len(decoder_layers(model)),
                         target_vocab=vocab, tree_budget=tree_budget, tree_width=tree_width,
                         tree_depth=tree_depth)
