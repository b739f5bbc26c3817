"""DFlash2 drafting for the shared loop: DFlash's block pass (models.dflash2 adds its
convolutions), then the candidate selector's walk instead of each slot's argmax.

Greedy, the walk takes each step's best pair score and the drafts are deterministic (one-hot p).
Sampling, each step draws from softmax(S_t / T) over its slot's candidates, and that q (zero off
the candidates) goes with the draft as Draft.probs: the loop's rejection rule, min(1, p / q) and
the residual max(0, p - q), then keeps the output the target's own in distribution. The walk
runs on the device: a chain reads nothing back to the host, alone or in a batch.

With --tree-budget, a step drafts a tree instead (`_propose_tree`): DDTree's best-first growth
over the same candidates, a node's children ranked by the pair scores after its own token.

Everything else is DFlash's (drafters.dflash): the context kept as K/V of the target's
features, deferred while the drafter drafts nothing, the block shrunk near max_tokens, the
checkpoint checked against the target before any weight loads.
"""

from ..engine import EMPTY_DRAFT, Draft
from ..backends.mlx.target_parts import target_sizes
from ..models.dflash2 import DFlash2Config, DFlash2Model, proposal_probs
from ..sampling import SamplingConfig
from ..tree import best_first_conditional
from .dflash import DFlashDrafter, DFlashDrafting, load_checked_model, read_checkpoint


class DFlash2Drafting(DFlashDrafting):
    """The host side of DFlash2 drafting, one for both backends: chains, or trees over the
    candidates (z-lab grows none), over the full vocabulary (the codebooks are indexed by
    target token).
    A backend's subclass brings the model (models.dflash2's or its torch twin) and
    `_proposal_probs`."""

    name = "dflash2"

    def _block_drafts(self, hidden, pending: list[int], sizes: list[int],
                      samplings: list[SamplingConfig]) -> list[Draft]:
        """Blocks' hidden states (B, L, H) after each row's pending token -> each row's walk
        over its first sizes[i] slots, from that token; a sampling row's with its proposal q.
        DFlash's propose (and, on MLX, propose_together) runs the block pass."""
        slots = hidden[:, 1:]
        logits = self.model.compute_logits(self._in_head_dtype(slots), self.lm_head)
        temps = [s.temp for s in samplings]
        drafts, proposal = self.model.candidate_selector.walk(
            slots, logits, self._ids(pending)[0], temps)
        out = []
        for i, n in enumerate(sizes):
            if n == 0:
                out.append(EMPTY_DRAFT)
                continue
            probs = None
            if temps[i] > 0:
                ids, q = proposal
                probs = self._proposal_probs(ids[i, :n], q[i, :n], logits.shape[-1])
            out.append(Draft(tokens=drafts[i, :n], probs=probs))
        return out

    def _proposal_probs(self, ids, q, vocab_size: int):
        """q over each slot's candidates (n, k) -> the dense (n, V) proposal Draft.probs holds."""
        raise NotImplementedError

    def _propose_tree(self, tokens: list[int], slots: int, budget: int) -> Draft:
        """The block's candidates grown best-first into the `budget` most probable branches, a
        node's children its slot's `tree_width` candidates ranked by their pair scores after
        the node's token (log softmax S, the walk's own scores): DDTree with the selector's
        bigram, read to the host once. The first chain is the greedy walk. Children are
        deterministic (Draft.probs None), which the tree rule keeps lossless when sampling."""
        hidden = self.block_hidden(tokens, slots)[:, 1:]
        logits = self.model.compute_logits(self._in_head_dtype(hidden), self.lm_head)
        ids, first, pairs = self._host_lists(*self.model.candidate_selector.pair_logprobs(
            hidden, logits, self._ids(tokens[-1:])[0]))
        width = self.tree_width

        def ranked(row):
            return sorted(zip(row, range(len(row))), reverse=True)[:width]

        rows = [ranked(first)] + [[ranked(after) for after in slot] for slot in pairs]
        choices, shape = best_first_conditional(
            lambda depth, above: rows[0] if depth == 0 else rows[depth][above], len(rows), budget)
        drafts = [ids[shape.depth[node] - 1][c] for node, c in enumerate(choices, start=1)]
        return Draft(tokens=drafts, parents=shape.parents)


class DFlash2Drafter(DFlash2Drafting, DFlashDrafter):
    """DFlash2 on MLX: a chain reads nothing back to the host; a batch's rows draft in one
    pass (DFlashDrafter.propose_together)."""

    def _proposal_probs(self, ids, q, vocab_size: int):
        return proposal_probs(ids, q, vocab_size)


def load_dflash2_drafter(path, *, model, tokenizer=None, block_size: int | None = None,
                         tree_budget: int | None = None, tree_width: int = 4, dtype=None,
                         window: int | None = None) -> DFlash2Drafter:
    """Load a DFlash2 checkpoint (z-lab's DFlash2DraftModel layout: config.json with a
    dflash_config naming its convolutions and selector, *.safetensors) for target `model`, from
    a directory or a Hub repo id (through the Hugging Face cache; HF_HUB_OFFLINE applies).

    The config is checked against the target, then every weight name and shape against the
    config, before any compute. `tree_budget`: draft a tree of up to this many nodes, each
    node's `tree_width` best successors by pair score. `block_size`, `dtype` and `window` are
    DFlash's (see
    drafters.dflash.load_dflash_drafter). `tokenizer` is accepted for symmetry."""
    path, args, options = read_checkpoint(path, target_sizes(model), block_size=block_size,
                                          draft_vocab=False, tree_budget=tree_budget,
                                          tree_width=tree_width, window=window,
                                          config_class=DFlash2Config)
    drafter_model, parts = load_checked_model(path, args, model, dtype, DFlash2Model)
    return DFlash2Drafter(drafter_model, **options, **parts)
