"""A smaller model with the same tokenizer drafts K tokens autoregressively.

Its KV cache keeps the longest prefix that is still valid after each verification, so a step feeds
only the tokens the draft model has not seen. Drafting is lazy: the K draft steps and the target's
verification form one graph, evaluated once.
"""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..engine import Draft, Drafter, Verdict, common_prefix_length
from ..mlx_backend import untrimmable_caches
from ..sampling import SamplingConfig, processed_logprobs


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int):
    """Refuse a draft model whose token ids mean something else, before any compute."""
    if target_vocab != draft_vocab:
        raise ValueError(
            f"vocab size mismatch: the target's output layer has {target_vocab} tokens, the draft "
            f"model's has {draft_vocab}. A draft model must share the target's vocabulary."
        )
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_vocab != d_vocab:
        differ = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise ValueError(
            f"draft model tokenizer differs from the target's ({len(d_vocab)} vs {len(t_vocab)} "
            f"token strings, {differ} (token, id) pairs differ). A draft model must share the "
            "target's tokenizer."
        )


class DraftModelDrafter(Drafter):
    name = "draft"
    default_num_draft = 4

    def __init__(self, model):
        self.model = model
        self.cache = make_prompt_cache(model)
        bad = untrimmable_caches(self.cache)
        if bad:
            raise ValueError(f"draft model cache {', '.join(bad)} cannot roll back")
        self._seen: list[int] = []  # tokens whose K/V are in self.cache (host values)
        self._fed_drafts = 0  # drafts fed to the cache this step, known after verification

    def begin(self, prompt, features=None):
        self.cache = make_prompt_cache(self.model)
        self._seen = []

    def _rewind_to(self, tokens: list[int]) -> int:
        """Trim the cache to the longest prefix shared with `tokens`; return its length."""
        keep = common_prefix_length(self._seen, tokens)
        keep = min(keep, len(tokens) - 1)  # always re-feed at least the last token
        drop = len(self._seen) - keep
        if drop > 0:
            if all(c.is_trimmable() for c in self.cache):
                for c in self.cache:
                    c.trim(drop)
            else:
                self.cache, keep = make_prompt_cache(self.model), 0
        self._seen = self._seen[:keep]
        return keep

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        keep = self._rewind_to(tokens)
        inputs = mx.array(tokens[keep:], dtype=mx.int32)
        drafted, probs = [], []
        for i in range(k):
            logits = self.model(inputs[None], cache=self.cache)[0, -1]
            if sampling.greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                logp = processed_logprobs(logits, sampling)
                token = mx.random.categorical(logp)
                probs.append(mx.exp(logp))
            drafted.append(token)
            inputs = token.reshape(1)
        self._seen = list(tokens)  # plus drafts[:-1], known on the host after verification
        self._fed_drafts = k - 1
        return Draft(
            tokens=mx.stack(drafted).astype(mx.int32),
            probs=mx.stack(probs) if probs else None,
        )

    def commit(self, tokens: list[int], verdict: Verdict) -> None:
        self._seen += verdict.draft_tokens[: max(self._fed_drafts, 0)]
        self._fed_drafts = 0
