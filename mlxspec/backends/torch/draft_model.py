"""A smaller transformers model with the target's tokenizer drafts K tokens autoregressively:
drafters.draft_model's host side (DraftModelDrafting) with torch tensor math.

Its DynamicCache is cut back with crop. Draft tokens stay on the device: the K draft steps and
the target's verification are read back once, by the target.
"""

import torch

from ...drafters.draft_model import CUT_SLACK, DraftModelDrafting
from ...sampling import SamplingConfig
from .arrays import TorchArrays
from .sampling import categorical, processed_logprobs
from .dflash import block_mask
from .target import cache_argument, cache_length, can_crop, crop, make_cache, model_device
from .window_cache import room


class TorchDraftModelDrafter(DraftModelDrafting):
    """DraftModelDrafting with torch's tensor math, under inference mode, on the model's
    device."""

    backend = "torch"

    def __init__(self, model, window: int | None = None):
        self.xp = TorchArrays(model_device(model))
        self._cache_arg = cache_argument(model)
        super().__init__(model, window)
        if not can_crop(self.cache):
            raise ValueError(f"draft model cache {type(self.cache).__name__} cannot roll back")

    propose = torch.inference_mode()(DraftModelDrafting.propose)

    def _make_cache(self):
        return make_cache(self.model, slack=CUT_SLACK)

    def _cut(self, drop: int, keep: int) -> bool:
        """A sliding window crops only what it kept past the window; a longer cut starts
        afresh."""
        spare = room(self.cache)
        if spare is not None and drop > spare:
            return False
        crop(self.cache, drop)
        return True

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        kwargs = {self._cache_arg: self.cache, "use_cache": True, "logits_to_keep": 1}
        if self.window is not None:  # a 4D mask transformers uses as given: masked only
            past, n = cache_length(self.cache), ids.shape[1]
            visible = block_mask(past, past, n, causal=True, window=self.window,
                                 device=ids.device)
            kwargs["attention_mask"] = visible[None, None]
        return self.model(input_ids=ids, **kwargs).logits[0, -1]

    def _draw(self, logits: torch.Tensor, sampling: SamplingConfig):
        if sampling.greedy:
            return torch.argmax(logits, dim=-1), None
        p = processed_logprobs(logits, sampling).exp()
        return categorical(p), p
