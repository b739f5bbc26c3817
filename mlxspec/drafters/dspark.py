"""DSpark drafting for the shared loop: DFlash's block pass over all B slots, then the Markov
head's walk (models.dspark), and the confidence head's say in how many drafts a step keeps.

Every slot drafts, so a step proposes up to B tokens; the block always has all B slots, and a
draft of K is the first K of the walk (`free_drafts`: a batch drafts first and cuts to its
width). Greedy, each step takes the argmax of the slot's logits plus the bigram bias; sampling,
each step draws from softmax((logits + bias) / T) and that q goes with the draft as Draft.probs,
for the loop's rejection rule.

Where the checkpoint has a confidence head, the draft length is ConfidenceDraftLength (a
ScoredDraftLength that, after a step its scores cut to nothing, rests the drafter a few steps)
over the head's prefix survival, c_1 c_2 ... c_K (each c_k the predicted chance slot k is accepted given
the drafts before it; DSpark's scheduler ranks slots by the same product): the step keeps the K
maximising expected tokens per second against the measured step times, in place of the
acceptance the adaptive K would have guessed by position; in a batch the same products set each
row's share of the width. Reading them costs one read of the drafter's pass before the target's
is queued. Without the head, DFlash's adaptive K.
"""

import mlx.core as mx

from ..backends.mlx.target_parts import target_sizes
from ..draft_length import ConfidenceDraftLength
from ..engine import EMPTY_DRAFT, Draft
from ..file_checks import check_safetensors, safetensors_files
from ..models.dspark import DSparkConfig, DSparkModel
from ..sampling import SamplingConfig
from .dflash import DFlashDrafter, DFlashDrafting, load_checked_model, read_checkpoint


class DSparkDrafting(DFlashDrafting):
    """The host side of DSpark drafting, one for both backends: chains, over the full
    vocabulary. A backend's subclass brings the model (models.dspark's or its torch twin)."""

    name = "dspark"
    free_drafts = True

    def __init__(self, model, *, confidence_k: bool = True, **parts):
        super().__init__(model, **parts)
        self.confidence_k = confidence_k  # the head (where there is one) sets K, or adaptive K
        self.default_num_draft = self.max_draft = self.block_size  # the anchor's slot drafts too
        self._confidence = None  # the last draft's confidences (n,), on the device

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        n = min(k, self.block_size)
        if n < 1:
            return EMPTY_DRAFT
        hidden = self.block_hidden(tokens, self.block_size - 1)  # always the whole block
        return self._block_drafts(hidden, [tokens[-1]], [n], [sampling], [self])[0]

    def _block_drafts(self, hidden, pending, sizes, samplings, drafters=None) -> list[Draft]:
        """Whole blocks' hidden states (B, L, H) -> each row's walk over its first sizes[i]
        slots; a sampling row's with its q; each row's drafter keeps its confidences."""
        n = max(sizes)
        slots = hidden[:, :n]
        logits = self.model.compute_logits(self._in_head_dtype(slots), self.lm_head)
        temps = [s.temp for s in samplings]
        drafts, q, confidence = self.model.walk(slots, logits, self._ids(pending)[0], temps)
        out = []
        for i, size in enumerate(sizes):
            if confidence is not None and drafters is not None:
                drafters[i]._confidence = confidence[i, :size]
            if size == 0:
                out.append(EMPTY_DRAFT)
                continue
            probs = q[i, :size] if temps[i] > 0 else None
            out.append(Draft(tokens=drafts[i, :size], probs=probs))
        return out

    def confidence_reach(self) -> list[float]:
        """The last draft's prefix survival c_1, c_1 c_2, ... (read to the host)."""
        if self._confidence is None:
            return []
        return self.model.prefix_survival(self._confidence)

    def draft_policy(self, max_k: int, greedy: bool):
        if not self.confidence_k or getattr(self.model, "confidence_head", None) is None:
            return super().draft_policy(max_k, greedy)
        policies = self.__dict__.setdefault("_draft_policies", {})
        if (max_k, greedy) not in policies:
            policies[max_k, greedy] = ConfidenceDraftLength(max_k, lambda: self.confidence_reach())
        return policies[max_k, greedy]


class DSparkDrafter(DSparkDrafting, DFlashDrafter):
    """DSpark on MLX: alone, or a batch's rows in one pass."""

    @staticmethod
    def propose_together(drafters, tokens, ks, samplings):
        """Every row's whole block in one drafter pass, then one walk over the rows."""
        first = drafters[0]
        sizes = [max(min(k, d.block_size), 0) for d, k in zip(drafters, ks)]
        if not any(sizes):
            return [EMPTY_DRAFT] * len(drafters)
        for d, t in zip(drafters, tokens):
            d._rewind(len(t) - 1)
        mask, width = first.args.mask_token_id, first.block_size
        blocks = mx.array([[t[-1]] + [mask] * (width - 1) for t in tokens], dtype=mx.int32)
        hidden = first.model.rows(first._embed(blocks), [d.cache for d in drafters],
                                  [width] * len(drafters))
        return first._block_drafts(hidden, [t[-1] for t in tokens], sizes, samplings, drafters)


def load_dspark_drafter(path, *, model, tokenizer=None, dtype=None, window: int | None = None,
                        confidence_k: bool = True) -> DSparkDrafter:
    """Load a DSpark checkpoint for target `model` (DeepSpec's Qwen3DSparkModel layout, or
    LiquidAI's LFM2.5 Lfm2DSparkDraftModel), from a directory or a Hub repo id (through the
    Hugging Face cache; HF_HUB_OFFLINE applies). The config is checked against the target, then
    every weight name and shape against the config, before any compute. `dtype` and `window`
    are DFlash's (drafters.dflash.load_dflash_drafter); `confidence_k`: where the checkpoint has
    a confidence head, it sets K (False: the adaptive K); `tokenizer` is accepted for symmetry."""
    path, args, _ = read_checkpoint(path, target_sizes(model), block_size=None,
                                    draft_vocab=False, tree_budget=None, tree_width=4,
                                    window=window, config_class=DSparkConfig)
    args.read_head_width(check_safetensors(safetensors_files(path)))
    drafter_model, parts = load_checked_model(path, args, model, dtype, DSparkModel)
    return DSparkDrafter(drafter_model, confidence_k=confidence_k, **parts)
