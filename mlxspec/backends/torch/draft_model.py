"""A smaller transformers model with the target's tokenizer drafts K tokens autoregressively
(torch twin of mlxspec.drafters.draft_model).

Its DynamicCache keeps the longest prefix still valid after each verification, so a step feeds
only the tokens the draft model has not seen. Draft tokens stay on the device: the K draft steps
and the target's verification are read back once, by the target.
"""

import torch

from ...engine import Draft, Drafter, Verdict, common_prefix_length
from ...sampling import SamplingConfig
from .sampling import categorical, processed_logprobs
from .target import (
    cache_argument,
    cache_length,
    can_crop,
    crop,
    make_cache,
    model_device,
)
from .transfer import host_tokens


class TorchDraftModelDrafter(Drafter):
    name = "draft"
    backend = "torch"
    default_num_draft = 4

    def __init__(self, model):
        self.model = model
        self.device = model_device(model)
        self._cache_arg = cache_argument(model)
        self.cache = make_cache(model)
        if not can_crop(self.cache):
            raise ValueError(f"draft model cache {type(self.cache).__name__} cannot roll back")
        self._seen: list[int] = []  # tokens whose K/V are in self.cache (host values)
        self._fed_drafts = 0  # drafts fed to the cache this step, known after verification

    def begin(self, prompt, features=None):
        self.cache = make_cache(self.model)
        self._seen = []

    def _rewind_to(self, tokens: list[int]) -> int:
        """Crop the cache to the longest prefix shared with `tokens`; return its length."""
        keep = common_prefix_length(self._seen, tokens)
        keep = min(keep, len(tokens) - 1)  # always re-feed at least the last token
        crop(self.cache, cache_length(self.cache) - keep)
        self._seen = self._seen[:keep]
        return keep

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        keep = self._rewind_to(tokens)
        inputs = host_tokens(tokens[keep:], self.device)
        kwargs = {self._cache_arg: self.cache, "use_cache": True, "logits_to_keep": 1}
        drafted, probs = [], []
        for _ in range(k):
            logits = self.model(input_ids=inputs[None], **kwargs).logits[0, -1]
            if sampling.greedy:
                token = torch.argmax(logits, dim=-1)
            else:
                p = processed_logprobs(logits, sampling).exp()
                token = categorical(p)
                probs.append(p)
            drafted.append(token)
            inputs = token.reshape(1)
        self._seen = list(tokens)  # plus drafts[:-1], known on the host after verification
        self._fed_drafts = k - 1
        return Draft(tokens=torch.stack(drafted), probs=torch.stack(probs) if probs else None)

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self._seen += verdict.draft_tokens[: max(self._fed_drafts, 0)]
        self._fed_drafts = 0
