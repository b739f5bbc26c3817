"""DFlash2 drafting for the shared loop: DFlash's block pass (models.dflash2 adds its
convolutions), then the candidate selector's walk instead of each slot's argmax.

Greedy, the walk takes each step's best pair score and the drafts are deterministic (one-hot p).
Sampling, each step draws from softmax(S_t / T) over its slot's candidates, and that q (zero off
the candidates) goes with the draft as Draft.probs: the loop's rejection rule, min(1, p / q) and
the residual max(0, p - q), then keeps the output the target's own in distribution. The walk
runs on the device: a chain reads nothing back to the host, alone or in a batch.

Everything else is DFlash's (drafters.dflash): the context kept as K/V of the target's
features, deferred while the drafter drafts nothing, the block shrunk near max_tokens, the
checkpoint checked against the target before any weight loads.
"""

from ..engine import EMPTY_DRAFT, Draft
from ..backends.mlx.target_parts import target_sizes
from ..models.dflash2 import DFlash2Config, DFlash2Model, proposal_probs
from ..sampling import SamplingConfig
from .dflash import DFlashDrafter, DFlashDrafting, load_checked_model, read_checkpoint


class DFlash2Drafting(DFlashDrafting):
    """The host side of DFlash2 drafting, one for both backends: chains only (z-lab grows no
    tree over the walk), over the full vocabulary (the codebooks are indexed by target token).
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


class DFlash2Drafter(DFlash2Drafting, DFlashDrafter):
    """DFlash2 on MLX: a chain reads nothing back to the host; a batch's rows draft in one
    pass (DFlashDrafter.propose_together)."""

    def _proposal_probs(self, ids, q, vocab_size: int):
        return proposal_probs(ids, q, vocab_size)


def load_dflash2_drafter(path, *, model, tokenizer=None, block_size: int | None = None,
                         dtype=None, window: int | None = None) -> DFlash2Drafter:
    """Load a DFlash2 checkpoint (z-lab's DFlash2DraftModel layout: config.json with a
    dflash_config naming its convolutions and selector, *.safetensors) for target `model`, from
    a directory or a Hub repo id (through the Hugging Face cache; HF_HUB_OFFLINE applies).

    The config is checked against the target, then every weight name and shape against the
    config, before any compute. `block_size`, `dtype` and `window` are DFlash's (see
    drafters.dflash.load_dflash_drafter). `tokenizer` is accepted for symmetry."""
    path, args, options = read_checkpoint(path, target_sizes(model), block_size=block_size,
                                          draft_vocab=False, tree_budget=None, tree_width=4,
                                          window=window, config_class=DFlash2Config)
    drafter_model, parts = load_checked_model(path, args, model, dtype, DFlash2Model)
    return DFlash2Drafter(drafter_model, block_size=options["block_size"], **parts)
