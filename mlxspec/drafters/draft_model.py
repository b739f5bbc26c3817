"""A smaller model with the same tokenizer drafts K tokens autoregressively.

Its cache keeps the longest prefix that is still valid after each verification, so a step feeds
only the tokens the draft model has not seen. Drafting is lazy: the K draft steps and the target's
verification form one graph, evaluated once.

A hybrid draft model (Qwen3.5, Qwen3-Next: recurrent layers beside attention) rolls back with the
target's machinery (mlxspec.rollback): attention caches are cut, recurrent states put back. Its
drafts are fed one position per call, so the recurrent states after each of them are already
there, and kept: a rollback to a kept length selects the states recorded there, computing
nothing. Any other length goes back to the states from before the step's feed and feeds again.
"""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..engine import Draft, Drafter, Verdict, common_prefix_length
from ..backends.mlx.target import untrimmable_caches
from ..rollback import (
    attention_trimmable,
    is_recurrent,
    recurrent_layers,
    restore,
    snapshot,
    trim_attention,
)
from ..sampling import SamplingConfig
from ..backends.mlx.sampling import processed_logprobs


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
        self._fresh_cache()
        bad = untrimmable_caches([c for c in self.cache if not is_recurrent(c)])
        if bad:
            raise ValueError(f"draft model cache {', '.join(bad)} cannot roll back")
        self._fed_drafts = 0  # drafts fed to the cache this step, known after verification

    def _fresh_cache(self) -> None:
        self.cache = make_prompt_cache(self.model)
        self._recurrent = recurrent_layers(self.cache)
        self._seen: list[int] = []  # tokens the cache holds (host values)
        # Length -> the recurrent layers' states when the cache held that many of `_seen`: the
        # lengths a rollback can reach without feeding (none needed without recurrent layers).
        self._states = {0: snapshot(self._recurrent)}

    def begin(self, prompt, features=None):
        self._fresh_cache()

    def _remember_states(self, length: int) -> None:
        """Keep the recurrent states of now, when the cache holds `length` positions."""
        if self._recurrent:
            self._states[length] = snapshot(self._recurrent)

    def _rewind_to(self, tokens: list[int]) -> int:
        """Cut the cache back to the longest prefix shared with `tokens` that it can reach (for a
        recurrent layer, a length whose states it kept); return that length."""
        keep = common_prefix_length(self._seen, tokens)
        keep = min(keep, len(tokens) - 1)  # always re-feed at least the last token
        if self._recurrent:
            keep = max((n for n in self._states if n <= keep), default=-1)
        drop = len(self._seen) - keep
        if drop > 0:
            if keep < 0 or not attention_trimmable(self.cache):
                self._fresh_cache()
                return 0
            trim_attention(self.cache, drop)
            if self._recurrent:
                restore(self._recurrent, self._states[keep])
        self._seen = self._seen[:keep]
        return keep

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig) -> Draft:
        keep = self._rewind_to(tokens)
        self._states = {}
        self._remember_states(keep)  # the fallback: feed again from here
        inputs = mx.array(tokens[keep:], dtype=mx.int32)
        drafted, probs = [], []
        for i in range(k):
            logits = self.model(inputs[None], cache=self.cache)[0, -1]
            self._remember_states(len(tokens) + i)  # tokens, then the first i drafts
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
